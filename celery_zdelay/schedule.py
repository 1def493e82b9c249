"""When a parked entry is due: ``countdown=`` and ``eta=`` as Celery reads them.

Due times are integer milliseconds. A countdown is counted on the Redis
server's clock (the store adds it to Redis ``TIME`` when parking), so every
due decision uses one clock; an ``eta`` is an absolute instant, read the way
Celery's worker reads it (a naive datetime is UTC).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from celery.utils.time import maybe_iso8601, maybe_make_aware

from .due_score import MAX_DUE_MS
from .errors import ConfigurationError

__all__ = ["MAX_DUE_MS", "Due", "due_from"]

#: Longest countdown accepted, in seconds (about 100 years).
MAX_COUNTDOWN_S = 100 * 365.25 * 86400


@dataclass(frozen=True)
class Due:
    """A due time: *ms* after the Redis clock (``"r"``) or at epoch *ms* (``"a"``)."""

    mode: Literal["r", "a"]
    ms: int


def due_from(countdown: Any = None, eta: Any = None) -> Due:
    """Return the due time given by *countdown* seconds or an *eta*.

    Raises:
        ConfigurationError: neither or both are given, or one is not a time.
    """
    if countdown is not None and eta is not None:
        raise ConfigurationError("Pass countdown= or eta=, not both.")
    if countdown is not None:
        if (
            isinstance(countdown, bool)
            or not isinstance(countdown, (int, float))
            or not math.isfinite(countdown)
            or abs(countdown) > MAX_COUNTDOWN_S
        ):
            raise ConfigurationError(
                f"countdown must be a number of seconds (at most {MAX_COUNTDOWN_S:.0f}), "
                f"got {countdown!r}."
            )
        # Rounded up: an entry is never released before its countdown is over.
        return Due("r", math.ceil(countdown * 1000))
    if eta is not None:
        when = _datetime(eta)
        ms = math.ceil(maybe_make_aware(when).timestamp() * 1000)
        if ms > MAX_DUE_MS:
            raise ConfigurationError(f"eta {eta!r} is too far in the future (after 2248).")
        return Due("a", ms)
    raise ConfigurationError(
        "A delayed task needs countdown= (seconds) or eta= (datetime); "
        "use apply_async() to send it now."
    )


def _datetime(eta: Any) -> datetime:
    try:
        when = maybe_iso8601(eta)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"eta must be a datetime or an ISO 8601 string, got {eta!r}."
        ) from exc
    if not isinstance(when, datetime):
        raise ConfigurationError(f"eta must be a datetime or an ISO 8601 string, got {eta!r}.")
    return when
