"""The stored schedule follows ``beat_schedule``: reconciled, newest wins, kept across restarts.

Added, removed and changed entries; two configurations; AOF restarts; a Redis
that lost everything; a companion that cannot import a task; a key of the
wrong type.
"""

from __future__ import annotations

import logging

import pytest
import redis
from celery import Celery
from celery.schedules import crontab

from celery_zdelay import periodic
from celery_zdelay.periodic.server import NAMES_LOGGED, _some_names
from celery_zdelay.testing import RedisServer
from tests.conftest import AppFactory
from tests.project import close_app, make_app
from tests.support.keys import SHARD0
from tests.support.periodic import parked_ids, server_for, tend

pytestmark = pytest.mark.timeout(120)

DUE = SHARD0.due


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


def test_a_key_of_the_wrong_type_ticks_nothing(app: Celery, redis_client: redis.Redis) -> None:
    # Given a shard's due set overwritten by something else
    server = server_for(app, {"a": {"task": "tests.record", "schedule": 60}})
    server.reconcile()
    redis_client.set(DUE, "not a zset")
    # When a companion tries to park the next occurrence, it fails, logged
    assert tend(server) == 0
    # Then the occurrence is not marked as parked: it is parked once the key is fixed
    assert redis_client.zcard(SHARD0.ticks) == 0
    redis_client.delete(DUE)
    tend(server)
    assert len(parked_ids(redis_client, "a")) == 1


def test_a_large_change_logs_twenty_names_and_how_many_more(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    # Given 25 new entries (a first start over 100,000 django-celery-beat rows
    # logged one line of every name, about 1.5 MB)
    schedule = {f"s-{i:02}": {"task": "tests.record", "schedule": 60.0} for i in range(25)}
    server = server_for(app, schedule)
    with caplog.at_level(logging.INFO, logger="celery_zdelay.periodic.server"):
        server.reconcile()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Stored ")]
    assert "; new: s-00, s-01," in line
    assert "s-19 and 5 more; changed: none; removed: none" in line
    assert "s-20" not in line
    # And a change of exactly twenty names lists them all, with no "more"
    assert _some_names([f"n{i}" for i in range(NAMES_LOGGED)]) == ", ".join(
        f"n{i}" for i in range(NAMES_LOGGED)
    )
