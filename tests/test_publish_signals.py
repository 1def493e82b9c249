"""Celery's publish signals tell the truth about parked tasks.

``before_task_publish`` runs where Celery runs it, and what its receivers
change in the headers is what is parked. ``after_task_publish`` says "this
task was published": it is sent once per call that was parked, after it
was parked, and never for a call that was not (a refused park, a
``batch()`` block that raised, a store that cannot be reached).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from celery import Celery
from celery.signals import after_task_publish, before_task_publish

import celery_zdelay
from celery_zdelay.config import get_config
from celery_zdelay.entry import entry_headers
from celery_zdelay.errors import StoreRefusedError, StoreUnavailableError
from celery_zdelay.parking import store_for
from celery_zdelay.periodic.server import PeriodicServer
from celery_zdelay.store import Store
from celery_zdelay.testing import RedisServer, free_port
from tests.conftest import AppFactory
from tests.support.django import django_task_app
from tests.support.periodic import tend

pytestmark = pytest.mark.timeout(60)

#: The header the before_task_publish receiver adds, as tracing does.
TRACE = "x-trace"


@dataclass
class Heard:
    """What the signal receivers saw, in order."""

    #: Per after_task_publish: (task id, headers it carried, parked already?).
    after: list[tuple[str, dict[str, Any], bool]] = field(default_factory=list)
    #: Task ids before_task_publish saw.
    before: list[str] = field(default_factory=list)
    #: Where to look whether a task is parked when after_task_publish comes.
    store: Store | None = None

    def parked(self, task_id: str) -> bool:
        if self.store is None:
            return False
        keys = self.store.keys(self.store.shard_of(task_id))
        return self.store.client.zscore(keys.due, task_id) is not None


@pytest.fixture
def heard() -> Iterator[Heard]:
    """Receivers of both signals: one adds a trace header, both record what they saw."""
    found = Heard()

    def add_trace(headers: dict[str, Any], **_: Any) -> None:
        found.before.append(headers["id"])
        headers[TRACE] = f"trace-{headers['id']}"

    def record(headers: dict[str, Any], **_: Any) -> None:
        task_id = headers["id"]
        found.after.append((task_id, dict(headers), found.parked(task_id)))

    before_task_publish.connect(add_trace, weak=False)
    after_task_publish.connect(record, weak=False)
    try:
        yield found
    finally:
        before_task_publish.disconnect(add_trace)
        after_task_publish.disconnect(record)
        if found.store is not None:
            found.store.close()


def watch(heard: Heard, app: Celery) -> None:
    heard.store = Store(get_config(app))


def parked_ids(store: Store) -> set[str]:
    ids: set[str] = set()
    for shard in store.shards:
        ids.update(m.decode() for m in store.client.zrange(store.keys(shard).due, 0, -1))
    return ids


def test_a_park_sends_after_task_publish_once_per_call_after_it_parked_with_its_headers(
    app: Celery, heard: Heard
) -> None:
    # Given receivers of both signals, one of them adding a trace header
    watch(heard, app)
    record = app.tasks["tests.record"]

    # When one call and a bulk of 100 are parked
    one = record.apply_delayed((0,), countdown=600)
    many = record.apply_delayed_many([(i,) for i in range(100)], countdown=600)

    # Then after_task_publish came once per call, each when its task was already parked
    ids = [one.id, *(r.id for r in many)]
    assert [task_id for task_id, _, _ in heard.after] == ids
    assert all(was_parked for _, _, was_parked in heard.after)
    # And each carried the headers as parked: the trace header added before
    # publishing, and no eta (the companion releases it when due)
    store = heard.store
    assert store is not None
    for task_id, headers, _ in heard.after:
        shard = store.shard_of(task_id)
        payload = store.client.hget(store.keys(shard).msg, task_id)
        assert payload is not None
        stored = entry_headers(payload, store.templates(shard))
        assert headers[TRACE] == stored[TRACE] == f"trace-{task_id}"
        assert headers["eta"] is None


def test_a_bulk_with_one_call_too_large_for_the_store_sends_no_signal_and_parks_nothing(
    make_test_app: AppFactory, heard: Heard
) -> None:
    # Given a store that takes values of at most 1 MiB (proto-max-bulk-len)
    with RedisServer(**{"proto-max-bulk-len": "1mb"}) as small:
        app = make_test_app(conf={"zdelay_redis_url": f"{small.url}/0"})
        watch(heard, app)
        calls: list[tuple[Any, ...]] = [(i,) for i in range(100)]
        calls[57] = ("x" * (1024 * 1024 + 1),)

        # When 100 calls, one of them too large, are parked in bulk
        with pytest.raises(StoreRefusedError):
            app.tasks["tests.record"].apply_delayed_many(calls, countdown=600)

        # Then nothing is parked and no receiver heard "published"
        assert heard.store is not None
        assert parked_ids(heard.store) == set()
        assert heard.after == []
        # (before_task_publish ran for each, as Celery runs it)
        assert len(heard.before) == 100


def test_a_batch_block_that_raised_sends_no_signal(app: Celery, heard: Heard) -> None:
    # Given a batch() block that parks 3 calls and then raises
    watch(heard, app)
    record = app.tasks["tests.record"]

    def place_orders() -> None:
        with celery_zdelay.batch(app):
            for i in range(3):
                record.apply_delayed((i,), countdown=600)
            raise RuntimeError("the order was cancelled")

    with pytest.raises(RuntimeError, match="the order was cancelled"):
        place_orders()

    # Then nothing is parked, and no receiver heard of the 3 calls
    assert heard.store is not None
    assert parked_ids(heard.store) == set()
    assert heard.after == []

    # And a batch that exits normally announces each call once, after its park
    with celery_zdelay.batch(app):
        results = [record.apply_delayed((i,), countdown=600) for i in range(3)]
        assert heard.after == []
    assert [task_id for task_id, _, _ in heard.after] == [r.id for r in results]
    assert all(was_parked for _, _, was_parked in heard.after)


def test_a_store_that_cannot_be_reached_sends_no_signal(
    make_test_app: AppFactory, heard: Heard
) -> None:
    # Given a store URL nothing listens on, and no retries
    app = make_test_app(
        conf={
            "zdelay_redis_url": f"redis://127.0.0.1:{free_port()}/0",
            "zdelay_retry_policy": {"max_retries": 0},
        }
    )

    # When a call is parked
    with pytest.raises(StoreUnavailableError):
        app.tasks["tests.record"].apply_delayed((1,), countdown=600)

    # Then no receiver heard it was published
    assert heard.after == []
    assert len(heard.before) == 1


def test_transparent_mode_announces_a_parked_call_once_and_a_refused_one_never(
    make_test_app: AppFactory, redis_server: RedisServer, heard: Heard
) -> None:
    # Given transparent mode: every countdown is parked
    app = make_test_app(conf={"zdelay_threshold": 0})
    watch(heard, app)
    record = app.tasks["tests.record"]

    # When apply_async(countdown=) is called
    result = record.apply_async((1,), countdown=600)

    # Then it was parked, and announced once, after the park
    assert heard.after == [(result.id, heard.after[0][1], True)]
    assert heard.after[0][1][TRACE] == f"trace-{result.id}"

    # And when the store refuses the park (the due key holds another type)
    task_id = str(uuid.uuid4())
    assert heard.store is not None
    shard = heard.store.shard_of(task_id)
    heard.store.client.delete(heard.store.keys(shard).due)
    heard.store.client.set(heard.store.keys(shard).due, "not a zset")
    with pytest.raises(StoreRefusedError):
        record.apply_async((2,), countdown=600, task_id=task_id)

    # Then no receiver heard of that call
    assert [t for t, _, _ in heard.after] == [result.id]


def test_a_periodic_occurrence_served_by_two_companions_is_announced_once(
    make_test_app: AppFactory, heard: Heard
) -> None:
    # Given two companions serving one schedule
    schedule = {"nightly": {"task": "tests.record", "schedule": 1800.0, "args": [1]}}
    servers = []
    for name in ("a", "b"):
        app = make_test_app()
        app.conf.beat_schedule = schedule
        servers.append(PeriodicServer(app, store_for(app), companion_id=name))
    watch(heard, servers[0].app)
    assert servers[0].reconcile() == "done"
    assert servers[1].reconcile() in ("done", "same")

    # When both tend it (each builds the occurrence's message; one parks it)
    for server in (*servers, *servers):
        tend(server)

    # Then each occurrence parked was announced once, after its park
    assert heard.store is not None
    parked = {i for i in parked_ids(heard.store) if i.startswith("periodic:nightly:")}
    assert parked
    assert sorted(t for t, _, _ in heard.after) == sorted(parked)
    assert all(was_parked for _, _, was_parked in heard.after)


# -- apply_delayed_on_commit (Django) ----------------------------------------------


@pytest.fixture
def django_app(redis_server: RedisServer, django_db: None) -> Iterator[Celery]:
    """An app whose tasks are celery_zdelay.contrib.django.Task, on the test Redis."""
    with django_task_app(redis_server, "djangosignals") as app:
        yield app


def test_apply_delayed_on_commit_announces_at_commit_and_never_on_rollback(
    django_app: Celery, heard: Heard
) -> None:
    from django.db import transaction

    watch(heard, django_app)
    welcome = django_app.tasks["shop.welcome"]

    # When a transaction that parked on commit rolls back
    with transaction.atomic():
        welcome.apply_delayed_on_commit((1,), countdown=600)
        transaction.set_rollback(True)

    # Then no receiver heard of it, and nothing is parked
    assert heard.after == []
    assert heard.store is not None
    assert parked_ids(heard.store) == set()

    # And when one commits, the call is announced once, after its park
    with transaction.atomic():
        result = welcome.apply_delayed_on_commit((2,), countdown=600)
        assert heard.after == []
    assert heard.after == [(result.id, heard.after[0][1], True)]
