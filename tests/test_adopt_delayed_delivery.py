"""``zdelay adopt --delayed-delivery``: ETA tasks waiting in RabbitMQ's delay queues, adopted once.

Issue 35 ("Moving over from them, finished"): a project that used Celery's
native delayed delivery (Celery >= 5.5 on RabbitMQ quorum queues) has its
ETA tasks in 28 delay queues of RabbitMQ, ``celery_delayed_27`` ..
``celery_delayed_0``, which hand each message down by their TTLs to the
``celery_delayed_delivery`` exchange. Adopt reads them, parks each task
with an eta ahead as Celery sent it (routing key kept, bound for the
delivery exchange) and acknowledges it; released, it reaches its queue and
a real worker runs it, once.

Each test has a RabbitMQ vhost of its own (the delay queues' names are
fixed), made with ``rabbitmqctl`` on the machine's server and deleted after.
The topology is declared by kombu's own functions, those Celery's worker
calls at its start.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from kombu import Connection, Exchange, Queue

import celery_zdelay
from celery_zdelay import adoption
from celery_zdelay.adoption import DELAY_QUEUES
from celery_zdelay.cli import EXIT_OK, EXIT_USAGE
from celery_zdelay.companion import Companion
from celery_zdelay.parking import store_for
from tests.conftest import RABBITMQ_URL, AppFactory
from tests.helpers import CeleryProcess, Runs, unavailable, wait_for
from tests.support.cli import run

pytestmark = [pytest.mark.timeout(120), pytest.mark.kombu57]

# Native delayed delivery is kombu 5.5+ (make oldest runs kombu 5.3, and
# leaves kombu57 tests out): its topology is declared by kombu's own code.
native = pytest.importorskip(
    "kombu.transport.native_delayed_delivery", reason="native delayed delivery is kombu 5.5+"
)
declare_native_delayed_delivery_exchanges_and_queues = (
    native.declare_native_delayed_delivery_exchanges_and_queues
)
bind_queue_to_native_delayed_delivery_exchange = (
    native.bind_queue_to_native_delayed_delivery_exchange
)

QUEUE = "reports"
#: Countdowns of the tasks sent: each waits in a different delay queue.
COUNTDOWNS = (300, 5_000, 70_000)


def _rabbitmqctl(*args: str) -> None:
    result = subprocess.run(
        ["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr[-500:]


@pytest.fixture
def vhost_url() -> Iterator[str]:
    """A RabbitMQ vhost of this test's own on the machine's server, for guest: its URL."""
    if shutil.which("rabbitmqctl") is None:
        unavailable("rabbitmqctl not found: the delay queues need a vhost of their own")
    name = f"zdelay-dd-{uuid.uuid4().hex[:10]}"
    user = RABBITMQ_URL.split("//", 1)[1].split(":", 1)[0]
    _rabbitmqctl("add_vhost", name)
    try:
        _rabbitmqctl("set_permissions", "-p", name, user, ".*", ".*", ".*")
        scheme, rest = RABBITMQ_URL.split("://", 1)
        yield f"{scheme}://{rest.split('/', 1)[0]}/{name}"
    finally:
        _rabbitmqctl("delete_vhost", name)


@pytest.fixture
def app(make_test_app: AppFactory, vhost_url: str) -> Celery:
    """Celery's "Using Quorum Queues" setup: a quorum queue on a topic exchange, confirms."""
    app = make_test_app(
        broker=vhost_url,
        queues=[
            {
                "name": QUEUE,
                "exchange": QUEUE,
                "exchange_type": "topic",
                "routing_key": QUEUE,
                "queue_arguments": {"x-queue-type": "quorum"},
            }
        ],
        conf={
            "task_default_queue": QUEUE,
            "task_default_exchange": QUEUE,
            "task_default_exchange_type": "topic",
            "task_default_routing_key": QUEUE,
            "broker_transport_options": {"confirm_publish": True},
        },
    )
    with Connection(vhost_url) as connection:
        declare_native_delayed_delivery_exchanges_and_queues(connection, "quorum")
        for queue in app.amqp.queues.values():
            queue(connection.default_channel).declare()  # as the worker's consumer does
            bind_queue_to_native_delayed_delivery_exchange(connection, queue)
    return app


def _counts(url: str) -> dict[str, int]:
    """Messages per delay queue (those holding any) and in the task queue."""
    found = {}
    with Connection(url) as connection:
        for name in (*DELAY_QUEUES, QUEUE):
            bound = Queue(name).bind(connection.default_channel)
            found[name] = bound.queue_declare(passive=True).message_count
    return {name: n for name, n in found.items() if n or name == QUEUE}


def _send(app: Celery) -> list[str]:
    """Send tasks with countdowns the native way: into the delay queues."""
    ids = [
        app.tasks["tests.record"].apply_async((i,), countdown=c).id
        for i, c in enumerate(COUNTDOWNS)
    ]
    url = app.conf.broker_url
    wait_for(lambda: sum(_counts(url).values()) == len(ids), timeout=30, message="queued")
    return ids


def _adopt(app: Celery, *args: str) -> list[dict[str, Any]]:
    result = run(app, "adopt", "--delayed-delivery", "--json", *args)
    assert result.exit_code == EXIT_OK, result.output
    return list(json.loads(result.stdout)["queues"])


