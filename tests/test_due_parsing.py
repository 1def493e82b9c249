"""Durations and due times as a person types them: one parser, exact values.

Kill tests of ``celery_zdelay/schedule.py`` (docs/mutation.rst): each unit's
value, the sign, a plain number of seconds, ``now``, the bounds, and the
refusal messages that quote a value cut short.
"""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from celery_zdelay.errors import ConfigurationError
from celery_zdelay.schedule import (
    MAX_COUNTDOWN_MS,
    Due,
    due_from,
    parse_delay,
    parse_when,
)

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("typed", "ms"),
    [
        ("7ms", 7),
        ("7s", 7_000),
        ("7m", 420_000),
        ("7h", 25_200_000),
        ("7d", 604_800_000),
        ("1h30m", 5_400_000),
        ("1.5s", 1_500),
        ("-10m", -600_000),
        ("+10m", 600_000),
        (" 2s ", 2_000),
    ],
)
def test_each_unit_and_sign_gives_its_exact_milliseconds(typed: str, ms: int) -> None:
    assert parse_delay(typed) == Due("r", ms)


def test_a_plain_number_is_seconds_only_where_seconds_are_asked_for() -> None:
    assert parse_delay("600", seconds=True) == Due("r", 600_000)
    assert parse_delay("-1.5", seconds=True) == Due("r", -1_500)
    assert parse_delay("0.0004", seconds=True) == Due("r", 1)  # rounded up, never early
    assert parse_delay("600") is None


@pytest.mark.parametrize("typed", ["", "-", "10", "10x", "s10", "1h 30m", "1h-30m", "1.s"])
def test_what_is_not_a_duration_is_none(typed: str) -> None:
    assert parse_delay(typed) is None


def test_the_bound_is_checked_once_either_way() -> None:
    longest = f"{MAX_COUNTDOWN_MS}ms"
    assert parse_delay(longest) == Due("r", MAX_COUNTDOWN_MS)
    assert parse_delay("-" + longest) == Due("r", -MAX_COUNTDOWN_MS)
    for beyond in (f"{MAX_COUNTDOWN_MS + 1}ms", f"-{MAX_COUNTDOWN_MS + 1}ms"):
        with pytest.raises(ConfigurationError, match="longer than the longest delay"):
            parse_delay(beyond)


def test_when_is_now_a_delay_or_a_moment() -> None:
    assert parse_when("now") == Due("r", 0)
    assert parse_when(" NOW ") == Due("r", 0)
    assert parse_when("30s") == Due("r", 30_000)
    assert parse_when("2031-01-02T03:04:05+00:00") == Due("a", 1_925_089_445_000)
    assert parse_when("2031-01-02T03:04:05Z") == Due("a", 1_925_089_445_000)
    with pytest.raises(ConfigurationError, match="ISO 8601"):
        parse_when("soon")


def test_an_eta_the_clock_cannot_hold_is_refused_with_the_reason() -> None:
    with pytest.raises(ConfigurationError, match="too far in the past"):
        due_from(eta=datetime(1600, 1, 1, tzinfo=timezone.utc))
    with pytest.raises(ConfigurationError, match="too far in the future"):
        due_from(eta=datetime(2300, 1, 1, tzinfo=timezone.utc))
    with pytest.raises(ConfigurationError, match="too far in the past"):
        due_from(eta=datetime.min)


def test_a_refused_value_is_quoted_cut_short() -> None:
    with pytest.raises(ConfigurationError) as huge:
        due_from(countdown=2**128)
    assert "(an integer of 129 bits)" in str(huge.value)
    with pytest.raises(ConfigurationError) as big:
        due_from(countdown=2**127 * 2 - 1)  # 128 bits: still shown whole
    assert str(2**128 - 1) in str(big.value)
    sixty = "x" * 58  # its repr, quotes included, is 60 characters: shown whole
    with pytest.raises(ConfigurationError) as whole:
        due_from(eta=sixty)
    assert repr(sixty) in str(whole.value)
    sixty_one = "x" * 59
    with pytest.raises(ConfigurationError) as cut:
        due_from(eta=sixty_one)
    assert repr(sixty_one)[:57] + "..." in str(cut.value)
    assert repr(sixty_one) not in str(cut.value)
