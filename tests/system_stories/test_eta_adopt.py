"""ETA tasks sent before the switch, adopted: ``zdelay adopt`` moves them into the store.

``docs/migrating.rst`` gives two ways for the ETA tasks that workers hold
after a project switches to celery-zdelay: let the workers drain them
(``test_eta_drain.py``), or stop the workers and adopt them. These stories
prove the second on a Redis broker and on RabbitMQ, with real workers, a
real companion and the command as users run it:

- tasks sent with ``apply_async(countdown=...)`` and held by a worker go
  back to the queue when it stops (warm on Redis, SIGKILL on RabbitMQ);
  ``adopt`` refuses while the worker runs, then parks each under its own
  id and gives back the rest; with a companion and a worker started, every
  id runs once, no ETA task before its eta, the others at once;
- a run SIGKILLed between parking and acknowledging, its parked copies
  released and run meanwhile, then a second run: every id runs once.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection

import celery_zdelay
from celery_zdelay.cli import EXIT_CHECK_FAILED, EXIT_OK
from celery_zdelay.schedule import due_from
from tests.conftest import AppFactory, RabbitMQ
from tests.helpers import CeleryProcess, Runs, wait_for
from tests.project import KILL_ON_PARKED_ENV
from tests.support.cli import run
from tests.support.keys import SHARD0
from tests.support.scheduled import held_etas

pytestmark = pytest.mark.timeout(300)

#: Seconds before the held tasks come due: room for a worker's start, the
#: refused run (it waits 2 s for the workers' answer), a stop and the adopt
#: run on a loaded machine.
COUNTDOWN_S = 30


def _waiting(app: Celery, queue: str) -> int:
    """Messages ready in *queue* (a passive declare, which creates nothing)."""
    with Connection(app.conf.broker_url) as connection:
        _, count, _ = connection.default_channel.queue_declare(queue=queue, passive=True)
        return int(count)


def _adopt(app: Celery, queue: str, *args: str) -> dict[str, Any]:
    """``zdelay adopt --queue <queue> --json``; return its report of the queue."""
    result = run(app, "adopt", "--queue", queue, "--json", *args)
    assert result.exit_code == EXIT_OK, result.output
    (report,) = json.loads(result.stdout)["queues"]
    return dict(report)


def _not_a_task(app: Celery, queue: str) -> None:
    """Publish a message to *queue* that is no Celery task."""
    with app.producer_or_acquire() as producer:
        producer.publish({"hello": "world"}, exchange="", routing_key=queue)


def _assert_each_ran_once_none_early(runs: Runs, etas: dict[str, float], others: set[str]) -> None:
    ran = runs.wait_for_ids(set(etas) | others, stall_timeout=COUNTDOWN_S + 60)
    assert sorted(ran) == sorted(set(etas) | others)
    assert runs.duplicates() == {}
    for each in runs.all():
        if each["id"] in etas:
            # Released by the companion: the worker got no eta to hold, and
            # the task still sees the one it was sent with
            assert each["message_eta"] is None, each
            assert due_from(eta=each["eta"]).ms == pytest.approx(etas[each["id"]] * 1000, abs=1)
            assert each["redis_ms"] >= etas[each["id"]] * 1000, each


def test_redis_tasks_a_worker_gave_back_on_a_warm_stop_are_adopted_and_each_runs_once(
    app: Celery,
    worker: Callable[..., CeleryProcess],
    companion: Callable[..., CeleryProcess],
    runs: Runs,
) -> None:
    # Given a worker holding ETA tasks sent as before the switch
    first = worker(app)
    record = app.tasks["tests.record"]
    sent = [record.apply_async(("held", n), countdown=COUNTDOWN_S + n).id for n in range(5)]
    wait_for(lambda: set(held_etas(app)) == set(sent), timeout=30, interval=0.5)
    etas = held_etas(app)

    # Then adopt refuses while it runs, and with --force finds nothing to take
    refused = run(app, "adopt", "--queue", "celery")
    assert refused.exit_code == EXIT_CHECK_FAILED
    assert "consumes queue 'celery'" in refused.stderr
    assert "Stop those workers" in refused.stderr
    forced = _adopt(app, "celery", "--force")
    assert (forced["read"], forced["unacked"]) == (0, 5)  # held by the worker

    # When it is stopped warm, and beside what it gave back wait a task to
    # run at once, one whose eta passed and a message that is no task
    assert first.terminate() == 0
    at_once = record.apply_async(("now",)).id
    passed = record.apply_async(("passed",), countdown=-60).id
    _not_a_task(app, "celery")
    report = _adopt(app, "celery")

    # Then the ETA tasks are parked under their ids, the rest back in the queue
    assert report["adopted"] == 5
    assert report["put_back"] == {"eta_passed": 1, "no_eta": 1, "not_a_task": 1}
    assert report["latest_eta"] == datetime.fromtimestamp(
        max(etas.values()), tz=timezone.utc
    ).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert {celery_zdelay.lookup(task_id, app=app).state for task_id in sent} == {"parked"}
    assert _waiting(app, "celery") == 3

    # When the companion and a worker start
    companion(app)
    worker(app)

    # Then every id runs once, none before its eta, the others at once
    _assert_each_ran_once_none_early(runs, etas, {at_once, passed})


def test_rabbitmq_tasks_a_killed_worker_held_are_adopted_and_each_runs_once(
    make_test_app: AppFactory,
    rabbitmq: RabbitMQ,
    worker: Callable[..., CeleryProcess],
    companion: Callable[..., CeleryProcess],
    runs: Runs,
) -> None:
    queue = rabbitmq.queue
    app = make_test_app(broker=rabbitmq.url, conf={"task_default_queue": queue})
    # Given a worker holding ETA tasks sent as before the switch
    first = worker(app)
    record = app.tasks["tests.record"]
    sent = [record.apply_async(("held", n), countdown=COUNTDOWN_S + n).id for n in range(5)]
    wait_for(lambda: set(held_etas(app)) == set(sent), timeout=30, interval=0.5)
    etas = held_etas(app)

    # Then adopt refuses while it runs: RabbitMQ counts its consumer
    refused = run(app, "adopt", "--queue", queue)
    assert refused.exit_code == EXIT_CHECK_FAILED
    assert f"RabbitMQ counts 1 consumer(s) of queue {queue!r}" in refused.stderr

    # When it is killed (RabbitMQ gives back what it held at once) and adopt runs
    first.kill()
    wait_for(lambda: _waiting(app, queue) == 5, message="the held tasks back in the queue")
    at_once = record.apply_async(("now",)).id
    report = _adopt(app, queue)

    # Then the ETA tasks are parked, the other is back in the queue
    assert (report["adopted"], report["put_back"]) == (5, {"no_eta": 1})
    assert _waiting(app, queue) == 1

    # When the companion and a worker start, every id runs once, none early
    companion(app)
    worker(app)
    _assert_each_ran_once_none_early(runs, etas, {at_once})


#: Tasks of the killed run: more than one batch (500), so that one batch is
#: parked and acknowledged and the next parked and not.
KILLED_RUN_TASKS = 520
#: kombu's Redis transport gives back a killed consumer's messages this many
#: seconds after it took them (an hour by default).
VISIBILITY_S = 3


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_a_run_killed_between_park_and_ack_runs_every_task_once_after_a_second_run(
    broker: str,
    make_test_app: AppFactory,
    request: pytest.FixtureRequest,
    processes: list[CeleryProcess],
    worker: Callable[..., CeleryProcess],
    companion: Callable[..., CeleryProcess],
    runs: Runs,
    redis_client: redis.Redis,
) -> None:
    if broker == "rabbitmq":
        rabbitmq: RabbitMQ = request.getfixturevalue("rabbitmq")
        queue = rabbitmq.queue
        app = make_test_app(broker=rabbitmq.url, conf={"task_default_queue": queue})
    else:
        queue = "celery"
        options = {"broker_transport_options": {"visibility_timeout": VISIBILITY_S}}
        app = make_test_app(conf=options)
    # Given a companion, and ETA tasks waiting in the queue (due once adopt
    # has started and read them: 15 s was too little beside a whole loaded
    # suite, and every task was put back as due)
    companion(app)
    due = datetime.now(timezone.utc) + timedelta(seconds=COUNTDOWN_S)
    record = app.tasks["tests.record"]
    sent = {record.apply_async((n,), eta=due).id for n in range(KILLED_RUN_TASKS)}

    # When adopt is killed right after parking its second batch, before
    # acknowledging it to the broker
    killed = CeleryProcess(
        app, "zdelay", "adopt", "--queue", queue, env={KILL_ON_PARKED_ENV: "2"}
    ).start()
    processes.append(killed)
    assert killed.process is not None
    assert killed.process.wait(timeout=120) == -signal.SIGKILL, killed.log()
    killed_at = time.time()

    # and the companion releases every parked task (to the queue: no worker runs)
    wait_for(
        lambda: redis_client.zcard(SHARD0.due) + redis_client.zcard(SHARD0.lease) == 0,
        timeout=60,
        message="every parked task released",
    )
    if broker == "redis":
        wait_for(lambda: time.time() > killed_at + VISIBILITY_S + 0.5, timeout=30)
    # and adopt runs again: the second batch's messages are back, due now
    report = _adopt(app, queue)

    # Then it takes them for copies of the parked ones: none is put back to run again
    assert report["adopted_before"] == KILLED_RUN_TASKS - 500, report
    assert report["restored"] == (KILLED_RUN_TASKS - 500 if broker == "redis" else 0)
    assert report["adopted"] == 0
    assert report["put_back"] == {"no_eta": KILLED_RUN_TASKS}  # the released ones

    # and once a worker starts, every task runs once, none before its eta
    worker(app)
    ran = runs.wait_for_ids(sent, stall_timeout=60)
    assert sorted(ran) == sorted(sent)
    assert runs.duplicates() == {}
    assert min(r["redis_ms"] for r in runs.all()) >= due.timestamp() * 1000
