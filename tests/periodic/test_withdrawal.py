"""A change, removal or pause takes back every parked and leased occurrence, on every shard.

Pins the lines of ``periodic/lua/_withdraw.lua`` (see docs/mutation.rst),
the part of ``define.lua`` and ``pause.lua`` that withdraws the old
version's occurrences in the same script as the change: on a private Redis
with three shards (the shard keys come five per shard at the end of KEYS),
an occurrence still parked leaves the due set and its payload, one leased
to a companion leaves the lease set, the leased hash and its payload, and
the template counts go back to what the entries left parked refer to. No
worker or companion: the occurrences are parked by a periodic server's
pass and leased by :meth:`Store.claim`, as a companion would.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from celery import Celery

from celery_zdelay import periodic
from celery_zdelay.parking import store_for
from celery_zdelay.periodic.server import PeriodicServer
from celery_zdelay.store import Store
from tests.conftest import AppFactory
from tests.helpers import wait_for
from tests.servers import LocalCluster
from tests.support.clock import redis_ms
from tests.support.store import ids_on_shard

pytestmark = pytest.mark.timeout(60)

SHARDS = 3
#: A 1-second schedule parked a minute ahead: about 60 occurrences, so that
#: each shard holds several (a shard with fewer than two is 3 in 10^9).
HORIZON_MS = 60_000


def _template_refs(store: Store, shard: int) -> dict[bytes, bytes]:
    """The shard's template reference counts ("#<template id>" -> count)."""
    fields: dict[bytes, bytes] = store.client.hgetall(store.keys(shard).templates)
    return {k: v for k, v in fields.items() if k.startswith(b"#")}


def _where(store: Store, shard: int, ids: set[str]) -> dict[str, set[str]]:
    """Which of *ids* each of the shard's keys still holds."""
    keys, client = store.keys(shard), store.client
    return {
        "due": {i for i in ids if client.zscore(keys.due, i) is not None},
        "lease": {i for i in ids if client.zscore(keys.lease, i) is not None},
        "leased": {i for i in ids if client.hexists(keys.leased, i)},
        "msg": {i for i in ids if client.hexists(keys.msg, i)},
    }


def _occurrences(store: Store, shard: int) -> set[str]:
    keys = store.keys(shard)
    members = [*store.client.zrange(keys.due, 0, -1), *store.client.zrange(keys.lease, 0, -1)]
    return {m.decode() for m in members if m.startswith(b"periodic:a:v")}


def _serve_and_lease(app: Celery) -> tuple[Store, list[str], list[dict[bytes, bytes]]]:
    """Schedule "a", park a plain entry of its message per shard, lease a first occurrence on each.

    The plain entries (built as a companion builds an occurrence, due in an
    hour) share the occurrences' template. Returns the store, the plain
    entries and each shard's template counts before "a" was served: what a
    withdrawal gives them back to.
    """
    store = store_for(app)
    app.conf.beat_schedule = {"a": {"task": "tests.record", "schedule": 1.0}}
    server = PeriodicServer(app, store, companion_id="c")
    server.horizon_ms = HORIZON_MS
    assert server.reconcile() == "done"
    definition = server.periodic.snapshot().definitions["a"]
    plain = [ids_on_shard(store, shard, 1, prefix="plain")[0] for shard in store.shards]
    later = redis_ms(store.client) + 3_600_000
    for task_id in plain:
        store.park(server.requests_for(definition, task_id, later, due_ms=later))
    refs_before = [_template_refs(store, shard) for shard in store.shards]

    assert server.tend() > SHARDS * 2
    for shard in store.shards:
        # A minute ahead: the shard's earliest occurrence, never a plain entry.
        claimed = store.claim(shard, limit=1, lease_ms=600_000, advance_ms=HORIZON_MS)
        assert [e.task_id.startswith("periodic:a:") for e in claimed.entries] == [True]

    for shard in store.shards:
        held = _where(store, shard, _occurrences(store, shard))
        # Each shard holds both kinds, and its occurrences share the plain
        # entry's template: a count moved wrongly by one shows.
        assert len(held["lease"]) == len(held["leased"]) == 1
        assert held["due"]
        refs = _template_refs(store, shard)
        assert refs.keys() == refs_before[shard].keys()
        assert refs != refs_before[shard]
    return store, plain, refs_before


def _pause(app: Celery) -> None:
    assert periodic.pause("a", app=app)


def _remove(app: Celery) -> None:
    assert periodic.remove("a", app=app)


