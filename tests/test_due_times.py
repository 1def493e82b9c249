"""Due times are read exactly as promised: countdown on the Redis clock, rounded up, eta as UTC.

Each test here pins a line of ``celery_zdelay/schedule.py`` that a mutant
changed without the rest of the suite noticing (see docs/mutation.rst):
the bounds of what is accepted, the rounding that keeps a task from being
released early, and how a naive ``eta`` is read.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone

import pytest

from celery_zdelay.errors import ConfigurationError
from celery_zdelay.schedule import MAX_COUNTDOWN_S, MAX_DUE_MS, Due, due_from

pytestmark = pytest.mark.timeout(30)

EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def test_a_countdown_is_counted_from_the_redis_clock_in_whole_milliseconds_rounded_up() -> None:
    assert due_from(countdown=2) == Due("r", 2000)
    assert due_from(countdown=0) == Due("r", 0)
    # A fraction of a millisecond more is one millisecond more: never early.
    assert due_from(countdown=1.0001) == Due("r", 1001)
    assert due_from(countdown=0.0004) == Due("r", 1)
    # A negative countdown is due at once, rounded towards later too.
    assert due_from(countdown=-1.5) == Due("r", -1500)
    assert due_from(countdown=-0.0004) == Due("r", 0)


def test_the_longest_countdown_is_a_hundred_years_either_way_and_no_more() -> None:
    assert MAX_COUNTDOWN_S == 100 * 365.25 * 86400
    assert due_from(countdown=MAX_COUNTDOWN_S) == Due("r", math.ceil(MAX_COUNTDOWN_S * 1000))
    assert due_from(countdown=-MAX_COUNTDOWN_S).ms == -MAX_COUNTDOWN_S * 1000
    for beyond in (MAX_COUNTDOWN_S + 1, -MAX_COUNTDOWN_S - 1):
        with pytest.raises(ConfigurationError, match="at most 3155760000"):
            due_from(countdown=beyond)


@pytest.mark.parametrize("countdown", [True, False, "10", float("nan"), float("inf")])
def test_a_countdown_that_is_not_a_finite_number_of_seconds_is_refused(countdown: object) -> None:
    with pytest.raises(ConfigurationError, match="countdown must be a number of seconds"):
        due_from(countdown=countdown)


def test_an_eta_is_an_absolute_instant_rounded_up_to_the_millisecond() -> None:
    when = datetime(2031, 5, 6, 7, 8, 9, 500, tzinfo=timezone.utc)
    expected = (when - EPOCH) // timedelta(milliseconds=1) + 1
    assert due_from(eta=when) == Due("a", expected)
    exact = datetime(2031, 5, 6, 7, 8, 9, 123000, tzinfo=timezone.utc)
    assert due_from(eta=exact) == Due("a", (exact - EPOCH) // timedelta(milliseconds=1))


def test_a_naive_eta_is_read_as_utc_the_way_celerys_worker_reads_it() -> None:
    naive = datetime(2031, 1, 2, 3, 4, 5)
    aware = naive.replace(tzinfo=timezone.utc)
    assert due_from(eta=naive) == due_from(eta=aware)
    elsewhere = aware.astimezone(timezone(timedelta(hours=-7)))
    assert due_from(eta=elsewhere) == due_from(eta=aware)
    assert due_from(eta="2031-01-02T03:04:05Z") == due_from(eta=aware)


def test_the_furthest_eta_is_the_last_millisecond_the_score_encoding_holds() -> None:
    # Scores are ms * 1024 + a sequence number below 1024, exact below 2**53.
    assert MAX_DUE_MS * 1024 + 1023 < 2**53 <= (MAX_DUE_MS + 1) * 1024 + 1023
    # Float seconds this far out are exact to about a microsecond: the last
    # millisecond is reached from just inside it (rounded up), not at it.
    last = EPOCH + timedelta(milliseconds=MAX_DUE_MS) - timedelta(microseconds=500)
    assert due_from(eta=last) == Due("a", MAX_DUE_MS)
    with pytest.raises(ConfigurationError, match="too far in the future"):
        due_from(eta=last + timedelta(milliseconds=1))


@pytest.mark.parametrize("eta", ["next tuesday", "2031-13-01T00:00:00", 12345, object()])
def test_an_eta_that_is_not_a_datetime_is_refused_with_the_fix(eta: object) -> None:
    with pytest.raises(ConfigurationError, match="eta must be a datetime or an ISO 8601 string"):
        due_from(eta=eta)


def test_both_or_neither_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigurationError, match="not both"):
        due_from(countdown=1, eta=datetime.now(timezone.utc))
    with pytest.raises(ConfigurationError, match="use apply_async"):
        due_from()
    # Zero is a countdown, not "no countdown".
    with pytest.raises(ConfigurationError, match="not both"):
        due_from(countdown=0, eta=datetime.now(timezone.utc))


def test_a_due_time_is_a_frozen_value() -> None:
    due = due_from(countdown=1)
    with pytest.raises(AttributeError):
        due.ms = 0  # type: ignore[misc]
    assert hash(due) == hash(Due("r", 1000))
