"""A pause takes back what was parked and says what it did; a resume starts afresh from now.

Pins the lines of ``periodic/lua/pause.lua`` (see docs/mutation.rst) that
``tests/periodic/test_withdrawal.py`` (the withdrawal itself, on three
shards and on a Cluster) leaves: the script's answer (1 done, 0 no such
schedule, 2 already so), the paused set, the runs a pause gives back and
never below zero, a pointer left as it was when nothing was taken back, a
resume's new version, its time (Redis now) and its empty list of parked
ids, a corrupt pointer written afresh, and the refusals (a key of another
type, a corrupt version counter) before any write. On a private Redis,
occurrences parked by a periodic server's pass, no worker or companion.
"""

from __future__ import annotations

import json

import pytest
import redis
from celery import Celery

from celery_zdelay import StoreRefusedError
from celery_zdelay.parking import store_for
from celery_zdelay.periodic.server import PeriodicServer
from celery_zdelay.periodic.store import PeriodicStore
from tests.support.clock import redis_ms

pytestmark = pytest.mark.timeout(60)

#: A 1-second schedule parked ten seconds ahead: about ten occurrences.
HORIZON_MS = 10_000


def _served(app: Celery) -> PeriodicServer:
    """Schedule "a" every second and park its next ten seconds."""
    app.conf.beat_schedule = {"a": {"task": "tests.record", "schedule": 1.0}}
    server = PeriodicServer(app, store_for(app), companion_id="c")
    server.horizon_ms = HORIZON_MS
    assert server.reconcile() == "done"
    assert server.tend() >= 5
    return server


def _pointer(periodic: PeriodicStore) -> bytes:
    raw = periodic.store.client.hget(periodic.keys.pointers, "a")
    assert raw is not None
    return bytes(raw)


def test_pause_and_resume_answer_done_unknown_or_already_so(app: Celery) -> None:
    periodic = _served(app).periodic

    assert periodic.set_paused("a", True) == 1
    assert periodic.snapshot().paused == {"a"}
    assert periodic.set_paused("a", True) == 2
    assert periodic.set_paused("b", True) == 0
    assert periodic.set_paused("a", False) == 1
    assert periodic.snapshot().paused == set()
    assert periodic.set_paused("a", False) == 2
    assert periodic.set_paused("b", False) == 0
    assert periodic.snapshot().paused == set()


def test_a_pause_takes_back_every_parked_occurrence_and_gives_back_their_runs(
    app: Celery,
) -> None:
    periodic = _served(app).periodic
    store = periodic.store
    before = periodic.snapshot().pointers["a"]
    assert before.runs == len(before.parked) >= 5

    assert periodic.set_paused("a", True) == 1

    after = periodic.snapshot().pointers["a"]
    assert after.runs == 0
    assert (after.version, after.ms) == (before.version, before.ms)
    assert store.client.zcard(store.keys(0).due) == 0


def test_a_pause_that_takes_one_occurrence_back_gives_back_one_run(app: Celery) -> None:
    periodic = _served(app).periodic
    store = periodic.store
    parked = store.client.zcard(store.keys(0).due)
    # All but the last leased to a companion: in flight, they run and count
    claimed = store.claim(0, limit=parked - 1, lease_ms=600_000, advance_ms=2 * HORIZON_MS)
    assert len(claimed.entries) == parked - 1
    runs = periodic.snapshot().pointers["a"].runs

    assert periodic.set_paused("a", True) == 1

    assert periodic.snapshot().pointers["a"].runs == runs - 1


def test_runs_given_back_never_go_below_zero(app: Celery) -> None:
    periodic = _served(app).periodic
    record = json.loads(_pointer(periodic))
    record["n"] = 1  # fewer runs counted than occurrences parked (an older pointer)
    periodic.store.client.hset(periodic.keys.pointers, "a", json.dumps(record))

    assert periodic.set_paused("a", True) == 1

    assert periodic.snapshot().pointers["a"].runs == 0


