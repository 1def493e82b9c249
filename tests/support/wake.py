"""The wake-ups a script publishes to shard 0's companions, read in order."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis

from tests.helpers import wait_for
from tests.support.keys import SHARD0

__all__ = ["wake_ups"]

#: Published last by the reader itself: messages on one channel arrive in order.
_END = b"end of the wake-ups"


@contextmanager
def wake_ups(client: redis.Redis) -> Iterator[list[bytes]]:
    """Listen on shard 0's wake channel; on leaving, the list holds what was published inside."""
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(SHARD0.wake)
    wait_for(lambda: client.pubsub_numsub(SHARD0.wake)[0][1] == 1, message="subscribed")
    seen: list[bytes] = []
    try:
        yield seen
        client.publish(SHARD0.wake, _END)

        def read_to_the_end() -> bool:
            message = pubsub.get_message(timeout=0.1)
            if message is not None:
                seen.append(message["data"])
            return bool(seen) and seen[-1] == _END

        wait_for(read_to_the_end, message="the wake-ups up to the last message")
        seen.pop()
    finally:
        pubsub.close()
