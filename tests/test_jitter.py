"""``jitter=``: a call made for one moment is due at a random moment within
*jitter* seconds after it, never before; one rule checks the value.

Given calls parked with a countdown and a jitter in a real Redis, each is
due at or after its countdown and at most *jitter* later, the calls of one
``apply_delayed_many`` are spread, the ETA each task sees is its own due
time, and a canvas moves as one. A jitter that is not a number of seconds
from 0 to a day is refused before anything is parked, by the same rule as a
periodic task's ``zdelay_jitter``.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis
from celery import Celery, group

import celery_zdelay
from celery_zdelay import ConfigurationError, schedule
from celery_zdelay.companion import Companion
from celery_zdelay.periodic.definition import from_beat_entry
from celery_zdelay.schedule import MAX_DUE_MS, MAX_JITTER_SECONDS, Due, jitter_ms
from tests.support.clock import redis_ms
from tests.support.keys import SHARD0

pytestmark = pytest.mark.timeout(60)

HOUR_MS = 3_600_000
CALLS = 300
#: The ETA a parked message carries (celery_zdelay.store.headers), spelt out.
ETA_HEADER = "zdelay_eta"


def _due_of(app: Celery, task_id: str) -> int:
    found = celery_zdelay.lookup(task_id, app=app)
    assert found is not None
    assert found.due_ms is not None
    return found.due_ms


# -- the rule ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("jitter", "expected"),
    [
        (None, 0),
        (0, 0),
        (30, 30_000),
        (0.0015, 2),
        (timedelta(minutes=2), 120_000),
        (MAX_JITTER_SECONDS, MAX_JITTER_SECONDS * 1000),
    ],
)
def test_a_jitter_is_seconds_or_a_timedelta_in_whole_milliseconds(
    jitter: Any, expected: int
) -> None:
    assert jitter_ms(jitter) == expected


@pytest.mark.parametrize(
    "jitter",
    [-1, -0.001, MAX_JITTER_SECONDS + 0.001, True, "30", float("nan"), float("inf"), [30]],
)
def test_a_jitter_that_is_not_seconds_from_zero_to_a_day_is_refused(jitter: Any) -> None:
    with pytest.raises(ConfigurationError, match="jitter must be a number of seconds from 0"):
        jitter_ms(jitter)


def test_a_moved_due_time_is_never_earlier_and_at_most_the_spread_later() -> None:
    due = Due("r", 60_000)
    moved = [due.jittered(500).ms for _ in range(2000)]
    assert min(moved) >= 60_000
    assert max(moved) <= 60_500
    # Both ends are reached: the spread is the whole window.
    assert min(moved) < 60_010
    assert max(moved) > 60_490
    assert due.jittered(0) == due
    # The narrowest spread, one ms, still moves some and leaves others.
    assert {Due("r", 0).jittered(1).ms for _ in range(200)} == {0, 1}


def test_an_eta_moved_past_the_last_due_time_the_store_holds_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given the draw at the top of the window, every time
    monkeypatch.setattr(schedule.random, "randint", lambda low, high: high)

    # Then the last due time the store holds is reached, and one more ms refused.
    assert Due("a", MAX_DUE_MS - 10).jittered(10) == Due("a", MAX_DUE_MS)
    with pytest.raises(ConfigurationError, match="too far in the future"):
        Due("a", MAX_DUE_MS - 9).jittered(10)
    # A countdown is counted later, on the Redis clock: not refused here.
    assert Due("r", MAX_DUE_MS).jittered(10) == Due("r", MAX_DUE_MS + 10)


def test_a_periodic_tasks_zdelay_jitter_is_read_by_the_same_rule() -> None:
    with pytest.raises(ConfigurationError, match="zdelay_jitter must be a number of seconds"):
        from_beat_entry(
            "every-minute",
            {"task": "tests.record", "schedule": 60, "zdelay_jitter": -5},
            known_tasks={"tests.record"},
        )


# -- parked calls -----------------------------------------------------------------------


def test_each_call_of_a_bulk_park_is_due_at_its_own_moment_within_the_jitter(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given many calls parked for one moment with a jitter of 30 s
    record = app.tasks["tests.record"]
    before = redis_ms(redis_client)
    results = record.apply_delayed_many([(i,) for i in range(CALLS)], countdown=60, jitter=30)
    after = redis_ms(redis_client)

    # Then each is due between its countdown and 30 s after it, never before
    dues = [_due_of(app, result.id) for result in results]
    assert min(dues) >= before + 60_000
    assert max(dues) <= after + 90_000
    # and they are spread over the window, not parked at one moment.
    assert len(set(dues)) > CALLS // 2
    assert max(dues) - min(dues) > 20_000


def test_a_task_sees_its_own_moved_due_time_as_its_eta(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given calls parked an hour ahead with a jitter of 30 s
    record = app.tasks["tests.record"]
    results = record.apply_delayed_many([(i,) for i in range(50)], countdown=3600, jitter=30)
    dues = {result.id: _due_of(app, result.id) for result in results}

    # When they are released
    with Companion(app) as companion:
        report = companion.release_due(advance_ms=HOUR_MS + 60_000)
    assert report.released == 50

    # Then each message's ETA is its own due time, not the unmoved one.
    queued = [json.loads(raw)["headers"] for raw in redis_client.lrange("celery", 0, -1)]
    assert len(queued) == 50
    for headers in queued:
        eta_ms = datetime.fromisoformat(headers[ETA_HEADER]).timestamp() * 1000
        assert abs(eta_ms - dues[headers["id"]]) < 1000


def test_one_call_with_a_jitter_is_due_within_it_after_an_eta(app: Celery) -> None:
    when = datetime.now(timezone.utc) + timedelta(days=3)
    eta_ms = int(when.timestamp() * 1000)
    results = [
        app.tasks["tests.record"].apply_delayed(("x",), eta=when, jitter=timedelta(hours=1))
        for _ in range(20)
    ]
    dues = [_due_of(app, result.id) for result in results]
    assert all(eta_ms <= due <= eta_ms + HOUR_MS + 1 for due in dues)
    assert len(set(dues)) > 1


def test_a_canvas_moves_as_one(app: Celery) -> None:
    record = app.tasks["tests.record"]
    result = celery_zdelay.apply_delayed(
        group(record.s(i) for i in range(5)), countdown=600, jitter=60, app=app
    )
    dues = {_due_of(app, child.id) for child in result.results}
    assert len(dues) == 1


@pytest.mark.parametrize("jitter", [-1, "soon", float("nan"), 86_401])
def test_a_bad_jitter_parks_nothing_and_says_what_to_give(
    app: Celery, redis_client: redis.Redis, jitter: Any
) -> None:
    record = app.tasks["tests.record"]
    calls = [
        lambda: record.apply_delayed(("x",), countdown=60, jitter=jitter),
        lambda: record.apply_delayed_many([(1,), (2,)], countdown=60, jitter=jitter),
        lambda: celery_zdelay.send_delayed(
            app, "tests.record", ("x",), countdown=60, jitter=jitter
        ),
        lambda: celery_zdelay.apply_delayed(record.s("x"), countdown=60, jitter=jitter, app=app),
    ]
    for call in calls:
        with pytest.raises(ConfigurationError, match="from 0 to 86400"):
            call()
    assert redis_client.zcard(SHARD0.due) == 0
