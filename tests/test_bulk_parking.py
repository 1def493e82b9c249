"""Bulk parking: ``task.apply_delayed_many`` parks what ``apply_async`` would send.

Given the same calls sent natively with ``apply_async`` and parked in bulk
(then released), each released message equals its native twin but for what
is per call by nature: the task id (``id``, ``root_id``, ``correlation_id``)
and the delivery tag.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone
from typing import Any

import pytest
import redis
from celery import Celery
from celery.signals import after_task_publish, before_task_publish
from kombu.exceptions import EncodeError

import celery_zdelay
from celery_zdelay.companion import Companion
from tests.conftest import AppFactory
from tests.helpers import Runs
from tests.support.fidelity import PRIORITY_SEP
from tests.support.keys import SHARD0

pytestmark = pytest.mark.timeout(60)

DUE_KEY = SHARD0.due


def _release(app: Celery) -> None:
    with Companion(app) as companion:
        report = companion.release_due()
    assert not report.failed


def _drain(client: redis.Redis, key: str) -> list[dict[str, Any]]:
    messages = []
    while (raw := client.rpop(key)) is not None:
        messages.append(json.loads(raw))
    return messages


def _without_ids(message: dict[str, Any]) -> dict[str, Any]:
    """The message with its per-call identity, ETA and delivery tag taken out."""
    message = json.loads(json.dumps(message))
    task_id = message["headers"].pop("id")
    # A parked message carries the ETA Celery would have sent (tests/test_request_eta.py).
    message["headers"].pop("zdelay_eta", None)
    assert message["headers"].pop("root_id") == task_id
    assert message["properties"].pop("correlation_id") == task_id
    assert message["properties"].pop("delivery_tag")
    ttl = message["properties"].pop("expiration", None)
    message["has_expiration"] = ttl is not None
    return message


def _by_args(messages: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {m["headers"]["argsrepr"] + m["headers"]["kwargsrepr"]: m for m in messages}


CALLS = [(1, "a"), (2, "b"), (3, "c")]


@pytest.mark.parametrize(
    ("options", "key"),
    [
        pytest.param({}, "celery", id="plain"),
        pytest.param({"queue": "orders"}, "orders", id="queue"),
        pytest.param({"priority": 5}, f"celery{PRIORITY_SEP}3", id="priority"),
        pytest.param({"headers": {"x_custom": "v", "trace": [1, 2]}}, "celery", id="headers"),
        pytest.param({"serializer": "json"}, "celery", id="json"),
        pytest.param({"serializer": "msgpack"}, "celery", id="msgpack"),
        pytest.param({"serializer": "pickle"}, "celery", id="pickle"),
        pytest.param({"compression": "gzip"}, "celery", id="gzip"),
        pytest.param({"shadow": "shown-as", "ignore_result": True}, "celery", id="shadow"),
        pytest.param({"time_limit": 30, "soft_time_limit": 20}, "celery", id="time-limits"),
        pytest.param(
            {"expires": datetime(2100, 1, 1, tzinfo=timezone.utc)}, "celery", id="expires"
        ),
        pytest.param({"link_error": "on_error", "link": "mul"}, "celery", id="links"),
    ],
)
def test_each_parked_message_equals_what_apply_async_sends(
    app: Celery, redis_client: redis.Redis, options: dict[str, Any], key: str
) -> None:
    if options.get("link"):
        options = {
            "link": app.tasks["tests.mul"].s(10),
            "link_error": app.tasks["tests.on_error"].s(),
        }
    record = app.tasks["tests.record"]
    for args in CALLS:
        record.apply_async(args, **options)
    native = _by_args(_drain(redis_client, key))

    results = record.apply_delayed_many(CALLS, countdown=0, **options)

    assert redis_client.llen(key) == 0
    assert redis_client.zcard(DUE_KEY) == len(CALLS)
    _release(app)
    parked = _by_args(_drain(redis_client, key))
    assert sorted(parked) == sorted(native)
    for args, parked_message in parked.items():
        assert parked_message["headers"]["eta"] is None
        assert isinstance(parked_message["headers"]["zdelay_eta"], str)
        assert _without_ids(parked_message) == _without_ids(native[args])
    assert {m["headers"]["id"] for m in parked.values()} == {r.id for r in results}
    assert len({r.id for r in results}) == len(CALLS)


def test_keyword_calls_and_routes_from_task_routes(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = make_test_app(conf={"task_routes": {"tests.add": {"queue": "routed"}}})
    add = app.tasks["tests.add"]
    add.apply_async(kwargs={"x": 1, "y": 2})
    add.apply_async((3, 4))
    native = _by_args(_drain(redis_client, "routed"))

    add.apply_delayed_many([{"x": 1, "y": 2}, (3, 4)], countdown=0)
    _release(app)

    parked = _by_args(_drain(redis_client, "routed"))
    assert sorted(parked) == sorted(native)
    assert len(parked) == 2
    for args, message in parked.items():
        assert _without_ids(message) == _without_ids(native[args])


def test_a_router_function_sees_each_calls_arguments(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    def by_parity(name: str, args: Any, kwargs: Any, options: Any, **kw: Any) -> Any:
        if name == "tests.add":
            return {"queue": "even" if args[0] % 2 == 0 else "odd"}
        return None

    app = make_test_app()
    app.conf.task_routes = (by_parity,)
    app.tasks["tests.add"].apply_delayed_many([(i, i) for i in range(6)], countdown=0)
    _release(app)
    assert redis_client.llen("even") == 3
    assert redis_client.llen("odd") == 3


def test_the_publish_signals_run_once_per_call(app: Celery, redis_client: redis.Redis) -> None:
    seen_before: list[str] = []
    seen_after: list[str] = []

    def add_trace(headers: dict[str, Any], **kwargs: Any) -> None:
        # What a tracing library does: a header of its own per message.
        seen_before.append(headers["id"])
        headers["x_trace"] = str(uuid.uuid4())

    def count_after(headers: dict[str, Any], **kwargs: Any) -> None:
        seen_after.append(headers["id"])

    before_task_publish.connect(add_trace, weak=False)
    after_task_publish.connect(count_after, weak=False)
    try:
        results = app.tasks["tests.record"].apply_delayed_many(
            [(i,) for i in range(50)], countdown=0
        )
    finally:
        before_task_publish.disconnect(add_trace)
        after_task_publish.disconnect(count_after)

    ids = [r.id for r in results]
    assert seen_before == ids
    assert seen_after == ids
    _release(app)
    traces = {m["headers"]["id"]: m["headers"]["x_trace"] for m in _drain(redis_client, "celery")}
    assert sorted(traces) == sorted(ids)
    assert len(set(traces.values())) == 50


def test_the_calls_run_on_a_worker(app: Celery, worker, companion, runs: Runs) -> None:
    worker(app)
    companion(app)
    results = app.tasks["tests.add"].apply_delayed_many([(i, 1) for i in range(20)], countdown=0.3)
    assert [r.get(timeout=30) for r in results] == [i + 1 for i in range(20)]
    assert all(run["message_eta"] is None for run in runs.all())
    assert runs.duplicates() == {}


def test_signed_entries_parked_in_bulk_are_released_whole(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = make_test_app(conf={"zdelay_signing_key": "bulk-signing-key-0123456789abcdef"})
    record = app.tasks["tests.record"]
    for args in CALLS:
        record.apply_async(args)
    native = _by_args(_drain(redis_client, "celery"))

    record.apply_delayed_many(CALLS, countdown=0)
    _release(app)

    parked = _by_args(_drain(redis_client, "celery"))
    assert sorted(parked) == sorted(native)
    for args, message in parked.items():
        assert _without_ids(message) == _without_ids(native[args])


def test_the_calls_are_released_in_the_order_given(app: Celery, redis_client: redis.Redis) -> None:
    results = app.tasks["tests.record"].apply_delayed_many([(i,) for i in range(300)], countdown=0)
    _release(app)
    released = [m["headers"]["id"] for m in _drain(redis_client, "celery")]
    assert released == [r.id for r in results]


def test_nothing_is_parked_when_one_call_cannot_be_serialized(
    app: Celery, redis_client: redis.Redis
) -> None:
    with pytest.raises(EncodeError):
        app.tasks["tests.record"].apply_delayed_many([(1,), (object(),), (3,)], countdown=60)
    assert redis_client.zcard(DUE_KEY) == 0


def test_inside_a_batch_the_calls_join_it(app: Celery, redis_client: redis.Redis) -> None:
    record = app.tasks["tests.record"]
    with celery_zdelay.batch(app):
        record.apply_delayed_many([(1,), (2,)], countdown=60)
        record.apply_delayed((3,), countdown=60)
        assert redis_client.zcard(DUE_KEY) == 0
    assert redis_client.zcard(DUE_KEY) == 3


def test_an_empty_list_parks_nothing(app: Celery, redis_client: redis.Redis) -> None:
    assert app.tasks["tests.record"].apply_delayed_many([], countdown=60) == []
    assert redis_client.zcard(DUE_KEY) == 0


@pytest.mark.parametrize(
    ("calls", "options", "message"),
    [
        pytest.param([(1,)], {"task_id": "x"}, "task_id", id="task-id"),
        pytest.param([1, 2], {}, "tuple of positional arguments", id="bare-value"),
        pytest.param([(1,)], {"producer": object()}, "producer=", id="producer"),
    ],
)
def test_misuse_says_the_fix(
    app: Celery,
    redis_client: redis.Redis,
    calls: list[Any],
    options: dict[str, Any],
    message: str,
) -> None:
    with pytest.raises(celery_zdelay.ConfigurationError, match=message):
        app.tasks["tests.record"].apply_delayed_many(calls, countdown=60, **options)
    assert redis_client.zcard(DUE_KEY) == 0


def test_under_eager_each_call_runs_now(make_test_app: AppFactory, runs: Runs) -> None:
    app = make_test_app(conf={"task_always_eager": True})
    results = app.tasks["tests.add"].apply_delayed_many([(1, 2), (3, 4)], countdown=60)
    assert [r.get() for r in results] == [3, 7]
