"""Periodic tasks served by companions: ticks, reconciliation, control, bad input."""

from __future__ import annotations

import itertools
import json
from datetime import datetime, timezone
from typing import Any

import pytest
import redis
from celery import Celery
from celery.schedules import crontab, schedule

from celery_zdelay import ConfigurationError, periodic
from celery_zdelay.companion import Companion
from celery_zdelay.parking import store_for
from celery_zdelay.periodic.occurrences import next_after, plan
from celery_zdelay.periodic.server import PeriodicServer
from celery_zdelay.store.keys import shard_keys
from celery_zdelay.testing import RedisServer
from tests.conftest import AppFactory
from tests.helpers import CeleryProcess, Runs, wait_for
from tests.periodic_helpers import occurrence_ms, start_beat_companion, ticks_of
from tests.project import close_app, make_app

pytestmark = pytest.mark.timeout(120)

DUE = shard_keys("zdelay", 0).due


def parked_ids(client: redis.Redis, name: str) -> set[str]:
    return {
        i.decode() for i in client.zrange(DUE, 0, -1) if i.decode().startswith(f"periodic:{name}:")
    }


def server_for(app: Celery, beat_schedule: dict[str, Any], name: str = "c") -> PeriodicServer:
    app.conf.beat_schedule = beat_schedule
    return PeriodicServer(app, store_for(app), companion_id=name)


def tend(server: PeriodicServer) -> int:
    server._last_tend = 0.0  # every call is a pass, however close together
    return server.tend()


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


# -- reconciliation ---------------------------------------------------------------


def test_entries_added_removed_and_changed_are_reconciled(
    app: Celery, redis_client: redis.Redis
) -> None:
    every = {"task": "tests.record", "schedule": 10.0}
    # Given a stored schedule with entry a, parked ahead
    first = server_for(app, {"a": every})
    assert first.reconcile() == "done"
    tend(first)
    a_v1 = parked_ids(redis_client, "a")
    assert len(a_v1) == 1

    # When a deploy adds b, removes nothing and changes nothing
    second = server_for(app, {"a": every, "b": every}, "c2")
    assert second.reconcile() == "done"
    tend(second)
    # Then b starts and a keeps its parked occurrence and version
    assert parked_ids(redis_client, "a") == a_v1
    assert len(parked_ids(redis_client, "b")) == 1

    # When a deploy changes a and removes b
    third = server_for(app, {"a": {**every, "schedule": 20.0}}, "c3")
    assert third.reconcile() == "done"
    tend(third)
    # Then b's parked occurrence is cancelled and a re-parks from version 2
    assert parked_ids(redis_client, "b") == set()
    a_v2 = parked_ids(redis_client, "a")
    assert len(a_v2) == 1
    assert not a_v2 & a_v1
    assert next(iter(a_v2)).startswith("periodic:a:v2:")
    _, infos = periodic.schedules(app)
    assert [(i.name, i.schedule, i.version) for i in infos] == [("a", "every 20s", 2)]


def test_two_companions_with_different_schedules_serve_the_newest(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given companion old with beat_schedule X, then companion new with Y
    old = server_for(make_test_app(), {"x": {"task": "tests.record", "schedule": 10.0}}, "old")
    new = server_for(make_test_app(), {"y": {"task": "tests.record", "schedule": 10.0}}, "new")
    assert old.reconcile() == "done"
    assert new.reconcile() == "done"

    # When the old one restarts during the rolling deploy, and both serve
    restarted = server_for(old.app, old.app.conf.beat_schedule, "old-again")
    assert restarted.reconcile() == "older"
    for server in (restarted, new, restarted, new):
        tend(server)

    # Then only the newest configuration is served, by both, parked once
    assert parked_ids(redis_client, "x") == set()
    assert len(parked_ids(redis_client, "y")) == 1
    # and a deliberate rollback makes X the stored one again
    assert periodic.sync(old.app, force=True) == "done"
    tend(new)
    assert parked_ids(redis_client, "y") == set()
    assert len(parked_ids(redis_client, "x")) == 1


def test_schedules_and_pause_state_survive_a_redis_restart_with_aof() -> None:
    with RedisServer(appendonly="yes", appendfsync="always") as server:
        url = f"{server.url}/0"
        app = make_app(url, f"{server.url}/1", f"{server.url}/2", conf={"zdelay_redis_url": url})
        try:
            # Given two schedules, one of them paused, and one added at run time
            first = server_for(app, {"a": {"task": "tests.record", "schedule": 10.0}})
            first.reconcile()
            periodic.add(
                "b", app=app, task="tests.add", schedule=crontab(minute="*/5"), args=[1, 2]
            )
            assert periodic.pause("a", app=app)

            # When Redis is killed and started again from its append-only file
            server.kill()
            server.start()

            # Then the schedules, their source and the pause are all there
            _, infos = periodic.schedules(app)
            assert [(i.name, i.paused, i.source, i.schedule) for i in infos] == [
                ("a", True, "config", "every 10s"),
                ("b", False, "api", "crontab */5 * * * *"),
            ]
        finally:
            close_app(app)


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
    assert after >= {ms for ms in before if ms > _redis_ms(redis_client)}
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
    assert store.park_once(again) is False
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
    # Given a companion serving an hourly schedule, its next tick an hour away
    app.conf.beat_schedule = {"hourly": {"task": "tests.record", "schedule": 3600}}
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
        report = companion.release_due(advance_ms=3_601_000)

    # Then only the first (no clock yet) and the last (the tick) asked for ids
    assert asked == [True, False, True]
    assert report.released == 1
    (task_id,) = report.task_ids
    assert str(task_id).startswith("periodic:hourly:")


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
        app, {"a": {"task": "tests.record", "schedule": 3600, "options": {"expires": 60}}}
    )
    server.reconcile()
    tend(server)
    (task_id,) = parked_ids(redis_client, "a")
    with Companion(app) as companion:
        companion.release_due(advance_ms=3_700_000)
    message = redis_client.lpop("celery")
    assert message is not None
    headers = json.loads(message)["headers"]
    expires = datetime.fromisoformat(headers["expires"]).timestamp() * 1000
    assert expires == pytest.approx(occurrence_ms(task_id) + 60_000, abs=1000)


