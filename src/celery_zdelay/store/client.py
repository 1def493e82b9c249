"""The redis-py client of the store, built from the ``zdelay_*`` settings."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from kombu.utils.url import maybe_sanitize_url
from redis.backoff import AbstractBackoff
from redis.retry import Retry

from ..config import RetryPolicy, ZDelayConfig
from ..errors import StoreUnavailableError

__all__ = ["make_client", "sanitize_url", "unavailable_as_error"]

#: Seconds to wait for a TCP connection to the store before retrying.
DEFAULT_CONNECT_TIMEOUT = 5.0
#: Seconds to wait for a reply; scripts are bounded to milliseconds.
DEFAULT_SOCKET_TIMEOUT = 10.0

_UNAVAILABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


class _PolicyBackoff(AbstractBackoff):
    """The pauses of a Celery-style retry policy, for redis-py's Retry."""

    def __init__(self, policy: RetryPolicy) -> None:
        self._intervals = policy.intervals() or [0.0]

    def reset(self) -> None:
        pass

    def compute(self, failures: int) -> float:
        return self._intervals[min(failures, len(self._intervals)) - 1]


def make_client(config: ZDelayConfig) -> redis.Redis:
    """Return a client of the store at ``config.redis_url``.

    Responses stay bytes: payloads are opaque and may hold any byte.
    """
    options: dict[str, Any] = {
        "socket_connect_timeout": DEFAULT_CONNECT_TIMEOUT,
        "socket_timeout": DEFAULT_SOCKET_TIMEOUT,
        "health_check_interval": 30,
    }
    options.update(config.redis_options)
    options["decode_responses"] = False
    options["retry"] = Retry(_PolicyBackoff(config.retry_policy), config.retry_policy.max_retries)
    options["retry_on_error"] = list(_UNAVAILABLE)
    return redis.Redis.from_url(config.redis_url, **options)


def sanitize_url(url: str) -> str:
    """Return *url* with its password hidden, for logs and messages."""
    return str(maybe_sanitize_url(url))


@contextmanager
def unavailable_as_error(url: str) -> Iterator[None]:
    """Turn redis-py's connection failures into :class:`StoreUnavailableError`."""
    try:
        yield
    except _UNAVAILABLE as exc:
        raise StoreUnavailableError(
            f"Cannot reach the celery-zdelay store at {sanitize_url(url)}: {exc}. "
            "Check that Redis is running and that zdelay_redis_url points to it; "
            "nothing was changed by this call."
        ) from exc
