"""Periodic tasks across shards, on a Redis Cluster store, with signed entries,
and a running companion picking up a changed beat_schedule."""

from __future__ import annotations

import pytest
import redis
from celery import Celery

from celery_zdelay import periodic
from celery_zdelay.companion import Companion
from celery_zdelay.parking import store_for
from celery_zdelay.periodic.server import PeriodicServer
from celery_zdelay.store.redis_keys import periodic_keys
from celery_zdelay.testing import RedisServer
from tests.conftest import AppFactory
from tests.servers import LocalCluster
from tests.support.periodic import occurrence_ms, server_for, tend

pytestmark = pytest.mark.timeout(120)


def serve(app: Celery, beat_schedule: dict, name: str = "c") -> PeriodicServer:  # type: ignore[type-arg]
    server = server_for(app, beat_schedule, name)
    server.reconcile()
    return server


def parked(app: Celery, name: str) -> set[str]:
    store = store_for(app)
    found: set[str] = set()
    for shard in store.shards:
        for raw in store.client.zrange(store.keys(shard).due, 0, -1):
            task_id = raw.decode()
            if task_id.startswith(f"periodic:{name}:"):
                found.add(task_id)
    return found


def test_occurrences_spread_over_shards_and_a_change_cancels_them_all(
    make_test_app: AppFactory,
) -> None:
    # Given 8 shards and a schedule with many occurrences within the horizon
    app = make_test_app(conf={"zdelay_shards": 8})
    server = serve(app, {"a": {"task": "tests.record", "schedule": 0.25}})
    tend(server)
    first = parked(app, "a")
    store = store_for(app)
    assert len({store.shard_of(i) for i in first}) > 1, "all on one shard"

    # When its definition changes, every parked occurrence on every shard goes
    server = serve(app, {"a": {"task": "tests.record", "schedule": 0.5}}, "c2")
    tend(server)
    now = parked(app, "a")
    assert not now & first
    assert all(":v2:" in i for i in now)


def test_a_running_companion_picks_up_a_changed_beat_schedule(app: Celery) -> None:
    server = serve(app, {"a": {"task": "tests.record", "schedule": 60.0}})
    tend(server)
    assert len(parked(app, "a")) == 1

    # The app's configuration changes in the running process (a reload)
    app.conf.beat_schedule = {"b": {"task": "tests.record", "schedule": 60.0}}
    server._last_check = 0.0  # the periodic comparison is due
    tend(server)

    assert parked(app, "a") == set()
    assert len(parked(app, "b")) == 1


def test_signed_occurrences_are_released(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = make_test_app(conf={"zdelay_signing_key": "k" * 32})
    tend(serve(app, {"a": {"task": "tests.record", "schedule": 60.0}}))
    with Companion(app) as companion:
        report = companion.release_due(advance_ms=61_000)
    assert (report.released, report.dead_lettered) == (1, 0)
    assert redis_client.llen("celery") == 1


def test_a_redis_cluster_store_serves_schedules(
    make_test_app: AppFactory, cluster: LocalCluster, broker_server: RedisServer
) -> None:
    # Given a store on a 3-master cluster with 6 shards, and a separate broker
    app = make_test_app(
        broker=f"{broker_server.url}/0",
        conf={"zdelay_redis_url": cluster.url, "zdelay_shards": 6},
    )
    server = serve(app, {"a": {"task": "tests.record", "schedule": 0.5}})
    tend(server)
    assert len(parked(app, "a")) >= 10
    # Pause cancels them on every node; resume parks again
    assert periodic.pause("a", app=app)
    tend(server)
    assert parked(app, "a") == set()
    assert periodic.resume("a", app=app)
    tend(server)
    ids = parked(app, "a")
    assert len(ids) >= 10

    # The occurrences are released once, and a companion that read the
    # schedule before cannot park one again
    with Companion(app) as companion:
        released = companion.release_due(advance_ms=10_000).released
    assert released == len(ids)
    assert broker_server.client(0).llen("celery") == released
    store = server.periodic
    first = min(ids, key=occurrence_ms)
    (again,) = server._requests(store.snapshot().definitions["a"], first, occurrence_ms(first))
    assert store.park_once(again, occurrence_ms=occurrence_ms(first)) is False


def test_a_beat_schedule_of_five_thousand_entries_is_stored_and_served(app: Celery) -> None:
    # Given a beat_schedule of 5,000 entries, none due for a day (define.lua
    # answered with every changed name through unpack(), which Redis's Lua
    # refuses past about 8,000 values, two per entry: "too many results to
    # unpack")
    schedule = {
        f"reminder-{i}": {"task": "tests.record", "schedule": 86_400.0, "args": (i,)}
        for i in range(5_000)
    }

    # When a companion stores it
    server = serve(app, schedule)

    # Then every entry is stored, and the first pass parks none of them
    # (each one's next occurrence is a day ahead, further than the planner
    # parks: PARK_LEAD_MS) but lists when each one runs next
    store = store_for(app)
    assert store.client.hlen(periodic_keys(store.config.key_prefix).defs) == 5_000
    assert tend(server) == 0
    now_ms, infos = periodic.schedules(app)
    assert len(infos) == 5_000
    assert all(
        i.next_run_ms is not None and 86_000_000 < i.next_run_ms - now_ms <= 86_400_000
        for i in infos
    )
