"""The entry format handoff.lua reads fast (values each ending in a NUL) and
the one earlier releases parked (values only separated): both are released,
as the same message."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis

from celery_zdelay.companion import Companion
from celery_zdelay.parking import store_for
from celery_zdelay.store.admin import purge_dead, requeue_dead
from tests.conftest import AppFactory
from tests.support.keys import SHARD0

pytestmark = pytest.mark.timeout(90)

MSG = SHARD0.msg
TEMPLATES = SHARD0.templates


def _templates(client: redis.Redis) -> int:
    """Return how many templates the shard holds (not their counts, "#<id>")."""
    return sum(not key.startswith(b"#") for key in client.hkeys(TEMPLATES))


def _as_earlier_release(payload: bytes) -> bytes:
    meta, _, blob = payload.partition(b"\n")
    assert blob.endswith(b"\x00")
    old = blob[:-1]
    fields = json.loads(meta)
    fields["n"] = len(old)
    return json.dumps(fields, separators=(",", ":")).encode() + b"\n" + old


@pytest.mark.parametrize("broker_db", [None, 3], ids=["handoff", "generic"])
def test_entries_parked_by_an_earlier_release_are_released_as_the_same_message(
    make_test_app: AppFactory, redis_client: redis.Redis, redis_server, broker_db: int | None
) -> None:
    broker = None if broker_db is None else f"{redis_server.url}/{broker_db}"
    app = make_test_app(broker=broker)
    record = app.tasks["tests.record"]
    new = record.apply_delayed(("same",), countdown=0, task_id="entry-new")
    old = record.apply_delayed(("same",), countdown=0, task_id="entry-old")
    payload = redis_client.hget(MSG, old.id)
    assert payload is not None
    redis_client.hset(MSG, old.id, _as_earlier_release(payload))

    with Companion(app) as companion:
        # Both are moved inside handoff.lua, not leased and pushed afterwards.
        pushes: list[Any] = []
        real_push = companion.store.push

        def counting_push(*args: Any, **kwargs: Any) -> Any:
            pushes.append(args)
            return real_push(*args, **kwargs)

        companion.store.push = counting_push  # type: ignore[method-assign]
        report = companion.release_due()
        del companion.store.push  # no reference cycle left holding a connection

    assert pushes == []
    assert report.released == 2
    assert report.dead_lettered == 0
    queue = redis_client if broker_db is None else redis_server.client(broker_db)
    try:
        raws = queue.lrange("celery", 0, -1)
    finally:
        if queue is not redis_client:
            queue.close()
    messages = {}
    for raw in raws:
        message = json.loads(raw)
        messages[message["headers"]["id"]] = message
    assert set(messages) == {new.id, old.id}
    # Apart from the ids, tags and ETAs (each its own call's), the two messages are the same.
    first, second = (json.dumps(messages[i], sort_keys=True) for i in (new.id, old.id))
    for message in (messages[new.id], messages[old.id]):
        message["properties"].pop("delivery_tag")
        assert isinstance(message["headers"].pop("zdelay_eta"), str)
    normalized = {
        json.dumps(m, sort_keys=True).replace(i, "ID").replace(i.replace("-", ""), "ID")
        for i, m in messages.items()
    }
    assert len(normalized) == 1, (first, second)


def test_per_call_options_do_not_pile_up_templates(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given 200 calls of one task, each with its own shadow name and time
    # limits (options a call may set to any value),
    app = make_test_app()
    record = app.tasks["tests.record"]
    ids = [
        record.apply_delayed(
            (i,), countdown=0, shadow=f"report-{i}", time_limit=60 + i, soft_time_limit=30 + i
        ).id
        for i in range(200)
    ]

    # then they share one template: templates grow with the kinds of
    # messages parked, not with the history of calls,
    assert _templates(redis_client) == 1

    # and each message is released with its own options.
    with Companion(app) as companion:
        assert companion.release_due().handed_off == 200
    released = {
        m["headers"]["id"]: m["headers"]
        for m in (json.loads(raw) for raw in redis_client.lrange("celery", 0, -1))
    }
    for i, task_id in enumerate(ids):
        assert released[task_id]["shadow"] == f"report-{i}"
        assert released[task_id]["timelimit"] == [60 + i, 30 + i]


def _distinct_kinds(app: Any, n: int, **options: Any) -> list[str]:
    """Park *n* calls that each need their own template (a header name of their own)."""
    record = app.tasks["tests.record"]
    return [
        record.apply_delayed((i,), countdown=0, headers={f"x-kind-{i}": i}, **options).id
        for i in range(n)
    ]


@pytest.mark.parametrize("path", ["handoff", "signed", "generic"])
def test_templates_are_deleted_when_no_parked_entry_refers_to_them(
    make_test_app: AppFactory, redis_client: redis.Redis, redis_server: Any, path: str
) -> None:
    # Given 30 kinds of message parked (30 templates) and 3 more entries of
    # the first kind,
    conf = {"zdelay_signing_key": "k" * 32} if path == "signed" else {}
    broker = f"{redis_server.url}/3" if path == "generic" else None
    app = make_test_app(broker=broker, conf=conf)
    ids = _distinct_kinds(app, 30)
    record = app.tasks["tests.record"]
    ids += [record.apply_delayed((i,), countdown=60, headers={"x-kind-0": 0}).id for i in range(3)]
    assert _templates(redis_client) == 30

    # when the 30 due ones are released (handoff, verified push or kombu),
    with Companion(app) as companion:
        assert companion.release_due().released == 30

    # then only the template the 3 waiting entries use is left,
    assert _templates(redis_client) == 1
    # and none once they are cancelled.
    store = store_for(app)
    assert store.cancel(ids[30:]) == [True] * 3
    assert _templates(redis_client) == 0
    assert redis_client.hlen(TEMPLATES) == 0


def test_a_template_stays_while_a_parked_dead_or_replaced_entry_needs_it(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = make_test_app()
    record = app.tasks["tests.record"]
    # Parking an id again under another kind of message drops the first template.
    record.apply_delayed((1,), countdown=60, task_id="again", headers={"x-first": 1})
    record.apply_delayed((1,), countdown=60, task_id="again", headers={"x-second": 1})
    assert _templates(redis_client) == 1
    redis_client.delete(SHARD0.due, MSG)
    redis_client.delete(TEMPLATES)

    # A dead-lettered entry keeps its template, so a requeue can release it.
    redis_client.set("orders", "not a list")
    dead = record.apply_delayed((2,), countdown=0, queue="orders").id
    with Companion(app) as companion:
        assert companion.release_due().dead_lettered == 1
        assert _templates(redis_client) == 1
        redis_client.delete("orders")
        assert requeue_dead(store_for(app), [dead]) == [True]
        assert companion.release_due().handed_off == 1
    assert _templates(redis_client) == 0


def test_a_template_without_a_count_is_kept_for_good(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Templates stored by earlier releases have no count: entries parked then
    # may still need them, so they are never deleted.
    app = make_test_app()
    _distinct_kinds(app, 1)
    (count_field,) = [k for k in redis_client.hkeys(TEMPLATES) if k.startswith(b"#")]
    redis_client.hdel(TEMPLATES, count_field)
    with Companion(app) as companion:
        assert companion.release_due().handed_off == 1
    assert _templates(redis_client) == 1


def test_purging_a_dead_letter_releases_its_template(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = make_test_app()
    redis_client.set("orders", "not a list")
    app.tasks["tests.record"].apply_delayed((2,), countdown=0, queue="orders")
    with Companion(app) as companion:
        assert companion.release_due().dead_lettered == 1
    assert _templates(redis_client) == 1
    assert purge_dead(store_for(app)) == 1
    assert redis_client.hlen(TEMPLATES) == 0
