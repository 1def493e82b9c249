"""A companion killed after claiming a batch loses nothing; one asked to stop
finishes its batch; several companions never release an entry twice.

A companion killed mid-publish on the generic path promises at-least-once:
what it had claimed is released again when the lease expires, and a message
the broker received before the kill then runs twice. The kill test asserts
exactly that (every id runs; any duplicate is one the dead companion held),
not "no duplicates", which holds only while the frozen broker happens to
have received none of the batch.
"""

from __future__ import annotations

import json
import signal

import pytest
import redis

from celery_zdelay.testing import RedisServer
from tests.conftest import AppFactory
from tests.helpers import Runs, wait_for
from tests.support.keys import SHARD0

pytestmark = pytest.mark.timeout(120)

LEASE = SHARD0.lease


def test_a_companion_killed_after_claiming_loses_nothing(
    make_test_app: AppFactory,
    broker_server: RedisServer,
    redis_client: redis.Redis,
    worker,
    companion,
    runs: Runs,
) -> None:
    # Given 500 parked tasks and a companion whose broker freezes mid-release
    app = make_test_app(
        broker=f"{broker_server.url}/0", conf={"zdelay_lease_seconds": 2, "zdelay_batch_size": 200}
    )
    record = app.tasks["tests.record"]
    ids = {record.apply_delayed((i,), countdown=1.0).id for i in range(500)}
    doomed = companion(app)
    broker_server.pause()

    # When it has claimed a batch (now leased) and is SIGKILLed while publishing
    wait_for(lambda: redis_client.zcard(LEASE) > 0, message="a claimed batch")
    doomed.kill()
    in_hand = {m.decode() for m in redis_client.zrange(LEASE, 0, -1)}
    assert in_hand
    broker_server.resume()

    # Then another companion releases everything once the lease expires:
    # each id runs, and only ids the dead companion held may run twice
    worker(app)
    companion(app)
    runs.wait_for_ids(ids, stall_timeout=60)
    assert set(runs.ids()) == ids
    assert set(runs.duplicates()) <= in_hand
    wait_for(lambda: redis_client.zcard(LEASE) == 0, message="no entry left in flight")
    assert redis_client.hlen(SHARD0.msg) == 0


@pytest.mark.parametrize("path", ["handoff", "generic"])
def test_three_companions_release_each_task_once(
    make_test_app: AppFactory,
    broker_server: RedisServer,
    redis_server: RedisServer,
    worker,
    companion,
    runs: Runs,
    path: str,
) -> None:
    broker = f"{redis_server.url}/0" if path == "handoff" else f"{broker_server.url}/0"
    app = make_test_app(broker=broker, conf={"zdelay_batch_size": 50})
    record = app.tasks["tests.record"]
    for _ in range(3):
        companion(app)
    worker(app)

    ids = {record.apply_delayed((i,), countdown=0.5 + (i % 10) * 0.05).id for i in range(600)}

    runs.wait_for_ids(ids, stall_timeout=60)
    assert set(runs.ids()) == ids
    assert runs.duplicates() == {}


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_companion_stopped_mid_batch_finishes_it_exits_0_and_strands_nothing(
    make_test_app: AppFactory,
    broker_server: RedisServer,
    redis_client: redis.Redis,
    worker,
    companion,
    runs: Runs,
    stop: signal.Signals,
) -> None:
    # Given 1,000 parked tasks and a companion whose broker freezes mid-release
    # (with a 60 s lease it waits 30 s for the broker before giving a batch
    # back: far longer than this test keeps the broker frozen)
    app = make_test_app(
        broker=f"{broker_server.url}/0",
        conf={"zdelay_batch_size": 200, "zdelay_lease_seconds": 60},
    )
    record = app.tasks["tests.record"]
    ids = {record.apply_delayed((i,), countdown=1.0).id for i in range(1_000)}
    stopping = companion(app)
    broker_server.pause()
    try:
        wait_for(lambda: redis_client.zcard(LEASE) > 0, message="a claimed batch")
        in_hand = {m.decode() for m in redis_client.zrange(LEASE, 0, -1)}

        # When it is asked to stop while that batch is on its way to the broker
        assert stopping.process is not None
        stopping.process.send_signal(stop)
    finally:
        broker_server.resume()

    # Then it publishes the batch in hand, exits 0 and leaves nothing in flight
    assert stopping.process.wait(timeout=60) == 0, stopping.log()[-3000:]
    assert redis_client.zcard(LEASE) == 0
    assert redis_client.hlen(SHARD0.leased) == 0
    broker = broker_server.client(0)
    queued = [json.loads(raw)["headers"]["id"] for raw in broker.lrange("celery", 0, -1)]
    parked = {m.decode() for m in redis_client.zrange(SHARD0.due, 0, -1)}
    assert in_hand <= set(queued)
    assert len(queued) == len(set(queued))
    assert set(queued) | parked == ids
    assert not set(queued) & parked

    # And the next companion releases the rest, each task once
    worker(app)
    companion(app)
    runs.wait_for_ids(ids, stall_timeout=60)
    assert runs.duplicates() == {}
