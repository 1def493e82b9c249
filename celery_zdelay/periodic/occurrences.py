"""When a periodic task runs next, computed by Celery's own schedule classes.

Every companion must compute the same occurrences from the same stored
state, so the next occurrence is a function of the previous one only:
Celery's ``remaining_estimate(last_run_at)`` is asked with its clock pinned
to *last_run_at*, which turns "time left from now" into "the next run after
that one". Timezones, ``relative`` and DST are then Celery's behaviour.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from datetime import datetime, timezone

from celery.schedules import BaseSchedule, schedule

__all__ = ["MAX_MISSED", "Plan", "next_after", "plan"]

#: Most missed occurrences parked at once with ``zdelay_missed="all"``.
MAX_MISSED = 1000
#: Most occurrences computed in one plan (a long outage of a short crontab).
MAX_STEPS = 200_000
#: Missed occurrences computed one by one before skipping to near now
#: (policies other than ``all`` run at most the latest of them).
JUMP_AFTER = 100


def next_after(sched: BaseSchedule, after_ms: int) -> int:
    """Return the first occurrence of *sched* strictly after *after_ms* (epoch ms)."""
    if type(sched) is schedule and not sched.relative:
        # Plain intervals need no calendar: a fixed step from the anchor.
        step: int = max(1, round(sched.run_every.total_seconds() * 1000))
        return after_ms + step
    after = datetime.fromtimestamp(after_ms / 1000, tz=timezone.utc)
    pinned = copy.copy(sched)
    pinned.nowfun = lambda: after
    remaining = pinned.remaining_estimate(after)
    next_ms = after_ms + round(remaining.total_seconds() * 1000)
    # Sub-second rounding (relative intervals, solar) must still move forward.
    return next_ms if next_ms > after_ms else after_ms + 1


@dataclass(frozen=True)
class Plan:
    """What to park for one schedule in one pass."""

    #: Occurrence ms to park now, in order.
    park: list[int]
    #: Occurrences no companion parked in time, left out by the missed policy
    #: (estimated from the period when a long outage was skipped over).
    skipped: int
    #: The newest occurrence considered (parked or not): the new pointer.
    pointer_ms: int


def plan(
    sched: BaseSchedule,
    *,
    pointer_ms: int,
    now_ms: int,
    horizon_ms: int,
    missed: str,
) -> Plan:
    """Plan the occurrences after *pointer_ms* (the newest one parked, or the anchor).

    Occurrences up to ``now + horizon`` are parked ahead of time, so the next
    one is already parked while the current one is released. Occurrences at
    or before *now* were due while no companion parked them: the *missed*
    policy picks which of them run (``once``: the latest, ``skip``: none,
    ``all``: each, at most :data:`MAX_MISSED`).
    """
    if pointer_ms > now_ms + horizon_ms:
        return Plan(park=[], skipped=0, pointer_ms=pointer_ms)
    late: list[int] = []
    ahead: list[int] = []
    at = pointer_ms
    skipped = 0
    if type(sched) is schedule and not sched.relative:
        # A long outage of a short interval: jump over what no policy parks.
        step = max(1, round(sched.run_every.total_seconds() * 1000))
        behind = (now_ms - at) // step - MAX_MISSED
        if behind > 0:
            at += behind * step
            skipped += behind
    for _ in range(MAX_STEPS):
        previous, at = at, next_after(sched, at)
        if at <= now_ms:
            late.append(at)
            if len(late) > MAX_MISSED:
                skipped += len(late) - MAX_MISSED
                late = late[-MAX_MISSED:]
            if missed != "all" and len(late) >= JUMP_AFTER:
                # Only the latest missed one can run: skip to two periods
                # before now instead of computing every occurrence between.
                # Calendar schedules (crontab, solar, relative) give the same
                # occurrences from any starting point, so companions agree.
                period = max(1, at - previous)
                near = now_ms - 2 * period
                if near > at:
                    # (How many were jumped over is estimated from the period.)
                    skipped += len(late) + (near - at) // period
                    late, at = [], near
            continue
        ahead.append(at)
        if at > now_ms + horizon_ms:
            break
    else:
        # Years of a minute schedule missed: go on from now, not from the past.
        ahead.append(next_after(sched, now_ms))
    if missed == "all":
        chosen = late
    elif missed == "once":
        chosen = late[-1:]
    else:
        chosen = []
    skipped += len(late) - len(chosen)
    return Plan(park=chosen + ahead, skipped=skipped, pointer_ms=ahead[-1])
