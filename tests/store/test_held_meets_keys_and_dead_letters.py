"""A task held back by a pause meets a key, a requeue and a purge, and stays one task.

A held task waits in its control's held set (``hold.lua``), not in the due
set, with its payload in the msg hash as ever. Every script that asks
whether an id is parked asks ``_where.lua``, which knows that state: these
tests pin each such question against a held entry, on a real Redis with an
in-process companion making release passes (no worker: what reaches the
``emails`` broker list is what runs).
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
from celery import Celery

import celery_zdelay
from celery_zdelay.companion import Companion
from celery_zdelay.parking import store_for
from celery_zdelay.periodic.store import PeriodicStore
from celery_zdelay.store import Parked, Store, admin
from celery_zdelay.store.control import pause_lane
from celery_zdelay.store.dead_reason import DeadReason
from celery_zdelay.store.marks import (
    check_marks,
    finish_key,
    key_owner,
    tagged_ids,
)
from celery_zdelay.store.redis_keys import held_set_key
from tests.conftest import AppFactory
from tests.support.clock import redis_ms
from tests.support.keys import keys_of
from tests.support.store import marked_request, release_everything

pytestmark = pytest.mark.timeout(90)

QUEUES = [{"name": "celery"}, {"name": "emails"}]
PAUSED = "queue:emails"
HOUR = 3_600_000
REASON = DeadReason(reason="bad signature", due_ms=1_700_000_000_000, companion="c-test")


def _app(make_test_app: AppFactory, shards: int = 1) -> Celery:
    return make_test_app(conf={"zdelay_shards": shards}, queues=QUEUES)


def _places(client: redis.Redis, store: Store, task_id: str) -> list[str]:
    """Where *task_id* is: due, held (behind the emails pause), in flight; dead too."""
    keys = keys_of(store.shard_of(task_id))
    held = held_set_key("zdelay", store.shard_of(task_id), pause_lane(PAUSED))
    return [
        name
        for name, key in (("due", keys.due), ("held", held), ("lease", keys.lease))
        if client.zscore(key, task_id) is not None
    ] + (["dead"] if client.zscore(keys.dead, task_id) is not None else [])


def _hold(app: Celery) -> None:
    """One companion pass: what is due on the paused queue moves to its held set."""
    with Companion(app) as comp:
        comp.release_due()


def _released_after_resume(app: Celery, client: redis.Redis) -> list[tuple[str, Any]]:
    """Resume the emails queue, release everything parked; return (id, args) sent to it."""
    celery_zdelay.resume(PAUSED, app=app)
    return release_everything(app, client, "emails", PAUSED)


def _dead_letter(app: Celery, task_id: str, **options: Any) -> None:
    """Park *task_id* due now, claim it as a companion would, and dead-letter it."""
    app.tasks["tests.record"].apply_delayed(("old",), countdown=0, task_id=task_id, **options)
    store = store_for(app)
    shard = store.shard_of(task_id)
    claimed = store.claim(shard, limit=10, lease_ms=HOUR)
    assert [e.task_id for e in claimed.entries] == [task_id]
    assert store.dead_letter(shard, claimed.token, [(task_id, REASON)]) == 1


# -- requeue and purge of an id parked again and held -----------------------------


def test_requeue_refuses_an_id_parked_again_and_held_so_the_new_task_runs_once(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given task X dead-lettered, then a new task parked under the same id X
    # on the paused emails queue and held there by a companion
    app = _app(make_test_app)
    store = store_for(app)
    _dead_letter(app, "X", tags=["old"])
    celery_zdelay.pause(PAUSED, app=app)
    app.tasks["tests.record"].apply_delayed(
        ("new",), countdown=0, task_id="X", queue="emails", tags=["new"]
    )
    _hold(app)
    assert _places(redis_client, store, "X") == ["held", "dead"]
    payload = redis_client.hget(keys_of(0).msg, "X")

    # When an operator requeues the dead X
    requeued = admin.requeue_dead(store, ["X"])

    # Then it is refused, and the new X is untouched: held, its message, its tag
    assert requeued == [False]
    assert _places(redis_client, store, "X") == ["held", "dead"]
    assert redis_client.hget(keys_of(0).msg, "X") == payload
    assert tagged_ids(store, "new") == ["X"]
    assert tagged_ids(store, "old") == []
    assert check_marks(store) == []

    # ...and on resume the new X runs, once, with its own arguments
    assert _released_after_resume(app, redis_client) == [("X", "('new',)")]
    assert [d.task_id for d in admin.list_dead(store).entries] == ["X"]


def test_purging_a_dead_id_leaves_the_held_task_parked_again_under_it(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given dead X (keyed and tagged), and a new X, keyed and tagged alike, held
    app = _app(make_test_app)
    store = store_for(app)
    _dead_letter(app, "X", tags=["t"], key="k")
    celery_zdelay.pause(PAUSED, app=app)
    app.tasks["tests.record"].apply_delayed(
        ("new",), countdown=0, task_id="X", queue="emails", tags=["t"], key="k"
    )
    _hold(app)
    assert _places(redis_client, store, "X") == ["held", "dead"]

    # When the dead X is purged
    assert admin.purge_dead(store, ["X"]) == 1

    # Then only the dead letter went: the held X keeps its message, key and tag
    assert _places(redis_client, store, "X") == ["held"]
    assert redis_client.hexists(keys_of(0).msg, "X")
    assert key_owner(store, "k") == ("X", None)
    assert tagged_ids(store, "t") == ["X"]
    assert check_marks(store) == []
    assert _released_after_resume(app, redis_client) == [("X", "('new',)")]


# -- a key whose owner is held --------------------------------------------------


def _held_owner(app: Celery, client: redis.Redis, *, on_key: str = "keep") -> str:
    """Pause the emails queue, park a task under key k there, hold it; return its id."""
    celery_zdelay.pause(PAUSED, app=app)
    first = app.tasks["tests.record"].apply_delayed(
        ("first",), countdown=0, queue="emails", key="k", on_key=on_key, tags=["t"]
    )
    _hold(app)
    assert _places(client, store_for(app), first.id) == ["held"]
    return str(first.id)


@pytest.mark.parametrize("on_key", ["replace", "debounce"])
def test_replace_and_debounce_cancel_a_held_owner_so_one_task_runs_after_resume(
    make_test_app: AppFactory, redis_client: redis.Redis, on_key: str
) -> None:
    # Given a task under key k, held behind the emails pause
    app = _app(make_test_app)
    store = store_for(app)
    first = _held_owner(app, redis_client)

    # When a new call under k replaces (or debounces) it, due in 0.3 s
    before_ms = redis_ms(redis_client)
    second = app.tasks["tests.record"].apply_delayed(
        ("second",), countdown=0.3, queue="emails", key="k", on_key=on_key, tags=["t"]
    )

    # Then the held one is cancelled as a parked one is: out of its held set,
    # its message, key and tag gone with it; the new one parked and owning k
    assert second.id != first
    assert _places(redis_client, store, first) == []
    assert not redis_client.hexists(keys_of(0).msg, first)
    assert _places(redis_client, store, second.id) == ["due"]
    assert key_owner(store, "k") == (second.id, None)
    assert tagged_ids(store, "t") == [second.id]
    assert check_marks(store) == []
    found = celery_zdelay.lookup(second.id, app=app)
    assert found is not None
    assert found.due_ms is not None
    assert found.due_ms >= before_ms + 300

    # ...and after resume exactly one task runs: the new one
    assert _released_after_resume(app, redis_client) == [(second.id, "('second',)")]


@pytest.mark.parametrize("on_key", ["keep", "until_finished"])
def test_keep_and_until_finished_keep_a_held_owner_and_return_it(
    make_test_app: AppFactory, redis_client: redis.Redis, on_key: str
) -> None:
    # Given a task under key k, held behind the emails pause
    app = _app(make_test_app)
    store = store_for(app)
    first = _held_owner(app, redis_client, on_key=on_key)
    due_ms = redis_client.zscore(held_set_key("zdelay", 0, pause_lane(PAUSED)), first)
    assert due_ms is not None

    # When a new call under k keeps it
    kept = app.tasks["tests.record"].apply_delayed(
        ("second",), countdown=0, queue="emails", key="k", on_key=on_key
    )

    # Then it parks nothing and answers the held task, with its due time
    assert kept.id == first
    assert _places(redis_client, store, first) == ["held"]
    assert redis_client.hlen(keys_of(0).msg) == 1
    ms = int(due_ms) // 1024
    parked = store.park([marked_request("other", ms, key="k", on_key=on_key)])
    assert parked == [Parked(task_id=first, due_ms=ms, parked=False)]
    assert key_owner(store, "k") == (first, None)
    assert check_marks(store) == []
    assert _released_after_resume(app, redis_client) == [(first, "('first',)")]


def test_a_held_task_parked_again_under_its_own_id_and_key_leaves_its_held_set(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given a task under key k, held behind the emails pause
    app = _app(make_test_app)
    store = store_for(app)
    first = _held_owner(app, redis_client, on_key="replace")

    # When it is parked again under its own id and key, due in an hour
    again = app.tasks["tests.record"].apply_delayed(
        ("again",), countdown=3600, queue="emails", key="k", on_key="replace", task_id=first
    )

    # Then it is in the due set only, never also in its held set
    assert again.id == first
    assert _places(redis_client, store, first) == ["due"]
    assert key_owner(store, "k") == (first, None)
    assert check_marks(store) == []
    celery_zdelay.resume(PAUSED, app=app)
    _hold(app)
    assert redis_client.llen("emails") == 0


def test_apply_delayed_many_replaces_held_owners_on_four_shards(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given 4 shards and 8 keys, each owner held behind the emails pause
    app = _app(make_test_app, shards=4)
    store = store_for(app)
    record = app.tasks["tests.record"]
    celery_zdelay.pause(PAUSED, app=app)
    keys = [f"k{i}" for i in range(8)]
    first = record.apply_delayed_many(
        [("first", i) for i in range(8)], countdown=0, queue="emails", keys=keys
    )
    _hold(app)
    assert len({store.shard_of(r.id) for r in first}) > 1
    assert all(_places(redis_client, store, r.id) == ["held"] for r in first)

    # When one apply_delayed_many call replaces all of them (one transaction)
    second = record.apply_delayed_many(
        [("second", i) for i in range(8)],
        countdown=0,
        queue="emails",
        keys=keys,
        on_key="replace",
    )

    # Then every held owner is gone and each key is owned by its new task
    assert all(_places(redis_client, store, r.id) == [] for r in first)
    assert [key_owner(store, k) for k in keys] == [(r.id, None) for r in second]
    assert check_marks(store) == []
    released = _released_after_resume(app, redis_client)
    assert sorted(released) == sorted((r.id, f"('second', {i})") for i, r in enumerate(second))


# -- a run's end meets its task parked again and held -------------------------------


def test_a_run_ending_keeps_the_key_of_its_task_parked_again_and_held(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given an until_finished task X under key k, released and running (its
    # end in the index), which parks itself again under X (a retry), and
    # that retry held behind the emails pause
    app = _app(make_test_app)
    store = store_for(app)
    record = app.tasks["tests.record"]
    run = record.apply_delayed(
        ("run",), countdown=0, queue="emails", key="k", on_key="until_finished"
    )
    _hold(app)
    assert redis_client.llen("emails") == 1
    assert key_owner(store, "k") is not None
    celery_zdelay.pause(PAUSED, app=app)
    record.apply_delayed(
        ("retry",), countdown=0, queue="emails", key="k", on_key="until_finished", task_id=run.id
    )
    _hold(app)
    assert _places(redis_client, store, run.id) == ["held"]
    assert key_owner(store, "k") == (run.id, None)

    # When the first run ends (the worker frees the key of the run it ran)
    freed = finish_key(store, "k", run.id)

    # Then the key stays with the held retry: a keep call parks nothing
    assert freed is False
    assert key_owner(store, "k") == (run.id, None)
    other = record.apply_delayed(("other",), countdown=0, queue="emails", key="k", on_key="keep")
    assert other.id == run.id
    assert check_marks(store) == []


def test_a_held_periodic_occurrence_is_not_taken_for_released(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given an occurrence parked on the paused emails queue and held there
    app = _app(make_test_app)
    celery_zdelay.pause(PAUSED, app=app)
    tick = app.tasks["tests.record"].apply_delayed(("tick",), countdown=0, queue="emails")
    _hold(app)
    assert _places(redis_client, store_for(app), tick.id) == ["held"]
    periodic = PeriodicStore(store_for(app))

    # Then the companion that parked it does not record it as run (it waits)
    assert periodic.released_among([("every-second", tick.id)]) == set()

    # ...until it is released
    _released_after_resume(app, redis_client)
    assert periodic.released_among([("every-second", tick.id)]) == {tick.id}