def _change(app: Celery) -> None:
    app.conf.beat_schedule = {"a": {"task": "tests.record", "schedule": 30.0}}
    server = PeriodicServer(app, store_for(app), companion_id="c2")
    assert server.reconcile() == "done"


@pytest.mark.parametrize("withdraw", [_pause, _remove, _change], ids=["pause", "remove", "change"])
def test_every_parked_and_leased_occurrence_is_taken_back_on_every_shard(
    make_test_app: AppFactory, withdraw: Callable[[Celery], None]
) -> None:
    app = make_test_app(conf={"zdelay_shards": SHARDS})
    store, plain, refs_before = _serve_and_lease(app)
    occurrences = [_occurrences(store, shard) for shard in store.shards]

    withdraw(app)

    for shard in store.shards:
        empty: dict[str, set[str]] = {"due": set(), "lease": set(), "leased": set(), "msg": set()}
        assert _where(store, shard, occurrences[shard]) == empty
        # The plain entry stays, and so do the template counts it holds.
        assert _where(store, shard, {plain[shard]})["msg"] == {plain[shard]}
        assert _template_refs(store, shard) == refs_before[shard]


def test_withdrawing_the_last_entries_of_a_template_deletes_its_count(
    make_test_app: AppFactory,
) -> None:
    app = make_test_app(conf={"zdelay_shards": SHARDS})
    store, plain, _ = _serve_and_lease(app)
    assert store.cancel(plain) == [True] * SHARDS

    _remove(app)

    for shard in store.shards:
        assert store.client.hlen(store.keys(shard).templates) == 0
        assert store.client.hlen(store.keys(shard).msg) == 0


def test_a_pause_gives_back_the_runs_of_what_it_took_from_the_due_set_not_of_what_is_leased(
    make_test_app: AppFactory,
) -> None:
    # zdelay_max_runs counts what was parked: those taken back never ran,
    # those leased are in flight and run.
    app = make_test_app(conf={"zdelay_shards": SHARDS})
    store, _, _ = _serve_and_lease(app)
    periodic_store = PeriodicServer(app, store, companion_id="c2").periodic
    assert periodic_store.snapshot().pointers["a"].runs > SHARDS

    _pause(app)

    assert periodic_store.snapshot().pointers["a"].runs == SHARDS


def test_a_change_goes_on_from_the_earliest_tick_due_and_waiting_not_from_one_leased(
    app: Celery,
) -> None:
    # Given a 0.2-second schedule whose first tick is leased to a companion
    # (in flight under the old version) and whose next two are due and waiting
    store = store_for(app)
    app.conf.beat_schedule = {"a": {"task": "tests.record", "schedule": 0.2}}
    server = PeriodicServer(app, store, companion_id="c")
    assert server.reconcile() == "done"
    assert server.tend() >= 3
    first, second, third = sorted(server.periodic.snapshot().pointers["a"].parked)[:3]
    wait_for(lambda: redis_ms(store.client) > first[0], timeout=10)
    assert [e.task_id for e in store.claim(0, limit=1, lease_ms=600_000).entries] == [first[1]]
    wait_for(lambda: redis_ms(store.client) > third[0], timeout=10)

    # When the entry changes
    _change(app)

    # Then the new version goes on from the earliest waiting tick, which it runs
    pointer = server.periodic.snapshot().pointers["a"]
    assert (pointer.version, pointer.ms, pointer.inclusive) == (2, second[0], True)


def test_on_a_redis_cluster_a_pause_or_removal_withdraws_shard_by_shard_before_it_returns(
    make_test_app: AppFactory, cluster: LocalCluster
) -> None:
    # The shards are other slots than the schedules': the script lists the
    # occurrences in the cancel set, and the call cancels them on each shard
    app = make_test_app(conf={"zdelay_redis_url": cluster.url, "zdelay_shards": SHARDS})
    store = store_for(app)
    app.conf.beat_schedule = {"a": {"task": "tests.record", "schedule": 1.0}}
    server = PeriodicServer(app, store, companion_id="c")
    server.horizon_ms = HORIZON_MS
    assert server.reconcile() == "done"
    assert server.tend() > SHARDS * 2

    for withdraw in (_pause, _remove):
        withdraw(app)
        assert not any(_occurrences(store, shard) for shard in store.shards)
        assert store.client.scard(server.periodic.keys.cancel) == 0
        if withdraw is _pause:
            assert periodic.resume("a", app=app)
            server._last_tend = 0.0  # a pass now, however close to the last
            assert server.tend() > SHARDS * 2
