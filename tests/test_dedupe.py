"""The worker-side guard (zdelay_worker_dedupe) runs a released task once even
when the broker delivers it twice, and leaves retries alone."""

from __future__ import annotations

import json

import pytest
import redis

from celery_zdelay.companion import Companion
from tests.conftest import AppFactory
from tests.helpers import Runs, wait_for

pytestmark = pytest.mark.timeout(90)


def _release_and_duplicate(app, redis_client: redis.Redis) -> None:  # type: ignore[no-untyped-def]
    """Release what is due, then deliver the released message a second time,
    as a companion killed between the broker's ack and its store ack would."""
    with Companion(app) as companion:
        assert companion.release_due().released == 1
    (message,) = redis_client.lrange("celery", 0, -1)
    redis_client.lpush("celery", message)


@pytest.mark.parametrize("dedupe", [True, False])
def test_a_second_delivery_of_a_released_task_is_dropped_when_the_guard_is_on(
    make_test_app: AppFactory, redis_client: redis.Redis, worker, runs: Runs, dedupe: bool
) -> None:
    app = make_test_app(conf={"zdelay_worker_dedupe": dedupe})
    result = app.tasks["tests.record"].apply_delayed(("once",), countdown=0)
    _release_and_duplicate(app, redis_client)
    process = worker(app)

    if dedupe:
        process.wait_for_log("Dropped a second delivery of tests.record")
        assert runs.ids() == [result.id]
    else:
        runs.wait_for_count(2)
        assert runs.ids() == [result.id, result.id]


def test_retries_of_a_guarded_task_still_run(
    make_test_app: AppFactory, worker, companion, runs: Runs
) -> None:
    app = make_test_app(conf={"zdelay_worker_dedupe": True})
    worker(app)
    companion(app)

    result = app.tasks["tests.retry_once"].apply_delayed((0.1,), countdown=0.1)

    assert result.get(timeout=30) == "retried"
    wait_for(lambda: runs.count() == 2, message="the first run and its retry")
    assert [run["retries"] for run in runs.all()] == [0, 1]


# -- a redelivery by the broker is not a second publish (issue 11) ------------------


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_a_task_requeued_with_reject_runs_again_when_the_guard_is_on(
    make_test_app: AppFactory,
    request: pytest.FixtureRequest,
    worker,
    companion,
    runs: Runs,
    broker: str,
) -> None:
    if broker == "rabbitmq":
        rabbitmq = request.getfixturevalue("rabbitmq")
        app = make_test_app(
            broker=rabbitmq.url,
            conf={"zdelay_worker_dedupe": True, "task_default_queue": rabbitmq.queue},
        )
        worker(app, rabbitmq.queue)
    else:
        app = make_test_app(conf={"zdelay_worker_dedupe": True})
        worker(app)
    companion(app)

    result = app.tasks["tests.reject_once"].apply_delayed(countdown=0.1)

    assert result.get(timeout=30) == "ran"
    assert [run["result"] for run in runs.all()] == ["delivered", "delivered"]


@pytest.mark.parametrize("broker", ["rabbitmq", "redis"])
def test_an_acks_late_task_whose_worker_is_killed_runs_on_the_next_worker(
    make_test_app: AppFactory,
    request: pytest.FixtureRequest,
    broker_server,
    worker,
    companion,
    runs: Runs,
    broker: str,
) -> None:
    queues: tuple[str, ...] = ()
    if broker == "rabbitmq":
        rabbitmq = request.getfixturevalue("rabbitmq")
        queues = (rabbitmq.queue,)
        app = make_test_app(
            broker=rabbitmq.url,
            conf={"zdelay_worker_dedupe": True, "task_default_queue": rabbitmq.queue},
        )
    else:
        # kombu restores an unacknowledged message once its visibility timeout
        # has passed, marked redelivered.
        app = make_test_app(
            broker=f"{broker_server.url}/0",
            conf={
                "zdelay_worker_dedupe": True,
                "broker_transport_options": {
                    "visibility_timeout": 2,
                    # Look for abandoned messages every second, not every 100 s.
                    "unacked_restore_interval": 1,
                    "unacked_restore_throttle": 1,
                },
            },
        )
    first = worker(app, *queues)
    companion(app)
    result = app.tasks["tests.slow_late"].apply_delayed((4,), countdown=0.1)
    wait_for(lambda: runs.count() == 1, message="the first run to start")
    first.kill()  # mid-run: the broker gets the unacknowledged message back

    worker(app, *queues)

    assert result.get(timeout=60) == "finished"
    assert [run["result"] for run in runs.all()] == ["started", "started", "finished"]


def test_a_redelivery_of_a_run_that_finished_is_still_dropped(
    make_test_app: AppFactory, redis_client: redis.Redis, worker, runs: Runs
) -> None:
    """The guard's record says the run ended, so even a redelivered copy is a duplicate."""
    app = make_test_app(conf={"zdelay_worker_dedupe": True})
    result = app.tasks["tests.record"].apply_delayed(("once",), countdown=0)
    with Companion(app) as companion:
        assert companion.release_due().released == 1
    (raw,) = redis_client.lrange("celery", 0, -1)
    process = worker(app)
    assert result.get(timeout=30) == ["once"]

    message = json.loads(raw)
    message["properties"]["delivery_info"]["redelivered"] = True
    redis_client.lpush("celery", json.dumps(message))

    process.wait_for_log("a run of it already finished")
    assert runs.ids() == [result.id]