def test_serving_is_off_unless_asked(app: Celery) -> None:
    app.conf.beat_schedule = {"a": {"task": "tests.record", "schedule": 1.0}}
    assert Companion(app).periodic is None
    assert Companion(app, beat=True).periodic is not None
    app.conf.zdelay_beat = True
    assert Companion(app).periodic is not None


def test_the_periodic_commands(app: Celery, redis_client: redis.Redis) -> None:
    from tests.test_cli import run

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
    from tests.test_cli import run

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


def test_a_key_of_the_wrong_type_ticks_nothing(app: Celery, redis_client: redis.Redis) -> None:
    # Given a shard's due set overwritten by something else
    server = server_for(app, {"a": {"task": "tests.record", "schedule": 60}})
    server.reconcile()
    redis_client.set(DUE, "not a zset")
    # When a companion tries to park the next occurrence, it fails, logged
    assert tend(server) == 0
    # Then the occurrence is not marked as parked: it is parked once the key is fixed
    assert redis_client.zcard(shard_keys("zdelay", 0).ticks) == 0
    redis_client.delete(DUE)
    tend(server)
    assert len(parked_ids(redis_client, "a")) == 1


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
    (first,) = parked_ids(redis_client, "a")

    # When no companion serves it for well over five occurrences
    wait_for(lambda: _redis_ms(redis_client) > occurrence_ms(first) + 1200, timeout=10)
    tend(server)

    # Then the first (parked before) waits to run late, the next one is parked
    # ahead, and of the missed ones: the first (once), none (skip), each (all)
    parked = sorted(parked_ids(redis_client, "a"), key=occurrence_ms)
    missed_parked = parked[1:-1]  # between the first and the one ahead
    assert parked[0] == first
    assert occurrence_ms(parked[-1]) > _redis_ms(redis_client) - 300
    if extra is None:
        steps = [occurrence_ms(b) - occurrence_ms(a) for a, b in itertools.pairwise(parked)]
        assert len(missed_parked) >= 5
        assert set(steps) == {200}
    else:
        assert len(missed_parked) == extra


def _redis_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def test_a_redis_that_lost_everything_gets_the_schedule_back(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given a companion serving a schedule
    server = server_for(app, {"a": {"task": "tests.record", "schedule": 60.0}})
    server.reconcile()
    tend(server)
    # When Redis loses everything (restarted without persistence)
    redis_client.flushall()
    # Then the companion's next pass stores its schedule again and parks
    tend(server)
    assert [i.name for i in periodic.schedules(app)[1]] == ["a"]
    assert len(parked_ids(redis_client, "a")) == 1


def test_a_companion_that_cannot_import_a_task_does_not_remove_its_schedule(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given a schedule stored by a companion whose app has the task
    schedule = {
        "x": {"task": "tests.only_here", "schedule": 60.0},
        "y": {"task": "tests.record", "schedule": 60.0},
    }
    full = make_test_app()

    def only_here() -> None:
        """A task whose module only some companions import."""

    full.task(name="tests.only_here", shared=False)(only_here)
    assert server_for(full, schedule, "full").reconcile() == "done"

    # When a companion of the same deploy cannot import that task's module
    partial = server_for(make_test_app(), dict(schedule), "partial")
    partial.reconcile()
    tend(partial)

    # Then the entry stays stored and served, as the first companion defined it
    _, infos = periodic.schedules(full)
    assert [(i.name, i.task, i.version) for i in infos] == [
        ("x", "tests.only_here", 1),
        ("y", "tests.record", 1),
    ]
    assert len(parked_ids(redis_client, "x")) == 1


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
