"""Periodic ticks: each occurrence runs once and never early, as Celery's schedules plan it.

Crontab across DST, missed ticks by ``zdelay_missed`` after every companion was
down, long outages, solar schedules, ``expires`` counted from the occurrence.
"""

from __future__ import annotations

import itertools
import json
from datetime import datetime, timezone

import pytest
import redis
from celery import Celery
from celery.schedules import crontab, schedule

from celery_zdelay.companion import Companion
from celery_zdelay.periodic.occurrences import next_after, plan
from tests.helpers import CeleryProcess, Runs, wait_for
from tests.support.clock import redis_ms
from tests.support.keys import SHARD0
from tests.support.periodic import (
    occurrence_ms,
    parked_ids,
    server_for,
    start_beat_companion,
    tend,
    ticks_of,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.timing]

DUE = SHARD0.due


# -- ticks, end to end -------------------------------------------------------------


def test_a_one_second_schedule_runs_every_tick_once_and_never_early(
    app: Celery, worker, processes: list[CeleryProcess], runs: Runs
) -> None:
    # Given a companion serving a 1-second schedule, and a worker
    worker(app)
    processes.append(
        start_beat_companion(app, {"tick": {"task": "tests.record", "schedule": 1.0, "args": [7]}})
    )

    # When it has served for a few seconds
    wait_for(lambda: len(ticks_of(runs.all(), "tick")) >= 6, timeout=30)

    # Then the ticks ran one second apart, each once, none before its time
    ticks = ticks_of(runs.all(), "tick")
    times = [occurrence_ms(t["id"]) for t in ticks]
    assert len(set(times)) == len(times) == len({t["id"] for t in ticks})
    assert [b - a for a, b in itertools.pairwise(times)] == [1000] * (len(times) - 1)
    assert all(t["redis_ms"] >= occurrence_ms(t["id"]) for t in ticks)
    assert all(t["args"] == [7] and t["task"] == "tests.record" for t in ticks)


def test_bad_entries_are_named_at_start_and_the_others_run(
    app: Celery, worker, processes: list[CeleryProcess], runs: Runs
) -> None:
    # Given a beat_schedule with an unknown task, an invalid schedule and
    # options JSON cannot hold, next to a good entry
    worker(app)
    companion = start_beat_companion(
        app,
        {
            "typo": {"task": "tests.recrod", "schedule": 1.0},
            "vague": {"task": "tests.record", "schedule": "every hour"},
            "opaque": {"task": "tests.record", "schedule": 1.0, "options": "unserializable"},
            "good": {"task": "tests.record", "schedule": 1.0},
        },
    )
    processes.append(companion)

    # Then each bad entry is named with what is wrong, and the good one runs
    companion.wait_for_log("Periodic task 'opaque' is not served")
    log = companion.log()
    assert "Periodic task 'typo' is not served" in log
    assert "unknown task 'tests.recrod'" in log
    assert "Periodic task 'vague' is not served" in log
    assert "'every hour'" in log
    assert "JSON-serializable" in log
    wait_for(lambda: len(ticks_of(runs.all(), "good")) >= 2, timeout=30)
    assert {r["id"].split(":")[1] for r in runs.all()} == {"good"}


# -- occurrences: Celery's schedules, missed ticks ----------------------------------


def _ms(text: str) -> int:
    return int(datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp() * 1000)


def test_crontab_keeps_local_time_across_dst_as_celery_does() -> None:
    app = Celery(set_as_current=False)
    app.conf.timezone = "Europe/Paris"
    daily = crontab(minute=0, hour=3, app=app)
    # 03:00 CEST is 01:00Z; after the clocks go back (25 Oct 2026), 03:00 CET is 02:00Z.
    assert next_after(daily, _ms("2026-10-23T12:00:00")) == _ms("2026-10-24T01:00:00")
    assert next_after(daily, _ms("2026-10-24T01:00:00")) == _ms("2026-10-25T02:00:00")
    # 03:00 CET is 02:00Z; after the clocks go forward (29 Mar 2026), 03:00 CEST is 01:00Z.
    assert next_after(daily, _ms("2026-03-28T02:00:00")) == _ms("2026-03-29T01:00:00")
    app.close()


def test_missed_occurrences_follow_the_entry_policy() -> None:
    every = schedule(1.0, app=Celery(set_as_current=False))
    # The pointer is 10.5 s behind now: occurrences at +1 s ... +10 s were missed.
    common = {"pointer_ms": 0, "now_ms": 10_500, "horizon_ms": 2_000}
    once = plan(every, missed="once", **common)
    # "once": the first missed one, counted from the pointer, so that every
    # companion picks the same one whenever it plans
    assert once.park == [1_000, 11_000, 12_000, 13_000]
    assert once.skipped == 9
    assert plan(every, missed="once", **{**common, "now_ms": 10_900}).park[0] == 1_000
    assert plan(every, missed="skip", **common).park == [11_000, 12_000, 13_000]
    assert plan(every, missed="all", **common).park == [i * 1000 for i in range(1, 14)]
    # Nothing to do while the newest parked one is beyond the horizon
    assert plan(every, missed="once", pointer_ms=13_000, now_ms=10_500, horizon_ms=2_000).park == []