def test_a_pause_that_takes_nothing_from_the_due_set_leaves_the_pointer_as_it_was(
    app: Celery,
) -> None:
    periodic = _served(app).periodic
    store = periodic.store
    # Every occurrence leased to a companion: in flight, they run and count
    claimed = store.claim(0, limit=100, lease_ms=600_000, advance_ms=2 * HORIZON_MS)
    assert len(claimed.entries) >= 5
    assert store.client.zcard(store.keys(0).due) == 0
    pointer = _pointer(periodic)

    assert periodic.set_paused("a", True) == 1

    assert _pointer(periodic) == pointer


def test_a_resume_starts_a_new_version_from_redis_now_with_nothing_parked(
    app: Celery,
) -> None:
    periodic = _served(app).periodic
    version = periodic.snapshot().pointers["a"].version
    assert periodic.set_paused("a", True) == 1

    before = redis_ms(periodic.store.client)
    assert periodic.set_paused("a", False) == 1
    after = redis_ms(periodic.store.client)

    pointer = periodic.snapshot().pointers["a"]
    assert pointer.version == version + 1
    assert before <= pointer.ms <= after
    assert pointer.parked == []
    assert int(periodic.store.client.hget(periodic.keys.versions, "a") or 0) == version + 1


def test_a_resume_writes_a_corrupt_pointer_afresh(app: Celery) -> None:
    periodic = _served(app).periodic
    assert periodic.set_paused("a", True) == 1
    periodic.store.client.hset(periodic.keys.pointers, "a", "not json")

    assert periodic.set_paused("a", False) == 1

    pointer = periodic.snapshot().pointers["a"]
    assert pointer.parked == []
    assert pointer.version == int(periodic.store.client.hget(periodic.keys.versions, "a") or 0)


def test_a_resume_with_a_corrupt_version_counter_is_refused_and_stays_paused(
    app: Celery,
) -> None:
    periodic = _served(app).periodic
    assert periodic.set_paused("a", True) == 1
    periodic.store.client.hset(periodic.keys.versions, "a", "not a number")
    pointer = _pointer(periodic)

    with pytest.raises(StoreRefusedError, match="not a number"):
        periodic.set_paused("a", False)

    assert periodic.snapshot().paused == {"a"}
    assert _pointer(periodic) == pointer


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("defs", "hash"),
        ("pointers", "hash"),
        ("paused", "set"),
        ("cancel", "set"),
        ("versions", "hash"),
    ],
)
def test_a_key_of_another_type_refuses_the_pause_before_any_write(
    app: Celery, redis_client: redis.Redis, name: str, kind: str
) -> None:
    periodic = _served(app).periodic
    store = periodic.store
    parked = store.client.zcard(store.keys(0).due)
    key = getattr(periodic.keys, name)
    store.client.delete(key)
    store.client.set(key, "something else wrote this")

    with pytest.raises(StoreRefusedError, match=rf"holds a string, not a {kind}: something else"):
        periodic.set_paused("a", True)

    assert store.client.zcard(store.keys(0).due) == parked
    assert not store.client.exists(periodic.keys.paused) or name == "paused"


def test_a_pause_names_each_occurrence_it_took_from_a_due_set_once(app: Celery) -> None:
    # Given a schedule's occurrences parked, one of them leased to a companion
    periodic = _served(app).periodic
    store = periodic.store
    claimed = store.claim(0, limit=1, lease_ms=600_000, advance_ms=2 * HORIZON_MS)
    (in_flight,) = [entry.task_id for entry in claimed.entries]
    due = sorted(m.decode() for m in store.client.zrange(store.keys(0).due, 0, -1))
    assert len(due) >= 4
    named: list[str] = []
    periodic.on_withdrawn = named.extend

    # When it is paused
    assert periodic.set_paused("a", True) == 1

    # Then each one taken from the due set is named once, for its owner to
    # record as cancelled; the one in flight runs, and is not
    assert sorted(named) == due
    assert in_flight not in named


def test_a_paused_schedule_leaves_the_planners_visits_and_a_resume_puts_it_back(
    app: Celery,
) -> None:
    periodic = _served(app).periodic
    client = periodic.store.client
    assert client.zscore(periodic.keys.visits, "a") is not None

    assert periodic.set_paused("a", True) == 1
    assert client.zscore(periodic.keys.visits, "a") is None

    assert periodic.set_paused("a", False) == 1
    assert client.zscore(periodic.keys.visits, "a") is not None
