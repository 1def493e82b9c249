"""Periodic schedules steered at run time and shown as they are.

Pause, resume, run, add and remove; the ``periodic`` commands; status, list
and metrics; serving only when asked; each schedule records only its own runs.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis
from celery import Celery
from celery.schedules import crontab

from celery_zdelay import ConfigurationError, periodic
from celery_zdelay.companion import Companion
from celery_zdelay.parking import store_for
from tests.helpers import Runs, wait_for
from tests.support.cli import run
from tests.support.clock import redis_ms
from tests.support.keys import SHARD0
from tests.support.periodic import occurrence_ms, parked_ids, server_for, tend

pytestmark = pytest.mark.timeout(120)

DUE = SHARD0.due


# -- runtime control --------------------------------------------------------------


def test_pause_resume_run_add_and_remove(
    app: Celery, redis_client: redis.Redis, runs: Runs
) -> None:
    server = server_for(app, {"a": {"task": "tests.record", "schedule": 10.0, "args": [1]}})
    server.reconcile()
    tend(server)
    assert len(parked_ids(redis_client, "a")) == 1

    # Pause cancels what was parked and parks nothing more
    assert periodic.pause("a", app=app)
    tend(server)
    assert parked_ids(redis_client, "a") == set()
    _, infos = periodic.schedules(app)
    assert infos[0].paused
    assert infos[0].next_run_ms is None

    # Resume parks again, from now
    assert periodic.resume("a", app=app)
    tend(server)
    assert len(parked_ids(redis_client, "a")) == 1

    # Run now parks one due at once, outside the schedule
    task_id = periodic.run_now("a", app=app)
    with Companion(app) as companion:
        assert companion.release_due().released == 1
    assert redis_client.llen("celery") == 1
    assert task_id.startswith("periodic:a:run:")

    # Add and remove at run time; unknown names say so
    assert periodic.add("b", app=app, task="tests.record", schedule=30)
    assert not periodic.add("b", app=app, task="tests.record", schedule=30)
    tend(server)
    assert len(parked_ids(redis_client, "b")) == 1
    assert periodic.remove("b", app=app)
    tend(server)
    assert parked_ids(redis_client, "b") == set()
    assert not periodic.remove("b", app=app)
    assert not periodic.pause("nope", app=app)


def test_a_calendar_schedule_paused_and_resumed_parks_its_next_tick_again(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given a crontab schedule whose next minute is parked
    server = server_for(app, {"m": {"task": "tests.record", "schedule": crontab()}})
    server.reconcile()
    tend(server)
    before = {occurrence_ms(i) for i in parked_ids(redis_client, "m")}
    assert before

    # When it is paused (what was parked is cancelled) and resumed at once
    assert periodic.pause("m", app=app)
    tend(server)
    assert parked_ids(redis_client, "m") == set()
    assert periodic.resume("m", app=app)
    tend(server)

    # Then the minutes still ahead are parked again: a resume leaves no gap
    after = {occurrence_ms(i) for i in parked_ids(redis_client, "m")}
    assert after >= {ms for ms in before if ms > redis_ms(redis_client)}
    assert after


def test_add_rejects_what_cannot_be_served(app: Celery) -> None:
    with pytest.raises(ConfigurationError, match=r"unknown task 'tests\.nope'"):
        periodic.add("n", app=app, task="tests.nope", schedule=5)
    with pytest.raises(ConfigurationError, match=r"schedule must be"):
        periodic.add("n", app=app, task="tests.record", schedule="hourly")
    with pytest.raises(ConfigurationError, match="JSON-serializable"):
        periodic.add("n", app=app, task="tests.record", schedule=5, kwargs={"x": object()})
    assert periodic.schedules(app)[1] == []


def test_an_occurrence_released_is_never_parked_again(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given an occurrence parked and released
    server = server_for(app, {"a": {"task": "tests.record", "schedule": 60}})
    server.reconcile()
    tend(server)
    (first,) = parked_ids(redis_client, "a")
    with Companion(app) as companion:
        assert companion.release_due(advance_ms=61_000).released == 1

    # When a companion that read the schedule before parks it again
    store = server.periodic
    (again,) = server._requests(store.snapshot().definitions["a"], first, occurrence_ms(first))

    # Then nothing is parked: it would run twice
    assert store.park_once(again, occurrence_ms=occurrence_ms(first)) is False
    assert parked_ids(redis_client, "a") == set()


def test_schedules_sharing_an_occurrence_time_record_only_their_own_runs(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given two schedules ticking at the same instants, served by a companion
    app.conf.beat_schedule = {
        "a": {"task": "tests.record", "schedule": crontab()},
        "b": {"task": "tests.record", "schedule": crontab()},
    }
    with Companion(app, beat=True) as companion:
        server = companion.periodic
        assert server is not None
        server.reconcile()
        tend(server)
        a_ids, b_ids = parked_ids(redis_client, "a"), parked_ids(redis_client, "b")
        assert {occurrence_ms(i) for i in a_ids} == {occurrence_ms(i) for i in b_ids}
        # and b's occurrences cancelled before they ran
        assert all(store_for(app).cancel(sorted(b_ids)))

        # When a's next occurrence is released (by the first pass, when the
        # minute turns just then, or by the one fast-forwarded past it)
        released = 0
        for advance_ms in (0, 61_000):
            report = companion.release_due(advance_ms=advance_ms)
            companion._note_periodic_runs(report)
            released += report.released
        assert released >= 1

    # Then a ran and b did not: runs are matched by id, not by due time
    infos = {i.name: i for i in periodic.schedules(app)[1]}
    assert infos["a"].last_run_lateness_ms is not None
    assert infos["b"].last_run_lateness_ms is None
    assert parked_ids(redis_client, "b") == set()


def test_the_handoff_names_what_it_moves_only_near_a_periodic_occurrence(app: Celery) -> None:
    # Given a companion serving a half-hourly schedule, its next tick half an
    # hour away (parked: within the planner's PARK_LEAD_MS)
    app.conf.beat_schedule = {"hourly": {"task": "tests.record", "schedule": 1800}}
    with Companion(app, beat=True) as companion:
        server = companion.periodic
        assert server is not None
        server.reconcile()
        tend(server)
        asked: list[bool] = []
        handoff = companion.store.handoff

        def recording(shard: int, **kwargs: Any) -> Any:
            asked.append(kwargs["with_ids"])
            return handoff(shard, **kwargs)

        companion.store.handoff = recording  # type: ignore[method-assign]

        # When it releases with the Redis clock unknown, then known, then
        # fast-forwarded to the tick
        companion.release_due()
        companion.release_due()
        report = companion.release_due(advance_ms=1_801_000)

    # Then only the first (no clock yet) and the last (the tick) asked for ids
    assert asked == [True, False, True]
    assert report.released == 1
    (task_id,) = report.task_ids
    assert str(task_id).startswith("periodic:hourly:")


def test_serving_is_off_unless_asked(app: Celery) -> None:
    app.conf.beat_schedule = {"a": {"task": "tests.record", "schedule": 1.0}}
    assert Companion(app).periodic is None
    assert Companion(app, beat=True).periodic is not None
    app.conf.zdelay_beat = True
    assert Companion(app).periodic is not None


def test_the_periodic_commands(app: Celery, redis_client: redis.Redis) -> None:
    app.conf.beat_schedule = {"a": {"task": "tests.record", "schedule": 60.0}}
    assert run(app, "periodic", "sync").stdout == "beat_schedule stored\n"
    added = run(
        app,
        "periodic",
        "add",
        "b",
        "--task",
        "tests.add",
        "--crontab",
        "0 3 * * *",
        "--args",
        "[1, 2]",
    )
    assert added.exit_code == 0
    assert added.stdout == "added b\n"
    assert run(app, "periodic", "pause", "a").stdout == "paused a\n"

    listing = json.loads(run(app, "periodic", "list", "--json").stdout)
    assert [
        (s["name"], s["schedule"], s["paused"], s["source"], s["args"])
        for s in listing["schedules"]
    ] == [
        ("a", "every 60s", True, "config", []),
        ("b", "crontab 0 3 * * *", False, "api", [1, 2]),
    ]
    assert "a  tests.record  every 60s  [paused, config, v1]" in run(app, "periodic", "list").stdout

    assert run(app, "periodic", "resume", "a").exit_code == 0
    assert run(app, "periodic", "run", "b").stdout.startswith("sent periodic:b:run:")
    assert run(app, "periodic", "remove", "b").stdout == "removed b\n"
    missing = run(app, "periodic", "pause", "b")
    assert missing.exit_code == 3
    assert "No periodic schedule is named 'b'" in missing.stderr
    assert run(app, "periodic", "run", "b").exit_code == 3
    bad = run(app, "periodic", "add", "c", "--task", "tests.nope", "--every", "5")
    assert bad.exit_code == 78
    assert "unknown task 'tests.nope'" in bad.stderr


def test_status_list_and_metrics_show_next_run_last_run_lateness_and_pause(
    app: Celery, worker, runs: Runs
) -> None:
    import threading

    from prometheus_client import generate_latest

    from celery_zdelay.companion.metrics import Metrics

    # Given a companion serving two schedules, one of them paused
    app.conf.beat_schedule = {
        "tick": {"task": "tests.record", "schedule": 0.5},
        "idle": {"task": "tests.record", "schedule": 60.0},
    }
    companion = Companion(app, beat=True)
    thread = threading.Thread(target=companion.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: periodic.schedules(app)[1], timeout=20)
        assert periodic.pause("idle", app=app)

        # When ticks have been released
        def last_run_seen() -> bool:
            infos = {i.name: i for i in periodic.schedules(app)[1]}
            return infos["tick"].last_run_lateness_ms is not None

        wait_for(last_run_seen, timeout=20)
    finally:
        companion.stop()
        thread.join(timeout=20)

    # Then list, status and the metrics show them
    _now_ms, infos = periodic.schedules(app)
    tick = next(i for i in infos if i.name == "tick")
    assert tick.next_run_ms is not None
    assert tick.next_run_ms > tick.last_run_ms
    assert 0 <= tick.last_run_lateness_ms < 5000  # type: ignore[operator]

    text = run(app, "status").stdout
    assert "Periodic schedules:" in text
    assert "tick  tests.record  every 0.5s  [active" in text
    assert "idle  tests.record  every 60s  [paused" in text
    document = json.loads(run(app, "status", "--json").stdout)
    assert {s["name"]: s["paused"] for s in document["periodic"]} == {"idle": True, "tick": False}

    scraped = generate_latest(Metrics(store_for(app)).registry).decode()
    assert 'zdelay_periodic_paused{schedule="idle"} 1.0' in scraped
    assert 'zdelay_periodic_paused{schedule="tick"} 0.0' in scraped
    assert 'zdelay_periodic_next_run_timestamp_seconds{schedule="tick"}' in scraped
    assert 'zdelay_periodic_last_run_lateness_seconds{schedule="tick"}' in scraped
    assert 'zdelay_periodic_next_run_timestamp_seconds{schedule="idle"}' not in scraped
