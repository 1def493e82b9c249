"""Each periodic occurrence is computed from the previous one alone, and planned by its policy.

Pins each line of ``celery_zdelay/periodic/occurrences.py`` that mutation
testing found unguarded (see docs/mutation.rst): :func:`next_after` gives
the schedule's first occurrence strictly after a time, for plain intervals,
relative intervals and crontabs; :func:`plan` parks what is due up to
``now + horizon`` and the first one after it, and of the occurrences at or
before *now* the ones the missed policy runs (``once`` the first, ``all``
each up to :data:`MAX_MISSED`, ``skip`` none), counting the others, keeping
an interval's phase over a long outage. Pure functions: no server needed;
the stories through companions and workers are in test_periodic*.py.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta, timezone

import pytest
from celery.schedules import crontab, schedule

from celery_zdelay.periodic.occurrences import (
    JUMP_AFTER,
    MAX_MISSED,
    MAX_STEPS,
    Plan,
    next_after,
    plan,
)

pytestmark = pytest.mark.timeout(60)

#: 2023-11-14 22:13:20.123 UTC: not on a whole second, minute or hour.
T = 1_700_000_000_123
SECOND, MINUTE, HOUR = 1000, 60_000, 3_600_000
EVERY_10S = schedule(timedelta(seconds=10))
EVERY_5_MIN = crontab(minute="*/5")


def _utc(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc)


def test_a_plain_interval_steps_by_its_period_from_the_previous_occurrence() -> None:
    assert next_after(EVERY_10S, T) == T + 10 * SECOND
    assert next_after(schedule(timedelta(hours=1)), T) == T + HOUR
    assert next_after(schedule(timedelta(milliseconds=1500)), T) == T + 1500


def test_an_interval_under_a_millisecond_still_moves_forward_by_one() -> None:
    for tiny in (schedule(timedelta(microseconds=100)), schedule(timedelta(microseconds=400))):
        assert next_after(tiny, T) == T + 1
    assert next_after(schedule(timedelta(microseconds=400), relative=True), T) == T + 1


def test_a_relative_schedule_due_at_the_very_time_asked_still_moves_forward() -> None:
    # Celery rounds a relative schedule to whole seconds: asked on a whole
    # second, a sub-second one is due "now", which is not strictly after.
    whole = (T // SECOND) * SECOND
    for period in (timedelta(microseconds=400), timedelta(milliseconds=500)):
        assert next_after(schedule(period, relative=True), whole) == whole + 1


def test_a_relative_interval_lands_on_whole_periods_of_the_clock() -> None:
    hourly = schedule(timedelta(hours=1), relative=True)
    assert next_after(hourly, T) == (T // HOUR + 1) * HOUR
    assert next_after(hourly, (T // HOUR + 1) * HOUR) == (T // HOUR + 2) * HOUR


def test_a_crontab_gives_its_next_calendar_time_strictly_after() -> None:
    first = next_after(EVERY_5_MIN, T)
    assert _utc(first) == datetime(2023, 11, 14, 22, 15, tzinfo=timezone.utc)
    # From an occurrence itself: the next one, never the same.
    assert next_after(EVERY_5_MIN, first) == first + 5 * MINUTE
    assert next_after(EVERY_5_MIN, first - 1) == first
    daily = crontab(minute=30, hour=4)
    assert _utc(next_after(daily, T)) == datetime(2023, 11, 15, 4, 30, tzinfo=timezone.utc)


def test_a_plan_parks_up_to_the_horizon_and_the_first_occurrence_after_it() -> None:
    pointer = T
    result = plan(EVERY_10S, pointer_ms=pointer, now_ms=T, horizon_ms=35 * SECOND, missed="once")
    expected = [T + k * 10 * SECOND for k in (1, 2, 3, 4)]
    assert result == Plan(park=expected, skipped=0, pointer_ms=expected[-1])


def test_an_occurrence_exactly_at_the_horizon_is_parked_with_the_one_after_it() -> None:
    result = plan(EVERY_10S, pointer_ms=T, now_ms=T, horizon_ms=30 * SECOND, missed="once")
    expected = [T + k * 10 * SECOND for k in (1, 2, 3, 4)]
    assert result == Plan(park=expected, skipped=0, pointer_ms=expected[-1])


def test_a_pointer_at_the_horizon_still_parks_the_next_one_and_beyond_parks_nothing() -> None:
    now, horizon = T, 30 * SECOND
    at_edge = plan(
        EVERY_10S, pointer_ms=now + horizon, now_ms=now, horizon_ms=horizon, missed="once"
    )
    assert at_edge == Plan(
        park=[now + horizon + 10 * SECOND], skipped=0, pointer_ms=now + 40 * SECOND
    )
    beyond = plan(
        EVERY_10S, pointer_ms=now + horizon + 1, now_ms=now, horizon_ms=horizon, missed="once"
    )
    assert beyond == Plan(park=[], skipped=0, pointer_ms=now + horizon + 1)


def _missed(
    policy: str, count: int, sched: schedule = EVERY_10S, period: int = 10 * SECOND
) -> Plan:
    """Plan after *count* occurrences were missed: the last one exactly at now."""
    pointer = T
    now = T + count * period
    return plan(sched, pointer_ms=pointer, now_ms=now, horizon_ms=period - 1, missed=policy)


def test_an_occurrence_exactly_at_now_counts_as_missed() -> None:
    result = _missed("skip", 1)
    assert result == Plan(
        park=[T + 20 * SECOND], skipped=1, pointer_ms=T + 20 * SECOND, missed=[T + 10 * SECOND]
    )


def test_missed_once_runs_the_first_missed_occurrence_and_counts_the_rest() -> None:
    result = _missed("once", 5)
    assert result.park == [T + 10 * SECOND, T + 60 * SECOND]
    assert result.skipped == 4
    assert result.pointer_ms == T + 60 * SECOND


def test_missed_skip_runs_none_of_them() -> None:
    result = _missed("skip", 5)
    stepped_over = [T + k * 10 * SECOND for k in range(1, 6)]
    assert result == Plan(
        park=[T + 60 * SECOND], skipped=5, pointer_ms=T + 60 * SECOND, missed=stepped_over
    )
    # An unknown policy keeps none either.
    assert _missed("whatever", 5) == result


def test_missed_all_runs_each_up_to_the_limit() -> None:
    few = _missed("all", 5)
    assert few.park == [T + k * 10 * SECOND for k in range(1, 7)]
    assert few.skipped == 0
    assert MAX_MISSED == 1000
    many = _missed("all", MAX_MISSED + 500)
    assert len(many.park) == MAX_MISSED + 1
    assert many.park[:MAX_MISSED] == [T + k * 10 * SECOND for k in range(1, MAX_MISSED + 1)]
    assert many.skipped == 500
    assert many.park[-1] == T + (MAX_MISSED + 501) * 10 * SECOND


@pytest.mark.parametrize("policy", ["skip", "once"])
def test_a_long_outage_counts_every_missed_occurrence_and_keeps_the_phase(policy: str) -> None:
    missed = 100_000  # far past the point where the plan jumps over whole periods
    result = _missed(policy, missed)
    kept = 1 if policy == "once" else 0
    assert result.skipped == missed - kept
    next_one = T + (missed + 1) * 10 * SECOND
    assert result.park[-1] == next_one == result.pointer_ms
    assert result.park[:kept] == [T + 10 * SECOND][:kept]
    assert len(result.park) == kept + 1


def test_a_long_outage_of_a_crontab_counts_every_missed_occurrence() -> None:
    start = next_after(EVERY_5_MIN, T)
    missed = 5000
    now = start + (missed - 1) * 5 * MINUTE  # the last missed occurrence is exactly now
    result = plan(EVERY_5_MIN, pointer_ms=start - 1, now_ms=now, horizon_ms=MINUTE, missed="skip")
    # Listed for a backfill: the ones stepped over one by one before the
    # jump, then those stepped over after it (the jump lands two periods
    # short of now); the jumped-over ones are only counted.
    stepped_over = [start + k * 5 * MINUTE for k in range(JUMP_AFTER)]
    after_jump = [now - 5 * MINUTE, now]
    assert result == Plan(
        park=[now + 5 * MINUTE],
        skipped=missed,
        pointer_ms=now + 5 * MINUTE,
        missed=stepped_over + after_jump,
    )


def test_a_long_outage_of_an_irregular_crontab_counts_about_what_was_missed() -> None:
    # Breaks if: the jump's calendar period is the last gap (one minute here)
    # instead of the mean gap of the occurrences stepped over: 30 days of
    # five runs a morning were counted as 15,287 missed, not about 150.
    mornings = crontab(minute="0-4", hour=9)
    start = next_after(mornings, T)
    now = start + 30 * 24 * HOUR
    at, missed = start - 1, 0
    while (at := next_after(mornings, at)) <= now:
        missed += 1
    result = plan(mornings, pointer_ms=start - 1, now_ms=now, horizon_ms=MINUTE, missed="skip")
    assert missed == 151
    assert abs(result.skipped - missed) <= missed // 10
    assert result.park[0] == next_after(mornings, now)


def test_an_inclusive_plan_runs_the_occurrence_at_the_pointer_whatever_the_policy() -> None:
    # An interval: the pointer is an occurrence; a crontab: the pointer is on
    # its calendar; a relative interval under a millisecond: every
    # millisecond is an occurrence, so the one before the pointer is not it.
    start = next_after(EVERY_5_MIN, T)
    tiny = schedule(timedelta(microseconds=400), relative=True)
    for sched, pointer, period in (
        (EVERY_10S, T, 10 * SECOND),
        (EVERY_5_MIN, start, 5 * MINUTE),
        (tiny, T, 1),
    ):
        now = pointer + 3 * period
        result = plan(
            sched, pointer_ms=pointer, now_ms=now, horizon_ms=0, missed="skip", inclusive=True
        )
        skipped = [pointer + k * period for k in (1, 2, 3)]
        assert result == Plan(
            park=[pointer, now + period], skipped=3, pointer_ms=now + period, missed=skipped
        )
        # Not inclusive: the occurrence at the pointer was parked already.
        plain = plan(sched, pointer_ms=pointer, now_ms=now, horizon_ms=0, missed="skip")
        assert plain == Plan(
            park=[now + period], skipped=3, pointer_ms=now + period, missed=skipped
        )


def test_an_inclusive_plan_ahead_of_now_parks_the_occurrence_at_the_pointer_once() -> None:
    result = plan(
        EVERY_10S, pointer_ms=T, now_ms=T - 1, horizon_ms=15 * SECOND, missed="once", inclusive=True
    )
    assert result == Plan(
        park=[T, T + 10 * SECOND, T + 20 * SECOND], skipped=0, pointer_ms=T + 20 * SECOND
    )


def test_a_plan_computes_at_most_its_step_limit_and_goes_on_from_there_next_pass() -> None:
    assert MAX_STEPS == 200_000
    second = schedule(timedelta(seconds=1))
    result = plan(
        second, pointer_ms=T, now_ms=T, horizon_ms=(MAX_STEPS + 10) * SECOND, missed="once"
    )
    assert result == Plan(park=[], skipped=0, pointer_ms=T + MAX_STEPS * SECOND)


def test_a_plan_is_asked_for_by_name_so_two_times_cannot_be_swapped() -> None:
    # pointer_ms, now_ms and horizon_ms are all ints: given by position, a
    # swap would plan silently wrong.
    with pytest.raises(TypeError):
        plan(EVERY_10S, T, T, SECOND, "once")  # type: ignore[misc]


def test_a_plan_cannot_be_changed_once_made() -> None:
    # Every companion acts on the plan it computed: nothing may edit it on the way.
    made = plan(EVERY_10S, pointer_ms=T, now_ms=T, horizon_ms=SECOND, missed="once")
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.pointer_ms = 0  # type: ignore[misc]
