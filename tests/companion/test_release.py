"""Given tasks parked with apply_delayed, when a companion runs, then a real
worker runs exactly those tasks, with the right results."""

from __future__ import annotations

import json

import pytest
import redis
from celery import Celery
from kombu import Connection, Queue

import celery_zdelay
from celery_zdelay.companion import Companion
from celery_zdelay.parking import store_for
from tests.conftest import AppFactory, RabbitMQ
from tests.helpers import Runs

pytestmark = pytest.mark.timeout(90)


def test_a_redis_broker_worker_runs_every_parked_task_once(
    app: Celery, worker, companion, runs: Runs
) -> None:
    add = app.tasks["tests.add"]
    worker(app)
    companion(app)

    results = [add.apply_delayed((i, i), countdown=0.3) for i in range(40)]

    assert [r.get(timeout=30) for r in results] == [2 * i for i in range(40)]
    assert sorted(runs.ids()) == sorted(r.id for r in results)
    assert runs.duplicates() == {}


def test_a_rabbitmq_worker_runs_every_parked_task_once(
    make_test_app: AppFactory, rabbitmq: RabbitMQ, worker, companion, runs: Runs
) -> None:
    app = make_test_app(broker=rabbitmq.url, conf={"task_default_queue": rabbitmq.queue})
    add = app.tasks["tests.add"]
    worker(app, rabbitmq.queue)
    process = companion(app)

    results = [add.apply_delayed((i, 1), countdown=0.3) for i in range(40)]

    assert [r.get(timeout=30) for r in results] == [i + 1 for i in range(40)]
    assert sorted(runs.ids()) == sorted(r.id for r in results)
    assert runs.duplicates() == {}
    assert "handoff off (the broker is amqp, not Redis)" in process.log()


def test_the_companion_hands_off_atomically_when_the_broker_is_the_store(
    app: Celery, worker, companion, runs: Runs
) -> None:
    process = companion(app)
    assert "handoff on (atomic, exactly once)" in process.log()
    worker(app)

    result = app.tasks["tests.record"].apply_delayed(("hello",), countdown=0.1)

    assert result.get(timeout=30) == ["hello"]
    process.wait_for_log("1 handed off")


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_a_companion_reloads_its_scripts_when_redis_forgot_them(
    make_test_app: AppFactory, redis_client: redis.Redis, rabbitmq: RabbitMQ, broker: str
) -> None:
    # A companion runs its claim or handoff by EVALSHA, without asking SCRIPT
    # EXISTS first: a Redis that lost its scripts (restarted, flushed, failed
    # over) must still get every call, exactly once.
    conf = {"task_default_queue": rabbitmq.queue} if broker == "rabbitmq" else {}
    app = make_test_app(broker=rabbitmq.url if broker == "rabbitmq" else None, conf=conf)
    record = app.tasks["tests.record"]
    with Companion(app) as companion:
        # Given a companion that released once, so its scripts were loaded
        first = [record.apply_delayed((n,), countdown=0).id for n in range(3)]
        assert companion.release_due().released == 3
        # When Redis forgets every script before the next pass
        later = [record.apply_delayed((n,), countdown=0).id for n in range(3, 8)]
        redis_client.script_flush()
        report = companion.release_due()

    # Then that pass released the rest, each once, and nothing is left parked or leased
    assert not report.failed
    assert report.released == 5
    assert sorted(_queued_ids(app, redis_client, rabbitmq, broker)) == sorted(first + later)
    assert celery_zdelay.lookup(later[0], app=app) is None
    assert redis_client.zcard(store_for(app).keys(0).due) == 0
    assert redis_client.zcard(store_for(app).keys(0).lease) == 0


def _queued_ids(app: Celery, client: redis.Redis, rabbitmq: RabbitMQ, broker: str) -> list[str]:
    """The task ids of every message in the broker's default queue, drained."""
    if broker == "redis":
        return [json.loads(m)["headers"]["id"] for m in client.lrange("celery", 0, -1)]
    ids = []
    with Connection(rabbitmq.url) as conn:
        queue = Queue(rabbitmq.queue, channel=conn.default_channel)
        while (message := queue.get(no_ack=True)) is not None:
            ids.append(message.headers["id"])
    return ids
