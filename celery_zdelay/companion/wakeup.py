"""Wake a sleeping companion when an earlier entry is parked.

park.lua publishes on the shard's wake channel when the earliest due time
moves earlier; a thread listens and sets an event the companion sleeps on.
The companion still wakes on its own timer, so a lost message (a dropped
connection) costs at most one idle interval, never an entry.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence

import redis

from ..store.client import StoreClient

__all__ = ["Wakeup"]

logger = logging.getLogger(__name__)

#: Longest pause between reconnect attempts of the listener, in seconds.
MAX_RECONNECT_PAUSE = 5.0


class Wakeup:
    """Listens on the wake channels of some shards."""

    def __init__(self, client: StoreClient, channels: Sequence[str]) -> None:
        self._client = client
        self._channels = list(channels)
        self._event = threading.Event()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._listen, name="zdelay-wakeup", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closing.set()
        self._thread.join(timeout=5)

    def wait(self, timeout: float) -> bool:
        """Sleep up to *timeout* seconds or until woken; return whether woken."""
        woken = self._event.wait(timeout)
        if woken:
            self._event.clear()
        return woken

    def _listen(self) -> None:
        pause = 0.1
        while not self._closing.is_set():
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
            try:
                pubsub.subscribe(*self._channels)
                # Entries may have been parked while we were not listening.
                self._event.set()
                pause = 0.1
                while not self._closing.is_set():
                    if pubsub.get_message(timeout=1.0) is not None:
                        self._event.set()
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                logger.debug("Wake-up listener lost Redis (%r); retrying in %.1fs", exc, pause)
                self._closing.wait(pause)
                pause = min(pause * 2, MAX_RECONNECT_PAUSE)
            finally:
                with contextlib.suppress(Exception):  # closing a dead connection
                    pubsub.close()
