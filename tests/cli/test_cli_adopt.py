"""``zdelay adopt``: what it parks is the message Celery sent, a dry run changes nothing, bad input.

No worker runs here: messages are sent to the queue as ``apply_async`` sends
them, adopted, and released by an in-process companion pass; the stories
with real workers are in ``tests/system_stories/test_eta_adopt.py``. Each
adopt run is given ``--force`` where no worker could run (it skips asking
the workers, which waits for their answer).
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection, Queue

from celery_zdelay.cli import EXIT_CONFIG, EXIT_OK, EXIT_USAGE
from celery_zdelay.companion import Companion
from tests.conftest import AppFactory, RabbitMQ
from tests.helpers import wait_for
from tests.support.cli import run
from tests.support.fidelity import PRIORITY_SEP, assert_same_message, raw_amqp
from tests.support.keys import SHARD0

pytestmark = pytest.mark.timeout(120)

#: How far ahead the sent tasks are due: the adopt run must see them ahead.
AHEAD_S = 4
#: Enough messages that RabbitMQ needs a while to take them back.
MANY = 3000


def _adopt(app: Celery, queue: str, *args: str) -> dict[str, Any]:
    result = run(app, "adopt", "--queue", queue, "--force", "--json", *args)
    assert result.exit_code == EXIT_OK, result.output
    (report,) = json.loads(result.stdout)["queues"]
    return dict(report)


def _release_into(app: Celery, ready: Any) -> None:
    """Companion passes until *ready* (the released message reached its queue)."""
    with Companion(app) as companion:

        def released() -> Any:
            companion.release_due()
            return ready()

        wait_for(released, timeout=AHEAD_S + 30, interval=0.1, message="the adopted task released")


def _queued(rabbitmq: RabbitMQ, count: int) -> None:
    """Wait until RabbitMQ counts *count* messages in the test's queue.

    ``apply_async`` returns before RabbitMQ has queued what it sent (no
    publisher confirms), and adopt reads what the queue counts when it starts.
    """
    with Connection(rabbitmq.url) as connection:
        bound = Queue(rabbitmq.queue).bind(connection.default_channel)
        wait_for(
            lambda: bound.queue_declare(passive=True).message_count >= count,
            timeout=60,
            message=f"{count} messages queued in {rabbitmq.queue}",
        )


def _eta() -> datetime:
    return datetime.now(timezone.utc) + timedelta(seconds=AHEAD_S)


@pytest.mark.parametrize(
    ("options", "key"),
    [
        pytest.param({}, "celery", id="plain"),
        pytest.param({"kwargs": {"a": [1, {"b": None}]}}, "celery", id="kwargs"),
        pytest.param({"priority": 5}, f"celery{PRIORITY_SEP}3", id="priority"),
        pytest.param({"queue": "orders"}, "orders", id="queue"),
        pytest.param({"headers": {"x_custom": "v", "trace": [1, 2]}}, "celery", id="headers"),
        pytest.param({"serializer": "msgpack"}, "celery", id="msgpack"),
        pytest.param({"serializer": "pickle"}, "celery", id="pickle"),
        pytest.param({"compression": "gzip"}, "celery", id="gzip"),
        pytest.param({"retries": 2, "expires": 3600}, "celery", id="retries-expires"),
    ],
)
def test_redis_the_released_message_is_the_one_celery_sent_but_for_its_eta(
    app: Celery, redis_client: redis.Redis, options: dict[str, Any], key: str
) -> None:
    # Given an ETA task sent the native way, as it waits in the broker's list
    kwargs = options.pop("kwargs", None)
    app.tasks["tests.record"].apply_async((42, "x"), kwargs=kwargs, eta=_eta(), **options)
    native = json.loads(redis_client.lindex(key, 0))

    # When it is adopted, and released when due
    report = _adopt(app, options.get("queue", "celery"))
    assert report["adopted"] == 1
    _release_into(app, lambda: redis_client.llen(key))

    # Then the message released is Celery's, byte for byte, but its eta: the
    # eta header is cleared (the worker runs it at once) and zdelay_eta
    # carries the string Celery wrote (the task sees it as request.eta)
    released = redis_client.lpop(key)
    assert json.loads(released)["headers"]["zdelay_eta"] == native["headers"]["eta"]
    native["headers"]["eta"] = None
    assert_same_message(released, native)


@pytest.mark.parametrize("serializer", ["json", "msgpack", "pickle"])
def test_rabbitmq_the_released_message_is_the_one_celery_sent_but_for_its_eta(
    make_test_app: AppFactory, rabbitmq: RabbitMQ, serializer: str
) -> None:
    app = make_test_app(
        broker=rabbitmq.url,
        conf={"task_default_queue": rabbitmq.queue, "task_serializer": serializer},
    )
    record = app.tasks["tests.record"]
    expires = datetime.now(timezone.utc) + timedelta(hours=1)
    call = {"task_id": str(uuid.uuid4()), "eta": _eta(), "priority": 3, "expires": expires}
    call["headers"] = {"x_custom": "v"}
    # Given the same ETA task sent twice the native way: one to compare with, one to adopt
    record.apply_async((1, "a"), **call)
    native = raw_amqp(rabbitmq.url, rabbitmq.queue)
    record.apply_async((1, "a"), **call)
    _queued(rabbitmq, 1)

    # When it is adopted, and released when due
    assert _adopt(app, rabbitmq.queue)["adopted"] == 1
    with Connection(rabbitmq.url) as connection:
        bound = Queue(rabbitmq.queue).bind(connection.default_channel)
        _release_into(app, lambda: bound.queue_declare(passive=True).message_count)
    parked = raw_amqp(rabbitmq.url, rabbitmq.queue)

    # Then RabbitMQ holds Celery's message, but for its eta
    assert parked["headers"].pop("zdelay_eta") == native["headers"]["eta"]
    assert parked["headers"].pop("eta") is None
    native["headers"].pop("eta")
    assert parked == native


def test_redis_a_dry_run_changes_nothing_and_keeps_the_order(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given tasks of every kind waiting in a queue
    record = app.tasks["tests.record"]
    sent = [
        record.apply_async(("ahead",), eta=_eta() + timedelta(hours=1)).id,
        record.apply_async(("now",)).id,
        record.apply_async(("passed",), countdown=-60).id,
        record.apply_async(("later",), eta=_eta() + timedelta(hours=2)).id,
    ]
    before = redis_client.lrange("celery", 0, -1)

    # When adopt counts them
    report = _adopt(app, "celery", "--dry-run")

    # Then it says what it would do
    assert (report["read"], report["adopted"], report["adopted_before"]) == (4, 2, 0)
    assert report["put_back"] == {"eta_passed": 1, "no_eta": 1}
    # and nothing changed: the store holds nothing, the queue the same
    # messages in the same order (kombu marks a message it gave back redelivered)
    assert redis_client.exists(SHARD0.due, SHARD0.msg, SHARD0.adopted) == 0
    after = redis_client.lrange("celery", 0, -1)
    assert [_unmarked(raw) for raw in after] == [json.loads(raw) for raw in before]
    assert [json.loads(raw)["headers"]["id"] for raw in reversed(after)] == sent


def _unmarked(raw: bytes) -> dict[str, Any]:
    message = json.loads(raw)
    assert message["headers"].pop("redelivered") is True
    assert message["properties"]["delivery_info"].pop("redelivered") is True
    return dict(message)


def test_rabbitmq_a_dry_run_changes_nothing_and_keeps_the_order(
    make_test_app: AppFactory, rabbitmq: RabbitMQ, redis_client: redis.Redis
) -> None:
    app = make_test_app(broker=rabbitmq.url, conf={"task_default_queue": rabbitmq.queue})
    record = app.tasks["tests.record"]
    sent = [
        record.apply_async((n,), eta=_eta() + timedelta(hours=1)).id
        if n % 2
        else record.apply_async((n,)).id
        for n in range(6)
    ]
    _queued(rabbitmq, 6)

    report = _adopt(app, rabbitmq.queue, "--dry-run")

    assert (report["read"], report["adopted"], report["put_back"]) == (6, 3, {"no_eta": 3})
    assert redis_client.exists(SHARD0.due, SHARD0.msg, SHARD0.adopted) == 0
    got = [raw_amqp(rabbitmq.url, rabbitmq.queue)["headers"]["id"] for _ in sent]
    assert got == sent


def test_an_unknown_queue_is_refused_before_anything_is_taken(
    app: Celery, redis_client: redis.Redis
) -> None:
    app.tasks["tests.record"].apply_async((1,), eta=_eta())

    result = run(app, "adopt", "--queue", "celery", "--queue", "no-such-queue")

    assert result.exit_code == EXIT_USAGE
    assert "No queue named 'no-such-queue'" in result.stderr
    assert "its queues: celery" in result.stderr
    assert redis_client.llen("celery") == 1
    assert redis_client.exists(SHARD0.due) == 0


def test_a_store_not_configured_is_the_usual_error_and_nothing_is_taken(
    make_test_app: AppFactory, rabbitmq: RabbitMQ
) -> None:
    # Given a RabbitMQ app with no zdelay_redis_url, and an ETA task waiting
    app = make_test_app(
        broker=rabbitmq.url,
        conf={"task_default_queue": rabbitmq.queue, "zdelay_redis_url": None},
    )
    app.tasks["tests.record"].apply_async((1,), eta=_eta())

    result = run(app, "adopt", "--queue", rabbitmq.queue)

    assert result.exit_code == EXIT_CONFIG
    assert "zdelay_redis_url" in result.stderr
    assert raw_amqp(rabbitmq.url, rabbitmq.queue)["routing_key"] == rabbitmq.queue


def test_the_table_says_what_was_adopted_and_why_the_rest_went_back(
    app: Celery, redis_client: redis.Redis
) -> None:
    record = app.tasks["tests.record"]
    record.apply_async((1,), eta=_eta() + timedelta(hours=1))
    record.apply_async((2,))

    result = run(app, "adopt", "--queue", "celery", "--force")

    assert result.exit_code == EXIT_OK, result.output
    lines = result.stdout.splitlines()
    assert lines[1].split() == [
        "QUEUE",
        "WAITING",
        "READ",
        "ADOPTED",
        "ADOPTED",
        "BEFORE",
        "PUT",
        "BACK",
        "LATEST",
        "ETA",
    ]
    assert lines[2].split()[:6] == ["celery", "2", "2", "1", "0", "1"]
    assert "in 1h" in lines[2]
    assert "no eta (runs at once)" in result.stdout
    assert "No celery-zdelay companion is running" in result.stderr


def test_a_message_kombu_cannot_decompress_goes_back_as_it_was(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given a task message whose headers name a compression its body lacks
    headers = {"task": "tests.record", "id": str(uuid.uuid4()), "compression": "gzip"}
    headers["eta"] = _eta().isoformat()
    with app.producer_or_acquire() as producer:
        producer.publish(b"not gzip", exchange="", routing_key="celery", headers=headers)
    before = json.loads(redis_client.lindex("celery", 0))

    report = _adopt(app, "celery")

    assert (report["adopted"], report["put_back"]) == (0, {"undecodable": 1})
    assert _unmarked(redis_client.lindex("celery", 0)) == before
    assert redis_client.exists(SHARD0.due) == 0


def test_rabbitmq_a_run_right_after_a_dry_run_reads_every_message_it_gave_back(
    make_test_app: AppFactory, rabbitmq: RabbitMQ
) -> None:
    # Given thousands of ETA tasks counted by a dry run (RabbitMQ takes back
    # what it was given back in its own time: seconds for thousands)
    app = make_test_app(broker=rabbitmq.url, conf={"task_default_queue": rabbitmq.queue})
    record = app.tasks["tests.record"]
    with app.producer_or_acquire() as producer:
        for n in range(MANY):
            record.apply_async((n,), eta=_eta() + timedelta(hours=1), producer=producer)
    _queued(rabbitmq, MANY)
    assert _adopt(app, rabbitmq.queue, "--dry-run")["adopted"] == MANY

    # When adopt runs right after it
    report = _adopt(app, rabbitmq.queue)

    # Then it counts and adopts every one: the dry run returned once they were back
    # (breaks if the dry run does not wait for the broker to count them again)
    assert (report["waiting"], report["adopted"]) == (MANY, MANY)