def test_numeric_expires_counts_from_the_occurrence(app: Celery, redis_client: redis.Redis) -> None:
    server = server_for(
        app, {"a": {"task": "tests.record", "schedule": 1800, "options": {"expires": 60}}}
    )
    server.reconcile()
    tend(server)
    (task_id,) = parked_ids(redis_client, "a")
    with Companion(app) as companion:
        companion.release_due(advance_ms=1_900_000)
    message = redis_client.lpop("celery")
    assert message is not None
    headers = json.loads(message)["headers"]
    expires = datetime.fromisoformat(headers["expires"]).timestamp() * 1000
    assert expires == pytest.approx(occurrence_ms(task_id) + 60_000, abs=1000)


@pytest.mark.parametrize(("missed", "extra"), [("once", 1), ("skip", 0), ("all", None)])
def test_when_every_companion_was_down_the_missed_policy_decides(
    app: Celery, redis_client: redis.Redis, missed: str, extra: int | None
) -> None:
    # Given a 200 ms schedule served with nothing parked ahead beyond the next one
    server = server_for(
        app, {"a": {"task": "tests.record", "schedule": 0.2, "zdelay_missed": missed}}
    )
    server.reconcile()
    server.horizon_ms = 0
    tend(server)
    # The one ahead, and before it any that fell due since the schedule was
    # stored (a pass more than 200 ms after it, on a loaded machine: seen once)
    before = sorted(parked_ids(redis_client, "a"), key=occurrence_ms)
    first = before[-1]
    assert occurrence_ms(first) > redis_ms(redis_client) - 300

    # When no companion serves it for well over five occurrences
    wait_for(lambda: redis_ms(redis_client) > occurrence_ms(first) + 1200, timeout=10)
    tend(server)

    # Then those parked before wait to run late, the next one is parked
    # ahead, and of the missed ones: the first (once), none (skip), each (all)
    parked = sorted(parked_ids(redis_client, "a"), key=occurrence_ms)
    missed_parked = parked[len(before) : -1]  # between those and the one ahead
    assert parked[: len(before)] == before
    assert occurrence_ms(parked[-1]) > redis_ms(redis_client) - 300
    if extra is None:
        steps = [occurrence_ms(b) - occurrence_ms(a) for a, b in itertools.pairwise(parked)]
        assert len(missed_parked) >= 5
        assert set(steps) == {200}
    else:
        assert len(missed_parked) == extra


def test_a_long_outage_of_a_frequent_calendar_schedule_is_planned_quickly() -> None:
    import time

    app = Celery(set_as_current=False)
    every_second = schedule(1.0, relative=True, app=app)
    every_minute = crontab(app=app)
    day_ms = 86_400_000
    now_ms = _ms("2026-06-02T12:00:00.500000")
    for sched, period in ((every_second, 1000), (every_minute, 60_000)):
        started = time.monotonic()
        pointer_ms = now_ms - day_ms
        once = plan(sched, pointer_ms=pointer_ms, now_ms=now_ms, horizon_ms=0, missed="once")
        assert time.monotonic() - started < 2.0
        latest = now_ms - now_ms % period
        first_missed = pointer_ms - pointer_ms % period + period
        assert once.park == [first_missed, latest + period]
        assert abs(once.skipped - (day_ms // period - 1)) <= 2
    app.close()


def test_a_solar_entry_is_stored_and_runs_at_the_next_sunrise(app: Celery) -> None:
    from celery.schedules import solar

    from celery_zdelay.periodic.definition import from_beat_entry

    # Given a beat_schedule entry at sunrise in Paris
    entry = {"task": "tests.record", "schedule": solar("sunrise", 48.8566, 2.3522)}
    definition = from_beat_entry("dawn", entry, known_tasks={"tests.record"})
    assert definition.schedule == {"solar": {"event": "sunrise", "lat": 48.8566, "lon": 2.3522}}
    assert definition.describe() == "solar sunrise at 48.8566,2.3522"

    # Then its next occurrence after midnight UTC on 21 June is that morning's
    # sunrise (about 03:47 UTC), and the one after it the next morning's
    sched = definition.celery_schedule(app)
    first = next_after(sched, _ms("2026-06-21T00:00:00"))
    assert _ms("2026-06-21T03:40:00") < first < _ms("2026-06-21T03:55:00")
    second = next_after(sched, first)
    assert 86_400_000 - 120_000 < second - first < 86_400_000 + 120_000
