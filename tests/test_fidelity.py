"""Fidelity: the released message is the one Celery itself would have sent.

Each test sends a call natively with ``apply_async`` and parks the same call
(same task id) with ``apply_delayed``, releases it, and compares the two
messages as they sit in the broker: only the delivery tag may differ. What
is compared, exactly, is in :mod:`tests.support.fidelity`: the body byte for
byte, the envelope as the same JSON document with its keys in the same
order. Comparing parsed dicts would miss, in ``entry._envelope``::

    "headers": message.headers,  ->  "headers": dict(sorted(message.headers.items())),
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis
from celery import Celery, chain, chord, group
from kombu import Connection, Queue
from kombu.serialization import register, unregister

import celery_zdelay
from celery_zdelay.companion import Companion
from tests.conftest import AppFactory, RabbitMQ
from tests.helpers import Runs, wait_for
from tests.support.fidelity import PRIORITY_SEP, assert_same_message, raw_amqp
from tests.support.keys import SHARD0

pytestmark = pytest.mark.timeout(60)


def _pop_raw(client: redis.Redis, key: str) -> bytes:
    raw = client.rpop(key)
    assert raw is not None, f"no message in {key!r}; lists: {client.keys('*')}"
    return bytes(raw)


def _release(app: Celery) -> None:
    with Companion(app) as companion:
        report = companion.release_due()
    assert not report.failed


def _native_and_parked(
    app: Celery, client: redis.Redis, key: str, task: str, args: Any, **options: Any
) -> tuple[bytes, bytes]:
    task_id = str(uuid.uuid4())
    app.tasks[task].apply_async(args, task_id=task_id, **options)
    native = _pop_raw(client, key)
    app.tasks[task].apply_delayed(args, task_id=task_id, countdown=0, **options)
    _release(app)
    parked = _pop_raw(client, key)
    return native, parked


@pytest.mark.parametrize(
    ("options", "key"),
    [
        pytest.param({}, "celery", id="plain"),
        pytest.param({"kwargs": {"a": [1, {"b": None}]}}, "celery", id="kwargs"),
        pytest.param({"priority": 5}, f"celery{PRIORITY_SEP}3", id="priority"),
        pytest.param({"priority": 9}, f"celery{PRIORITY_SEP}9", id="priority-max"),
        pytest.param({"queue": "orders"}, "orders", id="queue"),
        pytest.param({"headers": {"x_custom": "v", "trace": [1, 2]}}, "celery", id="headers"),
        pytest.param({"serializer": "msgpack"}, "celery", id="msgpack"),
        pytest.param({"serializer": "pickle"}, "celery", id="pickle"),
        pytest.param({"compression": "gzip"}, "celery", id="gzip"),
        pytest.param({"shadow": "shown-as", "ignore_result": True}, "celery", id="shadow"),
        pytest.param({"time_limit": 30, "soft_time_limit": 20}, "celery", id="time-limits"),
        pytest.param(
            {"expires": datetime(2100, 1, 1, tzinfo=timezone.utc)}, "celery", id="expires-datetime"
        ),
        pytest.param({"retries": 2}, "celery", id="retries"),
    ],
)
def test_the_released_message_equals_the_native_one(
    app: Celery, redis_client: redis.Redis, options: dict[str, Any], key: str
) -> None:
    kwargs = options.pop("kwargs", None)
    native, parked = _native_and_parked(
        app, redis_client, key, "tests.record", (42, "x"), kwargs=kwargs, **options
    )
    assert_same_message(parked, native)
    assert json.loads(parked)["headers"]["eta"] is None


def test_a_serializer_the_app_registered_travels_untouched(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given a serializer of the app's own, unknown to celery-zdelay
    register(
        "zdelay-test-hex",
        lambda obj: json.dumps(obj).encode().hex(),
        lambda data: json.loads(bytes.fromhex(data)),
        content_type="application/x-zdelay-test-hex",
        content_encoding="utf-8",
    )
    try:
        # When a call serialized with it is sent natively and parked, then released
        native, parked = _native_and_parked(
            app, redis_client, "celery", "tests.record", (42, "x"), serializer="zdelay-test-hex"
        )
    finally:
        unregister("zdelay-test-hex")

    # Then the released message is the native one, body still in that format
    assert json.loads(parked)["content-type"] == "application/x-zdelay-test-hex"
    assert_same_message(parked, native)


def test_links_and_errbacks_travel_in_the_body(app: Celery, redis_client: redis.Redis) -> None:
    native, parked = _native_and_parked(
        app,
        redis_client,
        "celery",
        "tests.add",
        (1, 2),
        link=app.tasks["tests.mul"].s(10),
        link_error=app.tasks["tests.on_error"].s(),
    )
    assert_same_message(parked, native)


def test_stamps_travel_in_the_headers(app: Celery, redis_client: redis.Redis) -> None:
    # Given a stamped signature, sent natively and parked under the same id
    stamped = app.tasks["tests.record"].s(1)
    stamped.stamp(audit="v1")
    task_id = str(uuid.uuid4())
    stamped.apply_async(task_id=task_id)
    native = _pop_raw(redis_client, "celery")
    celery_zdelay.apply_delayed(stamped, countdown=0, task_id=task_id)

    # When it is released
    _release(app)

    # Then the released message carries the same stamps, and is otherwise the same
    parked = _pop_raw(redis_client, "celery")
    headers = json.loads(parked)["headers"]
    assert headers["stamps"] == {"audit": "v1"}
    assert headers["stamped_headers"] == ["audit"]
    assert_same_message(parked, native)


def test_task_routes_choose_the_queue(make_test_app: AppFactory, redis_client: redis.Redis) -> None:
    app = make_test_app(conf={"task_routes": {"tests.record": {"queue": "routed"}}})
    native, parked = _native_and_parked(app, redis_client, "routed", "tests.record", (1,))
    assert_same_message(parked, native)
    assert json.loads(parked)["properties"]["delivery_info"]["routing_key"] == "routed"


def test_a_relative_expiry_stays_absolute(app: Celery, redis_client: redis.Redis) -> None:
    # Given a task parked with expires=120 (seconds from the call, as Celery reads it)
    before = datetime.now(timezone.utc)
    app.tasks["tests.record"].apply_delayed((1,), countdown=0, expires=120)
    after = datetime.now(timezone.utc)

    # When it is released two seconds later
    wait_for(
        lambda: datetime.now(timezone.utc) > after + timedelta(seconds=2),
        message="two seconds to pass",
    )
    _release(app)

    # Then it expires 120 s after the call, not 120 s after the release
    parked = json.loads(_pop_raw(redis_client, "celery"))
    expires = datetime.fromisoformat(parked["headers"]["expires"])
    assert before + timedelta(seconds=120) <= expires <= after + timedelta(seconds=120)


@pytest.mark.parametrize("shape", ["chain", "group", "chord", "chain of a group"])
def test_a_canvas_is_parked_whole_and_runs_on_a_worker(
    app: Celery, redis_client: redis.Redis, worker, companion, runs: Runs, shape: str
) -> None:
    import celery_zdelay

    add, mul, tsum = app.tasks["tests.add"], app.tasks["tests.mul"], app.tasks["tests.tsum"]
    canvases = {
        # (signature, messages published first, result)
        "chain": (chain(add.s(1, 2), mul.s(10)), 1, 30),
        "group": (group(add.s(i, i) for i in range(5)), 5, [0, 2, 4, 6, 8]),
        "chord": (chord((add.s(i, 1) for i in range(4)), tsum.s()), 4, 1 + 2 + 3 + 4),
        "chain of a group": (chain(group(add.s(1, 1), add.s(2, 2)), tsum.s()), 2, 6),
    }
    sig, first_messages, expected = canvases[shape]

    result = celery_zdelay.apply_delayed(sig, countdown=0.5)

    # Nothing reaches the broker before the companion releases it (Celery's
    # chain and chord do not pass producer= on; the capture must not care).
    assert redis_client.llen("celery") == 0
    assert redis_client.zcard(SHARD0.due) == first_messages
    worker(app)
    companion(app)
    assert result.get(timeout=30) == expected
    assert all(run["message_eta"] is None for run in runs.all())
    assert runs.duplicates() == {}


def test_link_error_runs_when_the_parked_task_fails(
    app: Celery, worker, companion, runs: Runs
) -> None:
    worker(app)
    companion(app)
    result = app.tasks["tests.fail"].apply_delayed(
        countdown=0.1, link_error=app.tasks["tests.on_error"].s()
    )
    runs.wait_for_count(2)
    assert {run["task"] for run in runs.all()} == {"tests.fail", "tests.on_error"}
    assert runs.by_id()[result.id]["result"] == "failed"


def test_the_worker_sees_the_same_id_and_headers_and_holds_no_eta(
    app: Celery, worker, companion, runs: Runs
) -> None:
    worker(app)
    companion(app)
    result = app.tasks["tests.record"].apply_delayed(
        (7,), countdown=0.2, headers={"x_custom": "kept"}, priority=4
    )
    (run,) = runs.wait_for_count(1)
    assert run["id"] == result.id
    assert run["root_id"] == result.id
    assert run["message_eta"] is None
    assert run["custom"] == "kept"
    assert run["priority"] == 4


@pytest.mark.parametrize("serializer", ["json", "msgpack", "pickle"])
def test_rabbitmq_receives_the_native_message(
    make_test_app: AppFactory, rabbitmq: RabbitMQ, serializer: str
) -> None:
    app = make_test_app(
        broker=rabbitmq.url,
        conf={"task_default_queue": rabbitmq.queue, "task_serializer": serializer},
    )
    record = app.tasks["tests.record"]
    task_id = str(uuid.uuid4())
    options = {"priority": 3, "headers": {"x_custom": "v"}, "expires": 3600}

    # Given the same call sent natively and parked (each "expires" counted from its own call)
    record.apply_async((1, "a"), task_id=task_id, **options)
    native = raw_amqp(rabbitmq.url, rabbitmq.queue)
    before = datetime.now(timezone.utc)
    record.apply_delayed((1, "a"), task_id=task_id, countdown=0, **options)
    after = datetime.now(timezone.utc)

    # When the companion releases the parked one
    _release(app)
    parked = raw_amqp(rabbitmq.url, rabbitmq.queue)

    # Then RabbitMQ holds the same message, expiring 3600 s after the parking call
    native["headers"].pop("expires")
    assert isinstance(parked["headers"].pop("zdelay_eta"), str)
    parked_expires = datetime.fromisoformat(parked["headers"].pop("expires"))
    assert before + timedelta(seconds=3600) <= parked_expires <= after + timedelta(seconds=3600)
    assert parked == native


def test_rabbitmq_gets_the_ttl_left_at_release_not_at_parking(
    make_test_app: AppFactory, rabbitmq: RabbitMQ
) -> None:
    app = make_test_app(broker=rabbitmq.url, conf={"task_default_queue": rabbitmq.queue})
    # Given a task parked with expires=60
    app.tasks["tests.record"].apply_delayed((1,), countdown=0, expires=60)
    parked_at = datetime.now(timezone.utc)

    # When it is released more than two seconds later
    wait_for(
        lambda: datetime.now(timezone.utc) > parked_at + timedelta(seconds=2),
        message="two seconds to pass",
    )
    released_from = datetime.now(timezone.utc)
    _release(app)
    released_by = datetime.now(timezone.utc)

    # Then the AMQP expiration (a TTL counted from the publish) is what was
    # left of the absolute "expires" at the release, not the 60 s of the call
    with Connection(rabbitmq.url) as connection:
        bound = Queue(rabbitmq.queue).bind(connection.default_channel)
        message = wait_for(lambda: bound.get(no_ack=True), message="the released message")
        expires = datetime.fromisoformat(message.headers["expires"])
        ttl_ms = float(message.properties["expiration"])
    left_from_ms = (expires - released_from).total_seconds() * 1000
    left_by_ms = (expires - released_by).total_seconds() * 1000
    assert left_by_ms - 1 <= ttl_ms <= left_from_ms + 1
    assert ttl_ms < 58_000
