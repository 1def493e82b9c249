"""What a companion parked moves a schedule's pointer once: each occurrence counted once.

Pins the lines of ``periodic/lua/advance.lua`` (see docs/mutation.rst)
through :meth:`PeriodicStore.advance` on a private Redis, no worker or
companion: the pointer moves only forward, and only the companion that
moves it counts the missed occurrences and remembers their ids (the
newest thousand); an occurrence recorded by several companions is listed
and counted once (``zdelay_max_runs``); ids older than the memory are
forgotten; a tick taken over from the previous version stays inclusive
until the pointer reaches it; and a pause, a change or a removal since the
companion read the schedule refuses the record.
"""

from __future__ import annotations

import json

import pytest
from celery import Celery

from celery_zdelay import periodic
from celery_zdelay.errors import StoreRefusedError
from celery_zdelay.parking import store_for
from celery_zdelay.periodic.store import REMEMBER_PARKED_MS, PeriodicStore, Pointer

pytestmark = pytest.mark.timeout(60)

#: The most missed ids remembered per schedule (advance.lua's KEEP_MISSED).
KEEP_MISSED = 1000


def _added(app: Celery) -> tuple[PeriodicStore, Pointer]:
    """Schedule "a" every 10 s, added at run time: its store and its first pointer."""
    assert periodic.add("a", app=app, task="tests.record", schedule=10.0)
    periodic_store = PeriodicStore(store_for(app))
    return periodic_store, periodic_store.snapshot().pointers["a"]


def _pointer(periodic_store: PeriodicStore) -> Pointer:
    return periodic_store.snapshot().pointers["a"]


def _missed_ids(periodic_store: PeriodicStore) -> list[tuple[int, str]]:
    return periodic_store.missed_between("a", 0, 2**52)


def test_the_companion_that_moves_the_pointer_counts_the_missed_and_remembers_their_ids(
    app: Celery,
) -> None:
    periodic_store, start = _added(app)
    t = start.ms
    assert start.version == 1

    done = periodic_store.advance(
        "a", 1, t + 30_000, [(t + 30_000, "p3")], t, missed=2, missed_ids=[(t + 10_000, "m1")]
    )

    assert done == "done"
    assert _pointer(periodic_store) == Pointer(1, t + 30_000, [(t + 30_000, "p3")], runs=1)
    assert periodic_store.snapshot().counts == {"a": {"missed": 2}}
    assert _missed_ids(periodic_store) == [(t + 10_000, "m1")]

    # Another companion that planned the same: the pointer does not move,
    # so it counts nothing again; what it parked is listed once, counted once
    again = periodic_store.advance(
        "a",
        1,
        t + 30_000,
        [(t + 30_000, "p3"), (t + 40_000, "p4"), (t + 40_000, "p4")],
        t,
        missed=2,
        missed_ids=[(t + 20_000, "m2")],
    )

    assert again == "done"
    pointer = _pointer(periodic_store)
    assert pointer == Pointer(1, t + 30_000, [(t + 30_000, "p3"), (t + 40_000, "p4")], runs=2)
    assert periodic_store.snapshot().counts == {"a": {"missed": 2}}
    assert _missed_ids(periodic_store) == [(t + 10_000, "m1")]


def test_a_pointer_moved_with_nothing_missed_counts_nothing_and_with_one_counts_one(
    app: Celery,
) -> None:
    periodic_store, start = _added(app)
    t = start.ms
    assert periodic_store.advance("a", 1, t + 10_000, [], t) == "done"
    assert _pointer(periodic_store).ms == t + 10_000
    assert periodic_store.snapshot().counts == {}
    assert _missed_ids(periodic_store) == []

    periodic_store.advance("a", 1, t + 30_000, [], t, missed=1, missed_ids=[(t + 20_000, "m")])
    assert periodic_store.snapshot().counts == {"a": {"missed": 1}}
    assert _missed_ids(periodic_store) == [(t + 20_000, "m")]


def test_only_the_newest_thousand_missed_ids_are_remembered(app: Celery) -> None:
    periodic_store, start = _added(app)
    t = start.ms
    missed = [(t + k, f"m{k}") for k in range(1, KEEP_MISSED + 3)]

    periodic_store.advance("a", 1, t + 1_000_000, [], t, missed=len(missed), missed_ids=missed)

    assert _missed_ids(periodic_store) == missed[2:]
    assert periodic_store.snapshot().counts == {"a": {"missed": KEEP_MISSED + 2}}

    # One more, on a later pass: still the newest thousand
    newest = (t + 2_000_000, "newest")
    periodic_store.advance("a", 1, t + 3_000_000, [], t, missed=1, missed_ids=[newest])
    assert _missed_ids(periodic_store) == [*missed[3:], newest]


def test_ids_parked_before_the_memory_are_forgotten_and_the_rest_kept(app: Celery) -> None:
    periodic_store, start = _added(app)
    t = start.ms
    parked = [(t + 1000, "old"), (t + 2000, "edge"), (t + 3000, "young")]
    periodic_store.advance("a", 1, t + 3000, parked, t)

    # Later: the memory reaches back exactly to "edge"
    now = t + 2000 + REMEMBER_PARKED_MS
    periodic_store.advance("a", 1, t + 4000, [(t + 4000, "new")], now)

    kept = [(t + 2000, "edge"), (t + 3000, "young"), (t + 4000, "new")]
    assert _pointer(periodic_store).parked == kept
    assert _pointer(periodic_store).runs == 4


def test_a_taken_over_tick_stays_inclusive_until_the_pointer_reaches_it(app: Celery) -> None:
    periodic_store, start = _added(app)
    t = start.ms
    # As define.lua leaves a change that took over a tick due and waiting
    record = {"v": 1, "ms": t, "ids": [], "incl": True}
    periodic_store.store.client.hset(periodic_store.keys.pointers, "a", json.dumps(record))

    periodic_store.advance("a", 1, t - 1, [], t)
    assert (_pointer(periodic_store).ms, _pointer(periodic_store).inclusive) == (t, True)

    periodic_store.advance("a", 1, t, [(t, "taken-over")], t)
    assert (_pointer(periodic_store).ms, _pointer(periodic_store).inclusive) == (t, False)


def test_a_pause_change_or_removal_since_the_read_refuses_the_record(app: Celery) -> None:
    periodic_store, start = _added(app)
    t = start.ms

    assert periodic.pause("a", app=app)
    assert periodic_store.advance("a", 1, t + 10_000, [(t + 10_000, "p")], t) == "paused"
    assert periodic.resume("a", app=app)
    # Resumed under version 2: a record planned from version 1 is refused
    assert periodic_store.advance("a", 1, t + 10_000, [(t + 10_000, "p")], t) == "changed"
    assert _pointer(periodic_store).parked == []
    assert periodic.remove("a", app=app)
    assert periodic_store.advance("a", 2, t + 10_000, [(t + 10_000, "p")], t) == "changed"
    assert "a" not in periodic_store.snapshot().pointers


def test_a_key_of_another_type_refuses_the_record_before_anything_is_counted(
    app: Celery,
) -> None:
    periodic_store, start = _added(app)
    t = start.ms
    missed_key = periodic_store.keys.missed_prefix + "a"
    periodic_store.store.client.set(missed_key, "something else wrote this")

    with pytest.raises(StoreRefusedError, match="holds a string, not a zset: something else"):
        periodic_store.advance("a", 1, t + 30_000, [], t, missed=2, missed_ids=[(t + 10_000, "m1")])

    assert periodic_store.snapshot().counts == {}
    assert _pointer(periodic_store) == start