def test_delayed_delivery_tasks_are_adopted_once_and_each_runs_once_when_released(
    app: Celery, worker: Callable[..., CeleryProcess], runs: Runs
) -> None:
    # Given three tasks sent with countdowns of 5 minutes to 19 hours: each
    # waits in RabbitMQ's delay queues, none in the task queue
    ids = _send(app)
    before = _counts(app.conf.broker_url)
    assert before[QUEUE] == 0
    assert len([n for n in before if n != QUEUE]) == len(COUNTDOWNS)

    # When a dry run counts them, then adopt moves them
    dry = _adopt(app, "--dry-run")
    assert sum(q["adopted"] for q in dry) == len(ids)
    assert _counts(app.conf.broker_url) == before
    report = _adopt(app)

    # Then all three are parked, due at their own times, and gone from RabbitMQ
    assert sum(q["adopted"] for q in report) == len(ids)
    assert [q["queue"] for q in report] == [
        q for q in DELAY_QUEUES if q in [r["queue"] for r in report]
    ]
    assert _counts(app.conf.broker_url) == {QUEUE: 0}
    now_ms = store_for(app).time_ms()
    for task_id, countdown in zip(ids, COUNTDOWNS, strict=True):
        found = celery_zdelay.lookup(task_id, app=app)
        assert found is not None, task_id
        due_ms = found.due_ms
        assert now_ms + (countdown - 60) * 1000 < due_ms <= now_ms + countdown * 1000, task_id
    # And a second run finds nothing to adopt
    assert sum(q["adopted"] + q["adopted_before"] for q in _adopt(app)) == 0

    # When they fall due (moved to now) and a companion releases them
    worker(app, QUEUE)
    for task_id in ids:
        assert celery_zdelay.reschedule(task_id, countdown=0, app=app)
    with Companion(app, store=store_for(app)) as companion:
        assert companion.release_due().released == len(ids)

    # Then the delivery exchange routes each to its queue, and each runs once
    runs.wait_for_count(len(ids), timeout=30)
    assert Counter(r["id"] for r in runs.all()) == Counter(ids)


def test_the_released_message_is_the_one_celery_sent_without_what_rabbitmq_added(
    app: Celery,
) -> None:
    # Given one task in a delay queue, adopted
    (task_id,) = [app.tasks["tests.record"].apply_async((7,), countdown=600).id]
    wait_for(lambda: sum(_counts(app.conf.broker_url).values()) == 1, timeout=30)
    assert sum(q["adopted"] for q in _adopt(app)) == 1
    parked = celery_zdelay.lookup(task_id, app=app)
    assert parked is not None
    # (shown under its queue: pauses and limits of queue:reports hold it)
    assert parked.queue == QUEUE

    # When it is released
    assert celery_zdelay.reschedule(task_id, countdown=0, app=app)
    with Companion(app, store=store_for(app)) as companion:
        assert companion.release_due().released == 1

    # Then the task queue holds Celery's message: its id and arguments, the
    # eta in zdelay_eta for the worker, and none of RabbitMQ's dead-letter
    # headers (x-death: a message that stepped down a delay queue has it;
    # x-delivery-count is the task queue's own, a quorum queue's count)
    with Connection(app.conf.broker_url) as connection:
        bound = Queue(QUEUE).bind(connection.default_channel)
        message = wait_for(lambda: bound.get(no_ack=True), timeout=30, message="released")
    headers = message.headers
    assert headers["id"] == task_id
    assert headers["eta"] is None
    assert headers["zdelay_eta"]
    assert not [h for h in headers if h.startswith("x-") and h != "x-delivery-count"], headers
    # (sent to its queue's exchange and key, as Celery sends it without the delay)
    assert (message.delivery_info["exchange"], message.delivery_info["routing_key"]) == (
        QUEUE,
        QUEUE,
    )
    assert json.loads(message.body)[0] == [7]


def test_a_broker_without_delay_queues_is_refused_before_anything_is_taken(
    make_test_app: AppFactory, vhost_url: str
) -> None:
    app = make_test_app(broker=vhost_url)
    result = run(app, "adopt", "--delayed-delivery")
    assert result.exit_code == EXIT_USAGE
    assert "none of the delay queues" in result.stderr
    # And adopt needs a queue or --delayed-delivery
    assert run(app, "adopt").exit_code == 2


def test_a_task_delayed_for_a_queue_the_app_does_not_name_is_left_to_rabbitmq(
    app: Celery,
) -> None:
    # Given a task of another app sharing the virtual host, delayed for its
    # own queue (a topic queue the delivery exchange routes to), and one of ours
    other = Queue(
        "elsewhere",
        Exchange("elsewhere", type="topic"),
        routing_key="elsewhere",
        queue_arguments={"x-queue-type": "quorum"},
    )
    with Connection(app.conf.broker_url) as connection:
        other(connection.default_channel).declare()
        bind_queue_to_native_delayed_delivery_exchange(connection, other)
    record = app.tasks["tests.record"]
    theirs = record.apply_async((1,), countdown=600, queue=other).id
    ours = record.apply_async((2,), countdown=600).id
    wait_for(lambda: sum(_counts(app.conf.broker_url).values()) == 2, timeout=30)

    # When adopt reads the delay queues
    report = _adopt(app)

    # Then ours is parked; theirs went back to its delay queue, said why
    assert sum(q["adopted"] for q in report) == 1
    assert sum(q["put_back"].get("other_queue", 0) for q in report) == 1
    assert celery_zdelay.lookup(ours, app=app) is not None
    assert celery_zdelay.lookup(theirs, app=app) is None
    assert sum(n for q, n in _counts(app.conf.broker_url).items() if q != QUEUE) == 1


def test_the_delay_queues_and_routing_keys_are_those_kombu_makes() -> None:
    # celery_zdelay.adoption spells them out (it loads with kombu 5.3 too)
    assert tuple(native.level_name(n) for n in range(native.MAX_LEVEL, -1, -1)) == DELAY_QUEUES
    key = native.calculate_routing_key(70_000, QUEUE)
    assert adoption._DELAY_BITS.sub("", key, count=1) == QUEUE
