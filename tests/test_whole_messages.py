"""zdelay_whole_messages: messages parked exactly as the handoff pushes them.

Each entry is the message itself, delivery tag included, and names a route
record (destination list, transport layout, queues) in its tag. These tests
hold that form to every promise the default form keeps: the same message as
Celery's own, template reference counts that never touch another entry's
record, readers that understand it, and a clear refusal where it cannot go.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone
from typing import Any

import pytest
import redis
from celery import Celery

import celery_zdelay
from celery_zdelay import ConfigurationError
from celery_zdelay.companion import Companion
from celery_zdelay.parking import store_for
from celery_zdelay.web import queries
from tests.conftest import AppFactory, RabbitMQ
from tests.support.fidelity import PRIORITY_SEP, assert_same_message, raw_amqp

pytestmark = pytest.mark.timeout(60)

WHOLE = {"zdelay_whole_messages": True}


def _release(app: Celery) -> Any:
    with Companion(app) as companion:
        report = companion.release_due()
    assert not report.failed
    return report


def _stored(app: Celery, client: redis.Redis, task_id: str) -> bytes:
    payload = client.hget(store_for(app).keys(0).msg, task_id)
    assert isinstance(payload, bytes), f"{task_id} is not parked"
    return payload


@pytest.mark.parametrize(
    ("options", "key"),
    [
        pytest.param({}, "celery", id="plain"),
        pytest.param({"priority": 5}, f"celery{PRIORITY_SEP}3", id="priority"),
        pytest.param({"queue": "orders"}, "orders", id="queue"),
        pytest.param({"headers": {"t": "0123456789abcdef", "x": [1]}}, "celery", id="header-t"),
        pytest.param({"serializer": "msgpack"}, "celery", id="msgpack"),
        pytest.param({"compression": "gzip"}, "celery", id="gzip"),
        pytest.param(
            {"expires": datetime(2100, 1, 1, tzinfo=timezone.utc), "shadow": "shown-as"},
            "celery",
            id="expires",
        ),
    ],
)
def test_the_stored_message_is_pushed_byte_for_byte_and_equals_the_native_one(
    make_test_app: AppFactory, redis_client: redis.Redis, options: dict[str, Any], key: str
) -> None:
    app = make_test_app(conf=WHOLE)
    record = app.tasks["tests.record"]
    task_id = str(uuid.uuid4())
    # Given the same call sent natively and parked whole
    record.apply_async((42, "x"), task_id=task_id, **options)
    native = redis_client.rpop(key)
    record.apply_delayed((42, "x"), task_id=task_id, countdown=0, **options)
    stored = _stored(app, redis_client, task_id)
    assert stored.startswith(b'{"body":"')

    # When the companion releases it
    report = _release(app)

    # Then the handoff pushed the stored bytes as they are: Celery's message
    assert report.handed_off == 1
    pushed = redis_client.rpop(key)
    assert pushed == stored
    assert_same_message(pushed, native)


def test_both_forms_release_together_and_leave_no_record_behind(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    templated, whole = make_test_app(), make_test_app(conf=WHOLE)
    keys = store_for(templated).keys(0)
    # Given entries of both forms parked in one store, one of each cancelled
    ids = {
        app: [app.tasks["tests.record"].apply_delayed((n,), countdown=0).id for n in range(3)]
        for app in (templated, whole)
    }
    assert redis_client.hlen(keys.templates) > 0
    for app, parked in ids.items():
        assert celery_zdelay.cancel(parked[0], app=app)

    # When the companion releases the rest
    report = _release(templated)

    # Then the four are in the queue, and no template or route record is left
    assert report.handed_off == 4
    released = {json.loads(m)["headers"]["id"] for m in redis_client.lrange("celery", 0, -1)}
    assert released == {task_id for parked in ids.values() for task_id in parked[1:]}
    assert redis_client.hgetall(keys.templates) == {}


def test_a_header_that_looks_like_a_template_reference_leaves_that_template_alone(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    templated, whole = make_test_app(), make_test_app(conf=WHOLE)
    keys = store_for(templated).keys(0)
    # Given a templated entry, and a whole one whose headers carry '"t":"<its template id>"'
    kept = templated.tasks["tests.record"].apply_delayed((1,), countdown=0).id
    template = json.loads(_stored(templated, redis_client, kept).partition(b"\n")[0])["t"]
    lookalike = whole.tasks["tests.record"].apply_delayed(
        (2,), countdown=0, headers={"t": template}
    )
    assert f'"t":"{template}"'.encode() in _stored(whole, redis_client, lookalike.id)

    # When the whole entry is cancelled
    assert celery_zdelay.cancel(lookalike.id, app=whole)

    # Then the template keeps its record and count, and its entry is released
    assert redis_client.hget(keys.templates, f"#{template}") == b"1"
    assert _release(templated).handed_off == 1
    assert json.loads(redis_client.rpop("celery"))["headers"]["id"] == kept


def test_readers_understand_a_whole_entry(make_test_app: AppFactory) -> None:
    app = make_test_app(conf=WHOLE)
    # Given a task parked whole
    result = app.tasks["tests.record"].apply_delayed((7,), countdown=600, queue="orders")

    # When it is looked up and cancelled by task name
    parked = celery_zdelay.lookup(result.id, app=app)
    assert parked is not None
    cancelled = celery_zdelay.cancel_matching(task="tests.record", app=app)

    # Then the reader saw its headers and queue, and no parked-at time (none is stored)
    assert parked.state == "parked"
    assert parked.task == "tests.record"
    assert parked.queue == "orders"
    assert parked.parked_ms is None
    assert cancelled == 1


def test_a_whole_entry_without_its_route_record_is_dead_lettered_not_pushed(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = make_test_app(conf=WHOLE)
    keys = store_for(app).keys(0)
    # Given a whole entry whose route record someone deleted
    task_id = app.tasks["tests.record"].apply_delayed((1,), countdown=0).id
    redis_client.delete(keys.templates)

    # When the companion releases
    report = _release(app)

    # Then nothing reached the queue, and the dead letter says why
    assert report.dead_lettered == 1
    assert redis_client.llen("celery") == 0
    dead = celery_zdelay.lookup(task_id, app=app)
    assert dead is not None
    assert dead.state == "dead"
    assert "route record" in (dead.reason or "")


def test_rabbitmq_receives_the_native_message_from_a_whole_entry(
    make_test_app: AppFactory, rabbitmq: RabbitMQ
) -> None:
    app = make_test_app(broker=rabbitmq.url, conf={**WHOLE, "task_default_queue": rabbitmq.queue})
    record = app.tasks["tests.record"]
    task_id = str(uuid.uuid4())
    # Given the same call sent natively and parked whole (no expiry: it is counted per call)
    record.apply_async((1, "a"), task_id=task_id, priority=3, headers={"x_custom": "v"})
    native = raw_amqp(rabbitmq.url, rabbitmq.queue)
    record.apply_delayed(
        (1, "a"), task_id=task_id, countdown=0, priority=3, headers={"x_custom": "v"}
    )

    # When the companion publishes it (no handoff: the broker is not Redis)
    report = _release(app)

    # Then RabbitMQ holds Celery's own message
    assert report.published == 1
    parked = raw_amqp(rabbitmq.url, rabbitmq.queue)
    # The ETA Celery would have sent travels here (tests/test_request_eta.py).
    assert isinstance(parked["headers"].pop("zdelay_eta"), str)
    assert parked == native


@pytest.mark.parametrize(
    ("conf", "says"),
    [
        pytest.param(
            {**WHOLE, "zdelay_signing_key": "a-key-of-sixteen-bytes-or-more"},
            "cannot be combined with zdelay_signing_key",
            id="with-signing",
        ),
        pytest.param({"zdelay_whole_messages": "yes"}, "zdelay_whole_messages", id="not-a-flag"),
    ],
)
def test_a_setting_it_cannot_honour_is_refused_before_anything_is_parked(
    make_test_app: AppFactory, redis_client: redis.Redis, conf: dict[str, Any], says: str
) -> None:
    app = make_test_app(conf=conf)
    with pytest.raises(ConfigurationError, match=says):
        app.tasks["tests.record"].apply_delayed((1,), countdown=60)
    assert redis_client.keys("*zdelay*") == []


def test_the_dashboard_filter_reads_a_template_reference_only_from_a_metadata_line(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    templated, whole = make_test_app(), make_test_app(conf=WHOLE)
    store = store_for(templated)
    # Given a templated tests.record entry, and before it in due order a whole
    # tests.add entry whose headers carry '"t":"<the record entry's template id>"'
    kept = templated.tasks["tests.record"].apply_delayed((1,), countdown=600).id
    template = json.loads(_stored(templated, redis_client, kept).partition(b"\n")[0])["t"]
    whole.tasks["tests.add"].apply_delayed((1, 2), countdown=300, headers={"t": template})

    # When the dashboard lists tests.record entries
    page = queries.parked_page(store, queries.Filters(task="tests.record"))

    # Then the header did not teach it that template's task name: the entry is listed
    assert [entry.task_id for entry in page.entries] == [kept]
