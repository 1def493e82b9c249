"""The planner's index is put back as each schedule's stored state says.

Pins the lines of ``periodic/lua/revisit.lua`` (see docs/mutation.rst)
through :meth:`PeriodicStore.revisit` on a private Redis, no worker or
companion: a schedule removed or paused leaves the visits zset and is not
counted, the others are scored and counted; the ids of a pointer older than
the memory are forgotten and the newer ones kept; and a key of another type
refuses the call before anything is written.
"""

from __future__ import annotations

import json

import pytest
from celery import Celery

from celery_zdelay import periodic
from celery_zdelay.errors import StoreRefusedError
from celery_zdelay.parking import store_for
from celery_zdelay.periodic.store import PeriodicStore

pytestmark = pytest.mark.timeout(60)


def _store(app: Celery, *names: str) -> PeriodicStore:
    for name in names:
        assert periodic.add(name, app=app, task="tests.record", schedule=10.0)
    return PeriodicStore(store_for(app))


def _visits(periodic_store: PeriodicStore) -> dict[str, float]:
    reply = periodic_store.store.client.zrange(periodic_store.keys.visits, 0, -1, withscores=True)
    return {name.decode(): score for name, score in reply}


def test_a_removed_or_paused_schedule_leaves_the_index_and_the_others_are_counted(
    app: Celery,
) -> None:
    # Given three schedules in the index, one paused and one removed since
    periodic_store = _store(app, "a", "b", "c")
    client, keys = periodic_store.store.client, periodic_store.keys
    client.sadd(keys.paused, "b")
    client.hdel(keys.defs, "c")
    client.zadd(keys.visits, {"b": 1, "c": 1})

    # When the index is put back for all three (and a name never stored)
    listed = periodic_store.revisit(["a", "b", "c", "never"], 0)

    # Then only the one stored and running is in it, and counted
    assert listed == 1
    assert set(_visits(periodic_store)) == {"a"}
    pointer = json.loads(client.hget(keys.pointers, "a"))
    assert _visits(periodic_store)["a"] == pointer["ms"]


def test_the_ids_a_pointer_lists_before_the_memory_are_forgotten_and_the_others_kept(
    app: Celery,
) -> None:
    # Given a pointer listing ids parked at 1,000, 5,000 and 9,000 ms
    periodic_store = _store(app, "a")
    client, keys = periodic_store.store.client, periodic_store.keys
    record = json.loads(client.hget(keys.pointers, "a"))
    record["ids"] = [[1000, "old"], [5000, "edge"], [9000, "new"]]
    client.hset(keys.pointers, "a", json.dumps(record))

    # When the index is put back, forgetting ids before 5,000 ms
    periodic_store.revisit(["a"], 5000 + periodic_store.remember_parked_ms)

    # Then the older id is forgotten, the one at the bound and the newer kept
    kept = json.loads(client.hget(keys.pointers, "a"))["ids"]
    assert kept == [[5000, "edge"], [9000, "new"]]


def test_a_pointer_without_ids_or_with_ids_it_cannot_read_is_left_as_it_is(
    app: Celery,
) -> None:
    # Given a pointer with no ids, and another whose ids hold what no
    # companion writes (kept: nothing here judges them)
    periodic_store = _store(app, "a", "b")
    client, keys = periodic_store.store.client, periodic_store.keys
    bare = json.loads(client.hget(keys.pointers, "a"))
    bare.pop("ids", None)
    client.hset(keys.pointers, "a", json.dumps(bare))
    odd = json.loads(client.hget(keys.pointers, "b"))
    odd["ids"] = ["not a pair", ["no", "ms"], [1000, "old"]]
    client.hset(keys.pointers, "b", json.dumps(odd))

    # When the index is put back
    assert periodic_store.revisit(["a", "b"], 5000 + periodic_store.remember_parked_ms) == 2

    # Then both are scored; the odd entry stays, the old id goes
    assert set(_visits(periodic_store)) == {"a", "b"}
    assert json.loads(client.hget(keys.pointers, "b"))["ids"] == ["not a pair", ["no", "ms"]]


@pytest.mark.parametrize("key", ["defs", "pointers", "paused", "runs", "visits"])
def test_a_key_of_another_type_refuses_the_call_before_anything_is_written(
    app: Celery, key: str
) -> None:
    # Given a pointer with an id old enough to be forgotten (a write to come)
    periodic_store = _store(app, "a")
    client, keys = periodic_store.store.client, periodic_store.keys
    record = json.loads(client.hget(keys.pointers, "a"))
    record["ids"] = [[1000, "old"]]
    client.hset(keys.pointers, "a", json.dumps(record))
    pointer = client.hget(keys.pointers, "a") if key != "pointers" else None
    visits = client.zrange(keys.visits, 0, -1, withscores=True) if key != "visits" else None
    client.delete(getattr(keys, key))
    client.set(getattr(keys, key), "not the type it should be")

    with pytest.raises(StoreRefusedError):
        periodic_store.revisit(["a"], 5000 + periodic_store.remember_parked_ms)

    if pointer is not None:
        assert client.hget(keys.pointers, "a") == pointer
    if visits is not None:
        assert client.zrange(keys.visits, 0, -1, withscores=True) == visits
