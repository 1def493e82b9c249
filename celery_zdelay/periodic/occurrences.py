"""When a periodic task runs next, computed by Celery's own schedule classes.

Every companion must compute the same occurrences from the same stored
state, so the next occurrence is a function of the previous one only:
Celery's ``remaining_estimate(last_run_at)`` is asked with its clock pinned
to *last_run_at*, which turns "time left from now" into "the next run after
that one". Timezones, ``relative`` and DST are then Celery's behaviour,
as Celery 5.7 has it on every Celery this package supports (see
:func:`_on_the_wall_clock`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone, tzinfo

from celery.schedules import BaseSchedule, crontab, schedule

__all__ = ["MAX_MISSED", "Plan", "next_after", "plan"]

#: Most missed occurrences parked at once with ``zdelay_missed="all"``.
MAX_MISSED = 1000
#: Most occurrences computed in one plan (a long outage of a short crontab).
MAX_STEPS = 200_000
#: Missed occurrences left out one by one before jumping to near now.
JUMP_AFTER = 100


def next_after(sched: BaseSchedule, after_ms: int) -> int:
    """Return the first occurrence of *sched* strictly after *after_ms* (epoch ms)."""
    step = _interval_ms(sched)
    if step:
        # Plain intervals need no calendar: a fixed step from the anchor.
        return after_ms + step
    after = datetime.fromtimestamp(after_ms / 1000, tz=timezone.utc)
    if isinstance(sched, crontab):
        # Celery before 5.7 reads a crontab's fields off the datetime it is
        # given, in that datetime's zone: given UTC, a 03:00 Paris crontab
        # would run at 03:00Z. In its own zone it runs at 03:00 Paris.
        after = after.astimezone(sched.tz)
    pinned = copy.copy(sched)
    pinned.nowfun = lambda: after
    remaining = pinned.remaining_estimate(after)
    next_ms = after_ms + round(remaining.total_seconds() * 1000)
    if isinstance(sched, crontab):
        next_ms = _on_the_wall_clock(sched, after, next_ms)
    # Sub-second rounding (relative intervals, solar) must still move forward.
    return next_ms if next_ms > after_ms else after_ms + 1


def _on_the_wall_clock(sched: crontab, after: datetime, next_ms: int) -> int:
    """Return *next_ms*, or the time its crontab fields meant when a DST change moved it.

    Celery before 5.7 adds the wall-clock distance to the next run to the
    absolute time: across a change of the clocks a daily 03:00 ran at 02:00
    (an hour early, when they go back) or 04:00 (late, when they go forward).
    That run's wall-clock time, put back in the zone, is the one meant; it is
    taken only when Celery's own answer does not match the crontab's hour
    and minute and the corrected one does, so a Celery that gets it right
    (5.7) is never second-guessed.
    """
    zone = after.tzinfo
    if _matches(sched, next_ms, zone):
        return next_ms
    wall = after.replace(tzinfo=None) + timedelta(milliseconds=next_ms - _ms(after))
    meant = _ms(wall.replace(tzinfo=zone))
    return meant if meant > _ms(after) and _matches(sched, meant, zone) else next_ms


def _matches(sched: crontab, at_ms: int, zone: tzinfo | None) -> bool:
    local = datetime.fromtimestamp(at_ms / 1000, tz=zone)
    return local.minute in sched.minute and local.hour in sched.hour


def _ms(moment: datetime) -> int:
    return round(moment.timestamp() * 1000)


@dataclass(frozen=True)
class Plan:
    """What to park for one schedule in one pass."""

    #: Occurrence ms to park now, in order.
    park: list[int]
    #: Occurrences no companion parked in time, left out by the missed policy
    #: (estimated from the mean gap when a long outage was skipped over).
    skipped: int
    #: The newest occurrence considered (parked or not): the new pointer.
    pointer_ms: int
    #: The skipped occurrences stepped over one by one (not those a long
    #: outage jumped over), at most :data:`MAX_MISSED`: what ``periodic
    #: backfill`` can run later.
    missed: list[int] = field(default_factory=list)


def plan(
    sched: BaseSchedule,
    *,
    pointer_ms: int,
    now_ms: int,
    horizon_ms: int,
    missed: str,
    inclusive: bool = False,
) -> Plan:
    """Plan the occurrences after *pointer_ms* (the newest one parked, or the anchor).

    Occurrences up to ``now + horizon`` are parked ahead of time, and the
    first one after that too, so the next one is always parked while the
    current one is released. Occurrences at or before *now* were due while
    no companion parked them: the *missed* policy picks which of them run
    (``once``: the first, ``skip``: none, ``all``: each, at most
    :data:`MAX_MISSED`, the first ones).

    The result depends on *now* only through where "missed" ends and
    "ahead" begins: the occurrence times are those of the schedule from
    *pointer_ms* on, and the missed ones chosen are counted from the
    pointer, so companions that plan from the same pointer at different
    moments park the same ids (``park_once`` keeps each once) and run the
    same missed one. With *inclusive*, the schedule's first occurrence at
    or after *pointer_ms* runs whatever the policy: it is a tick that was
    parked in time and still waiting when its definition changed, taken
    over by the new version (see define.lua); it counts as the missed run.
    """
    if pointer_ms > now_ms + horizon_ms:
        return Plan(park=[], skipped=0, pointer_ms=pointer_ms)
    keep = {"all": MAX_MISSED, "once": 1}.get(missed, 0)
    interval = _interval_ms(sched)
    late: list[int] = []
    ahead: list[int] = []
    missed_at: list[int] = []
    skipped = 0
    # The occurrences stepped one by one, the first at *first*.
    stepped, first = 0, 0
    at = pointer_ms
    if inclusive:
        at = pointer_ms - interval if interval else pointer_ms - 1
    taken_over = inclusive
    for _ in range(MAX_STEPS):
        at = next_after(sched, at)
        if at <= now_ms:
            stepped += 1
            first = first or at
            if len(late) < keep or taken_over:
                taken_over = False
                late.append(at)
                continue
            skipped += 1
            if len(missed_at) < MAX_MISSED:
                missed_at.append(at)
            if skipped >= JUMP_AFTER:
                # A long outage: jump over what no policy runs, in whole
                # periods from this occurrence, so a plain interval keeps its
                # phase (anchor + k * period) whoever jumps and whenever;
                # calendar schedules give the same occurrences from any
                # starting point. A calendar period is the mean gap of the
                # occurrences stepped so far (at least 1 ms: each is after
                # the one before), so an uneven calendar (minutes 0-4 of one
                # hour a day) is counted at its own rate, not at its
                # shortest gap's; close to now, it steps on (never
                # backwards).
                period = interval or (at - first) // (stepped - 1)
                periods = max(0, (now_ms - 2 * period - at) // period)
                at += periods * period
                skipped += periods
            continue
        ahead.append(at)
        if at > now_ms + horizon_ms:
            break
    else:
        # Years of a minute schedule missed: go on from here next pass.
        return Plan(park=late, skipped=skipped, pointer_ms=at, missed=missed_at)
    return Plan(park=late + ahead, skipped=skipped, pointer_ms=ahead[-1], missed=missed_at)


def _interval_ms(sched: BaseSchedule) -> int:
    """The fixed step of a plain interval, 0 for calendar (and relative) schedules."""
    if type(sched) is schedule and not sched.relative:
        step: int = max(1, round(sched.run_every.total_seconds() * 1000))
        return step
    return 0
