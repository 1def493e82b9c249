"""Given tasks parked with apply_delayed, when a companion runs, then a real
worker runs exactly those tasks, with the right results."""

from __future__ import annotations

import pytest
from celery import Celery

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
