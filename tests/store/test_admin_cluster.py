"""Inspection and administration on a real 3-master Redis Cluster store."""

from __future__ import annotations

import json

import pytest

from celery_zdelay.cli import EXIT_OK
from celery_zdelay.config import get_config
from celery_zdelay.store import Store, admin
from celery_zdelay.testing import RedisServer
from tests.conftest import AppFactory
from tests.servers import LocalCluster
from tests.support.cli import run
from tests.support.store import stock

pytestmark = pytest.mark.timeout(120)


def test_status_list_and_dead_letters_work_on_a_redis_cluster(
    make_test_app: AppFactory, cluster: LocalCluster, broker_server: RedisServer
) -> None:
    # Given a store of 6 shards spread over 3 cluster nodes, with every state
    app = make_test_app(
        broker=f"{broker_server.url}/0",
        conf={"zdelay_redis_url": cluster.url, "zdelay_shards": 6},
    )
    stocked = stock(app)
    store = Store(get_config(app))
    try:
        assert store.cluster

        # Then counts, listings and health read every shard on its own node
        counted = admin.counts(store)
        # (the entry in flight past its due time is overdue and listed too)
        assert (counted.parked, counted.overdue, counted.in_flight, counted.dead) == (5, 2, 1, 1)
        listing = admin.list_parked(store)
        assert [e.task_id for e in listing.entries] == [
            stocked.in_flight,
            stocked.overdue,
            stocked.soon,
            *stocked.later,
        ]
        assert [e.task_id for e in admin.list_parked(store, task="tests.add").entries] == [
            stocked.soon
        ]
        assert admin.server_health(store).maxmemory_policy == "noeviction"

        # ... and the commands run there too
        status = run(app, "status", "--json", "--per-shard")
        assert status.exit_code == EXIT_OK, status.output
        document = json.loads(status.stdout)
        assert document["parked"] == 5
        assert [s["shard"] for s in document["shards"]] == list(range(6))
        assert run(app, "cancel", stocked.soon).exit_code == EXIT_OK
        assert run(app, "reschedule", stocked.overdue, "--countdown", "60").exit_code == EXIT_OK
        dead = json.loads(run(app, "dead", "list", "--json").stdout)["entries"]
        assert [e["id"] for e in dead] == [stocked.dead]

        # ... requeue and purge included
        assert admin.requeue_all_dead(store) == (1, 0)
        assert admin.counts(store).dead == 0
        assert stocked.dead in {e.task_id for e in admin.list_parked(store).entries}
        assert run(app, "cancel", stocked.dead).exit_code == EXIT_OK
        assert admin.counts(store).parked == 4
        assert admin.purge_dead(store) == 0
    finally:
        store.close()
