"""Scale-out: shards, a Redis Cluster store, a Sentinel-managed store."""

from __future__ import annotations

import pytest
import redis

import celery_zdelay
from celery_zdelay.companion import Companion
from celery_zdelay.parking import store_for
from celery_zdelay.store.redis_keys import shard_keys
from celery_zdelay.testing import RedisServer
from tests.conftest import AppFactory
from tests.helpers import Runs
from tests.servers import LocalCluster, LocalSentinel

pytestmark = pytest.mark.timeout(120)


def test_shards_spread_entries_by_task_id(app_factory_shards, redis_client: redis.Redis) -> None:
    app = app_factory_shards(4)
    record = app.tasks["tests.record"]
    ids = [record.apply_delayed((i,), countdown=0).id for i in range(400)]

    sizes = [redis_client.zcard(shard_keys("zdelay", s).due) for s in range(4)]
    assert sum(sizes) == 400
    assert all(size > 50 for size in sizes), sizes
    assert celery_zdelay.cancel(ids[0], app=app) is True

    with Companion(app) as companion:
        assert companion.release_due().released == 399
    assert redis_client.llen("celery") == 399


@pytest.fixture
def app_factory_shards(make_test_app: AppFactory):  # type: ignore[no-untyped-def]
    return lambda shards: make_test_app(conf={"zdelay_shards": shards})


def test_a_redis_cluster_store_releases_every_task_once(
    make_test_app: AppFactory,
    cluster: LocalCluster,
    broker_server: RedisServer,
    worker,
    companion,
    runs: Runs,
) -> None:
    # Given a store on a 3-master cluster with 6 shards, and a separate broker
    app = make_test_app(
        broker=f"{broker_server.url}/0",
        conf={"zdelay_redis_url": cluster.url, "zdelay_shards": 6},
    )
    record = app.tasks["tests.record"]
    assert store_for(app).cluster

    # When tasks are parked, some cancelled and some rescheduled
    results = [record.apply_delayed((i,), countdown=1.0) for i in range(600)]
    cancelled = {r.id for r in results[:50]}
    for task_id in cancelled:
        assert celery_zdelay.cancel(task_id, app=app)
    for r in results[50:100]:
        assert celery_zdelay.reschedule(r.id, countdown=0.5, app=app)
    with celery_zdelay.batch(app):
        results += [record.apply_delayed((i,), countdown=1.0) for i in range(600, 700)]
    assert all(count > 0 for count in cluster.key_counts()), "shards spread over the nodes"

    # Then two companions release every other task exactly once
    worker(app)
    process = companion(app)
    companion(app)
    expected = {r.id for r in results} - cancelled
    runs.wait_for_ids(expected, stall_timeout=60)
    assert set(runs.ids()) == expected
    assert runs.duplicates() == {}
    assert "handoff off (the store is a Redis Cluster, the broker is not)" in process.log()


def test_a_sentinel_store_finds_its_master_and_hands_off(
    make_test_app: AppFactory, worker, companion, runs: Runs
) -> None:
    with LocalSentinel() as sentinel:
        app = make_test_app(
            broker=f"{sentinel.master.url}/0",
            conf={
                "zdelay_redis_url": f"{sentinel.url}/0",
                "zdelay_redis_options": {"master_name": sentinel.master_name},
            },
        )
        record = app.tasks["tests.record"]
        worker(app)
        process = companion(app)

        results = [record.apply_delayed((i,), countdown=0.2) for i in range(50)]

        runs.wait_for_count(50)
        assert set(runs.ids()) == {r.id for r in results}
        assert "handoff on" in process.log()
        assert "sentinel://127.0.0.1" in process.log()
