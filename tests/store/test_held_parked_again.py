"""A task held back by a pause or a rate limit, parked again under its id, is one task.

Parking the same id again replaces it (DESIGN §5), wherever the earlier
entry waits. A held entry waits in its control's held set (``hold.lua``),
not in the due set: a new park of its id takes it out of there in the same
script, so the id is in one place afterwards and is released once, with the
new message. These tests pin that for every path that parks a plain entry
(``park.lua`` alone, one call or a batch over several shards in one
transaction, a tagged park through ``park_keyed.lua``, a periodic occurrence
through ``park_once.lua``), on a real Redis with in-process companion passes
(no worker: what reaches the ``emails`` broker list is what runs).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis
from celery import Celery

import celery_zdelay
from celery_zdelay.companion import Companion
from celery_zdelay.parking import store_for
from celery_zdelay.periodic.store import PeriodicStore
from celery_zdelay.schedule import Due
from celery_zdelay.store import ParkRequest, Store, admin
from tests.conftest import AppFactory
from tests.support.keys import keys_of
from tests.support.store import held_sets, release_everything

pytestmark = pytest.mark.timeout(90)

QUEUES = [{"name": "celery"}, {"name": "emails"}]
PAUSED = "queue:emails"


def _app(make_test_app: AppFactory, shards: int = 1) -> Celery:
    return make_test_app(conf={"zdelay_shards": shards}, queues=QUEUES)


def _places(client: redis.Redis, store: Store, task_id: str) -> list[str]:
    """Where *task_id* is on its shard: due, held (by the emails control), in flight."""
    shard = store.shard_of(task_id)
    keys = keys_of(shard)
    return [
        name
        for name, key in (
            ("due", keys.due),
            *(("held", held) for held in held_sets(shard, PAUSED)),
            ("lease", keys.lease),
        )
        if client.zscore(key, task_id) is not None
    ]


def _pass(app: Celery) -> None:
    """One companion pass: due entries are released, or held if their queue is held back."""
    with Companion(app) as comp:
        comp.release_due()


def _release_everything(app: Celery, client: redis.Redis) -> list[tuple[str, Any]]:
    """Release every parked entry (its control lifted); return (id, args) sent to emails."""
    return release_everything(app, client, "emails", PAUSED)


def _held(app: Celery, client: redis.Redis, *ids: str) -> None:
    """Pause emails, park *ids* due now there, and let a companion hold them."""
    celery_zdelay.pause(PAUSED, app=app)
    for task_id in ids:
        app.tasks["tests.record"].apply_delayed(
            ("first",), countdown=0, queue="emails", task_id=task_id
        )
    _pass(app)
    store = store_for(app)
    assert all(_places(client, store, task_id) == ["held"] for task_id in ids)


def test_a_paused_task_parked_again_is_held_again_once_and_released_once_with_its_new_message(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given task X held behind the emails pause
    app = _app(make_test_app)
    store = store_for(app)
    _held(app, redis_client, "X")

    # When X is parked again under its id (no key, no tags), due now
    app.tasks["tests.record"].apply_delayed(("again",), countdown=0, queue="emails", task_id="X")

    # Then it left its held set: one entry, waiting in the due set
    assert _places(redis_client, store, "X") == ["due"]

    # ...a pass while the queue is still paused holds it again, once
    _pass(app)
    assert _places(redis_client, store, "X") == ["held"]
    assert redis_client.llen("emails") == 0

    # ...and on resume it runs once, with the new arguments; nothing dead-lettered
    celery_zdelay.resume(PAUSED, app=app)
    assert _release_everything(app, redis_client) == [("X", "('again',)")]
    assert admin.list_dead(store).entries == []


def test_a_task_held_by_a_rate_limit_parked_again_is_one_entry_released_once(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given a limit of 1/m on emails (burst 1): of A and B due now, one is
    # sent and the other held by the limit
    app = _app(make_test_app)
    store = store_for(app)
    celery_zdelay.set_rate_limit(PAUSED, "1/m", app=app)
    record = app.tasks["tests.record"]
    for task_id in ("A", "B"):
        record.apply_delayed(("first",), countdown=0, queue="emails", task_id=task_id)
    _pass(app)
    (sent,) = [json.loads(raw)["headers"]["id"] for raw in redis_client.lrange("emails", 0, -1)]
    waiting = "B" if sent == "A" else "A"
    assert _places(redis_client, store, waiting) == ["held"]

    # When the held one is parked again under its id, due in an hour
    record.apply_delayed(("again",), countdown=3600, queue="emails", task_id=waiting)

    # Then it waits in the due set only, and the limit's held set is empty
    assert _places(redis_client, store, waiting) == ["due"]
    found = celery_zdelay.lookup(waiting, app=app)
    assert found is not None
    assert found.state == "parked"

    # ...and once the limit is lifted and it is brought forward, it runs once
    celery_zdelay.set_rate_limit(PAUSED, None, app=app)
    assert celery_zdelay.reschedule(waiting, countdown=0, app=app) is True
    assert sorted(_release_everything(app, redis_client)) == sorted(
        [(sent, "('first',)"), (waiting, "('again',)")]
    )
    assert admin.list_dead(store).entries == []


def test_a_batch_over_four_shards_parks_held_tasks_again_in_one_transaction(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given 4 shards and 8 tasks held behind the emails pause, on several shards
    app = _app(make_test_app, shards=4)
    store = store_for(app)
    ids = [f"t{i}" for i in range(8)]
    assert len({store.shard_of(task_id) for task_id in ids}) > 1
    _held(app, redis_client, *ids)

    # When one batch parks all of them again under their ids, due in an hour
    # (Store.park over several shards: one MULTI/EXEC)
    record = app.tasks["tests.record"]
    with celery_zdelay.batch(app):
        for task_id in ids:
            record.apply_delayed(("again",), countdown=3600, queue="emails", task_id=task_id)

    # Then each left its held set and waits in the due set only
    assert [_places(redis_client, store, task_id) for task_id in ids] == [["due"]] * 8

    # ...and after resume a pass sends nothing (none is due yet) and finds no
    # payload missing
    celery_zdelay.resume(PAUSED, app=app)
    _pass(app)
    assert redis_client.llen("emails") == 0
    assert admin.list_dead(store).entries == []


def test_the_store_park_call_takes_a_held_id_out_of_its_held_set(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given X held behind the emails pause, its stored message read back
    app = _app(make_test_app)
    store = store_for(app)
    _held(app, redis_client, "X")
    payload = redis_client.hget(keys_of(0).msg, "X")
    assert payload is not None

    # When the store parks X again (a fresh Store: no held set seen before)
    fresh = Store(store.config)
    try:
        (parked,) = fresh.park([ParkRequest("X", Due("r", 0), payload)])
    finally:
        fresh.close()

    # Then X is in the due set only, at the new due time
    assert _places(redis_client, store, "X") == ["due"]
    score = redis_client.zscore(keys_of(0).due, "X")
    assert score is not None
    assert int(score) // 1024 == parked.due_ms


def test_a_tagged_park_of_a_held_id_leaves_one_entry(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given X held behind the emails pause
    app = _app(make_test_app)
    store = store_for(app)
    _held(app, redis_client, "X")

    # When X is parked again with a tag (park_keyed.lua)
    app.tasks["tests.record"].apply_delayed(
        ("again",), countdown=0, queue="emails", task_id="X", tags=["t"]
    )

    # Then one entry, due; on resume it runs once
    assert _places(redis_client, store, "X") == ["due"]
    celery_zdelay.resume(PAUSED, app=app)
    assert _release_everything(app, redis_client) == [("X", "('again',)")]
    assert admin.list_dead(store).entries == []


def test_a_periodic_occurrence_held_and_forgotten_by_the_tick_memory_is_not_parked_twice(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given occurrence X held behind the emails pause, which the tick memory
    # of park_once does not remember (it forgets after an hour)
    app = _app(make_test_app)
    store = store_for(app)
    _held(app, redis_client, "X")
    payload = redis_client.hget(keys_of(0).msg, "X")
    assert payload is not None
    periodic = PeriodicStore(store)

    # When a companion parks that occurrence again through park_once
    parked = periodic.park_once(ParkRequest("X", Due("r", 0), payload), occurrence_ms=0)

    # Then it is refused as parked before: X stays one entry, held, and runs once
    assert parked is False
    assert _places(redis_client, store, "X") == ["held"]
    celery_zdelay.resume(PAUSED, app=app)
    assert _release_everything(app, redis_client) == [("X", "('first',)")]
    assert admin.list_dead(store).entries == []


def test_a_park_given_held_sets_stores_no_template_but_its_own(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given X held behind the emails pause: parking it again gives park.lua
    # the held set, so its templates follow the control names in ARGV
    app = _app(make_test_app)
    _held(app, redis_client, "X")

    # When X is parked again, with a message template
    app.tasks["tests.record"].apply_delayed(("again",), countdown=3600, queue="emails", task_id="X")

    # Then the templates hash holds each stored template with its use count,
    # and nothing read from another argument (a control name, a count)
    fields = {f.decode() for f in redis_client.hkeys(keys_of(0).templates)}
    records = {f for f in fields if not f.startswith("#")}
    counted = {f[1:] for f in fields if f.startswith("#")}
    assert records, "the task's message was stored with a template"
    assert records == counted
    assert not records & {"1", *store_for(app).lanes(0)}


def test_a_stray_payload_with_every_held_set_given_is_parked_in_one_call(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given a store with the emails pause's held set (its only control), and
    # a payload for S that no set has (written by something else)
    app = _app(make_test_app)
    store = store_for(app)
    _held(app, redis_client, "X")
    redis_client.hset(keys_of(0).msg, "S", b"stray")
    lanes = store.lanes(0)
    assert len(lanes) == 1

    # When park.lua is called once for S with every held set given
    payload = redis_client.hget(keys_of(0).msg, "X")
    assert payload is not None
    reply = store._park_call(
        "park", 0, [ParkRequest("S", Due("r", 3_600_000), payload)], store.client, lanes
    )

    # Then it does not ask for the held sets again: S is parked, due
    assert [int(x) for x in reply] != [-2]
    assert _places(redis_client, store, "S") == ["due"]
