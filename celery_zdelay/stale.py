"""Stale releases: a task released more than ``max_late`` after its due time.

After an outage, a long pause or a rate-limit backlog, a 09:00 reminder
released at 15:00 is often wrong. ``apply_delayed(..., max_late=600)`` (or the
companions' ``zdelay_max_late``) bounds how late a release may be; past it,
``zdelay_on_stale`` decides:

- ``"dead"`` (the default): dead-lettered with reason ``"stale"``, requeue-able
  like every dead letter;
- ``"drop"``: cancelled, and recorded as every cancel is (``REVOKED``,
  :data:`~celery_zdelay.signals.tasks_cancelled`, ``task-revoked``);
- ``"run"``: published anyway, and counted.

Lateness is the Redis clock at the claim minus the due time (both on the Redis
clock), so a companion whose own clock is off decides the same. Periodic
occurrences are never stale: their schedule's ``zdelay_missed`` decides what
runs after a gap (:mod:`celery_zdelay.periodic`).

This module holds the rule (what a valid limit is, which entries it applies
to); where the limit is stored is :mod:`celery_zdelay.entry`, and what a
release does with a stale entry is :mod:`celery_zdelay.companion.release`.
"""

from __future__ import annotations

import math
import numbers
from datetime import timedelta
from typing import Any

from .errors import ConfigurationError

__all__ = [
    "MAX_LATE_HIGHEST_SECONDS",
    "MAX_LATE_LOWEST_SECONDS",
    "ON_STALE",
    "PERIODIC_ID_PREFIX",
    "STALE_REASON",
    "exempt",
    "is_stale",
    "max_late_ms",
    "on_stale",
]

#: What ``zdelay_on_stale`` may say; the first is the default.
ON_STALE = ("dead", "drop", "run")
#: The reason a stale entry is dead-lettered with.
STALE_REASON = "stale"
#: Least ``max_late``: a healthy companion releases a few ms late, and a
#: batch claimed under load can take a few hundred ms; a limit below a second
#: would dead-letter tasks that were released on time.
MAX_LATE_LOWEST_SECONDS = 1
#: Largest ``max_late`` (ten years): its ms fit the metadata line's field.
MAX_LATE_HIGHEST_SECONDS = 10 * 366 * 24 * 3600
#: What the task id of every periodic occurrence starts with
#: (:func:`celery_zdelay.periodic.server.occurrence_id`): those follow their
#: schedule's ``zdelay_missed`` instead (handoff.lua checks the same prefix).
PERIODIC_ID_PREFIX = "periodic:"


def max_late_ms(value: Any, where: str = "max_late") -> int | None:
    """Return *value* (seconds, or a ``timedelta``) in whole ms; ``None`` for no limit.

    ``apply_delayed(max_late=)`` and ``zdelay_max_late`` read it here.

    Raises:
        ConfigurationError: it is not a number of seconds from
            :data:`MAX_LATE_LOWEST_SECONDS` to :data:`MAX_LATE_HIGHEST_SECONDS`
            (a bool, a string, NaN, zero, negative, too large).
    """
    if value is None:
        return None
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, numbers.Real)
        or not math.isfinite(float(seconds))
        or not MAX_LATE_LOWEST_SECONDS <= float(seconds) <= MAX_LATE_HIGHEST_SECONDS
    ):
        raise ConfigurationError(
            f"{where} must be a number of seconds from {MAX_LATE_LOWEST_SECONDS} to "
            f"{MAX_LATE_HIGHEST_SECONDS} (or a timedelta): how late after its due time a "
            f"task may still be released; leave it out (None) for no limit. Got {value!r}. "
            "Nothing was parked."
            if where == "max_late"
            else f"{where} must be a number of seconds from {MAX_LATE_LOWEST_SECONDS} to "
            f"{MAX_LATE_HIGHEST_SECONDS} (or a timedelta), or None for no limit; got {value!r}."
        )
    return math.ceil(float(seconds) * 1000)


def on_stale(value: Any) -> str:
    """Return ``zdelay_on_stale`` checked (``None``: the default, ``"dead"``).

    Raises:
        ConfigurationError: it is not one of :data:`ON_STALE`.
    """
    if value is None:
        return ON_STALE[0]
    if value not in ON_STALE:
        raise ConfigurationError(
            f"zdelay_on_stale must be one of {', '.join(repr(v) for v in ON_STALE)}, got "
            f'{value!r}: "dead" dead-letters a stale task (requeue-able), "drop" cancels '
            'it, "run" publishes it anyway.'
        )
    return str(value)


def exempt(task_id: str) -> bool:
    """Whether *task_id* is never stale: a periodic occurrence (see :data:`PERIODIC_ID_PREFIX`)."""
    return task_id.startswith(PERIODIC_ID_PREFIX)


def is_stale(late_ms: int, limit_ms: int | None) -> bool:
    """Whether a release *late_ms* after the due time is past *limit_ms* (None: no limit).

    handoff.lua applies the same comparison (strictly later than the limit).
    """
    return limit_ms is not None and late_ms > limit_ms
