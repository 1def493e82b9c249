"""Wake a sleeping companion when an earlier entry is parked.

park.lua publishes on the shard's wake channel when the earliest due time
moves earlier; a thread listens and sets an event the companion sleeps on.
The companion still wakes on its own timer, so a lost message (a dropped
connection, a producer whose ACL user may not publish) costs at most one
idle interval, never an entry.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence

import redis

from ..store.client import StoreClient
from ..store.health import wake_refusal

__all__ = ["Wakeup"]

logger = logging.getLogger(__name__)

#: Longest pause between reconnect attempts of the listener, in seconds.
MAX_RECONNECT_PAUSE = 5.0
#: Seconds between attempts to subscribe while Redis refuses it (an ACL):
#: often enough to notice the fix, rarely enough to keep the log quiet.
REFUSED_RETRY_SECONDS = 30.0


class Wakeup:
    """Listens on the wake channels of some shards."""

    def __init__(self, client: StoreClient, channels: Sequence[str]) -> None:
        self._client = client
        self._channels = list(channels)
        self._event = threading.Event()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._listen, name="zdelay-wakeup", daemon=True)
        #: Why wake-ups do not arrive (a permission Redis refused), or None.
        self.problem: str | None = None

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
        # The thread outlives every error: the companion's on-time wake-ups
        # depend on it, and the release loop cannot restart it.
        pause = 0.1
        while not self._closing.is_set():
            # Typed from redis-py 8 on, untyped before: the ignore covers both.
            pubsub = self._client.pubsub()  # type: ignore[no-untyped-call, unused-ignore]
            try:
                pubsub.subscribe(*self._channels)
                confirmed = 0
                while not self._closing.is_set():
                    # A refusal (NOPERM) is the reply to SUBSCRIBE: it raises here.
                    message = pubsub.get_message(timeout=1.0)
                    if message is None:
                        continue
                    if message["type"] == "subscribe":
                        confirmed += 1
                        if confirmed == len(self._channels):
                            self._subscribed()
                            pause = 0.1
                            # Entries may have been parked while we were not listening.
                            self._event.set()
                    elif message["type"] == "message":
                        self._event.set()
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                logger.debug("Wake-up listener lost Redis (%r); retrying in %.1fs", exc, pause)
                self._closing.wait(pause)
                pause = min(pause * 2, MAX_RECONNECT_PAUSE)
            except redis.exceptions.ResponseError as exc:
                self._refused(exc)
                self._closing.wait(REFUSED_RETRY_SECONDS)
            except Exception:
                logger.exception("Wake-up listener failed; retrying in %.1fs", MAX_RECONNECT_PAUSE)
                self._closing.wait(MAX_RECONNECT_PAUSE)
            finally:
                with contextlib.suppress(Exception):  # closing a dead connection
                    pubsub.close()

    def _refused(self, exc: Exception) -> None:
        problem = wake_refusal(exc, self._channels, action="subscribe to")
        if problem != self.problem:
            logger.warning("%s", problem)
        self.problem = problem

    def _subscribed(self) -> None:
        if self.problem is not None:
            logger.info("Wake-up channels subscribed again: on-time wake-ups resume.")
        self.problem = None
