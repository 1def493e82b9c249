"""The clocks tests compare against."""

from __future__ import annotations

import redis

__all__ = ["redis_ms"]


def redis_ms(client: redis.Redis) -> int:
    """Return the Redis server's clock (``TIME``) in epoch milliseconds.

    Due times are on this clock; a test that checks "never early" or "at
    Redis-now + countdown" reads it independently of any script's reply.
    """
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000
