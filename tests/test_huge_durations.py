"""A duration longer than any due time is refused like every other bad value.

Given parked tasks, when a duration of hundreds of digits (``999...9d``,
with or without ``-``) is typed where the CLI or the dashboard reads a
delay or a due time, or passed as ``countdown=``/``eta=``, then the answer
is the clear refusal every bad value gets (exit 2, HTTP 400 or the form's
message, ``ConfigurationError``), never an ``OverflowError``, and nothing
parked moved. One parser reads them all (``celery_zdelay.schedule``).
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from urllib.parse import urlencode

import pytest
import redis
from celery import Celery
from werkzeug.test import Client

import celery_zdelay
from celery_zdelay.cli import EXIT_USAGE
from celery_zdelay.schedule import MAX_COUNTDOWN_S, Due, parse_delay, parse_when
from celery_zdelay.web import create_app
from tests.support.cli import run
from tests.support.keys import keys_of

pytestmark = pytest.mark.timeout(60)

HUGE = ["9" * 400 + "d", "-" + "9" * 400 + "d", "9" * 400 + "ms", "1" + "0" * 5000 + "s"]
REFUSED = "longer than the longest delay"


def _park_three(app: Celery) -> list[str]:
    record = app.tasks["tests.record"]
    return [record.apply_delayed((i,), countdown=600, tags=["t"]).id for i in range(3)]


def _due(client: redis.Redis) -> list[tuple[bytes, float]]:
    return sorted(client.zrange(keys_of(0).due, 0, -1, withscores=True))


# -- the parser ------------------------------------------------------------------------------


@pytest.mark.parametrize("text", HUGE)
def test_a_duration_beyond_a_hundred_years_is_a_configuration_error(text: str) -> None:
    with pytest.raises(celery_zdelay.ConfigurationError, match=REFUSED):
        parse_delay(text)
    with pytest.raises(celery_zdelay.ConfigurationError, match=REFUSED):
        parse_when(text)


def test_the_longest_delay_is_read_exactly_and_a_millisecond_more_is_refused() -> None:
    longest_ms = round(MAX_COUNTDOWN_S * 1000)
    assert parse_delay(f"{longest_ms}ms") == Due("r", longest_ms)
    assert parse_delay(f"-{longest_ms}ms") == Due("r", -longest_ms)
    for beyond in (f"{longest_ms + 1}ms", f"-{longest_ms + 1}ms", f"{longest_ms // 1000 + 1}s"):
        with pytest.raises(celery_zdelay.ConfigurationError, match=REFUSED):
            parse_delay(beyond)
    # Rounded up as countdown= is: never due before the delay is over.
    assert parse_delay("1.0004s") == Due("r", 1001)
    assert parse_delay("600", seconds=True) == Due("r", 600_000)
    assert parse_delay("600") is None
    assert parse_when("now") == Due("r", 0)


# -- countdown= and eta= ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"countdown": 10**400},
        {"countdown": -(10**400)},
        {"countdown": 10**5000},
        {"eta": datetime(1, 1, 1, tzinfo=timezone.utc)},
        {"eta": "0001-01-01T00:00:00+14:00"},
        {"eta": datetime(9999, 12, 31, tzinfo=timezone.utc)},
    ],
)
def test_a_countdown_or_eta_beyond_the_due_times_the_store_holds_parks_nothing(
    app: Celery, redis_client: redis.Redis, kwargs: dict[str, object]
) -> None:
    with pytest.raises(celery_zdelay.ConfigurationError, match=r"countdown must be|eta .* too far"):
        app.tasks["tests.record"].apply_delayed((1,), **kwargs)
    assert redis_client.keys("{zdelay*") == []


# -- the CLI ---------------------------------------------------------------------------------


@pytest.mark.parametrize("huge", HUGE[:2])
@pytest.mark.parametrize(
    "command",
    [
        ["list", "--due-before", "{}"],
        ["list", "--due-after", "{}"],
        ["cancel", "--due-before", "{}"],
        ["cancel", "--due-after", "{}"],
        ["reschedule", "--tag", "t", "--countdown", "5", "--due-before", "{}"],
        ["reschedule", "--tag", "t", "--countdown", "5", "--due-after", "{}"],
        ["reschedule", "--tag", "t", "--countdown", "{}"],
        ["reschedule", "ID", "--countdown", "{}"],
    ],
)
def test_the_cli_refuses_a_huge_duration_with_exit_2_and_changes_nothing(
    app: Celery, redis_client: redis.Redis, command: list[str], huge: str
) -> None:
    ids = _park_three(app)
    before = _due(redis_client)

    result = run(app, *[huge if arg == "{}" else ids[0] if arg == "ID" else arg for arg in command])

    assert result.exit_code == EXIT_USAGE, result.output
    assert REFUSED in result.stderr
    assert _due(redis_client) == before


# -- the dashboard ---------------------------------------------------------------------------


def _dashboard(app: Celery) -> tuple[Client, str]:
    client = Client(create_app(app, actions=True))
    html = client.get("/parked").get_data(as_text=True)
    match = re.search(r'name="csrf_token" value="([0-9a-f]+)"', html)
    assert match
    return client, match.group(1)


@pytest.mark.parametrize("huge", HUGE[:2])
@pytest.mark.parametrize("name", ["due_after", "due_before"])
def test_the_listing_says_a_huge_due_filter_is_too_long(app: Celery, name: str, huge: str) -> None:
    _park_three(app)
    client, _ = _dashboard(app)

    reply = client.get("/parked?" + urlencode({name: huge}))

    assert reply.status_code == 200
    assert REFUSED in reply.get_data(as_text=True)


@pytest.mark.parametrize("huge", HUGE[:2])
@pytest.mark.parametrize(
    "form",
    [
        {"op": "cancel", "scope": "filter", "due_before": "{}"},
        {"op": "cancel", "scope": "filter", "due_after": "{}"},
        {"op": "reschedule", "scope": "filter", "due_before": "{}", "delay": "5m"},
        {"op": "reschedule", "scope": "filter", "due_after": "{}", "delay": "5m"},
        {"op": "reschedule", "ids": "ID", "delay": "{}"},
    ],
)
def test_the_dashboard_refuses_a_huge_duration_in_an_action_and_changes_nothing(
    app: Celery, redis_client: redis.Redis, form: dict[str, str], huge: str
) -> None:
    ids = _park_three(app)
    before = _due(redis_client)
    client, token = _dashboard(app)

    data = {k: huge if v == "{}" else ids[0] if v == "ID" else v for k, v in form.items()}
    reply = client.post("/actions/parked", data={"csrf_token": token, **data})

    if "delay" in form and form["delay"] == "{}":
        # The form's own message, as for every delay it cannot read.
        assert reply.status_code == 303
        assert "Not+rescheduled" in reply.headers["Location"]
        assert "longest+delay" in reply.headers["Location"]
    else:
        assert reply.status_code == 400
        assert REFUSED in reply.get_data(as_text=True)
    assert _due(redis_client) == before
