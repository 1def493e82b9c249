"""Storing schedules: the newest configuration wins, each change gets a new version.

Pins the lines of ``periodic/lua/define.lua`` (see docs/mutation.rst)
through :class:`PeriodicStore` on a private Redis, no worker or companion:
an entry added, replaced or removed is reported as such (and an identical
one not at all), its version only grows, also across a removal; a new
entry starts from now or from its last run elsewhere, never from the
future; a configuration already stored is "same", one replaced before is
"older" unless forced, and a new one removes the configured entries it no
longer names while keeping those added at run time and those it cannot
serve; the configuration's hash, writer and time are recorded. The
withdrawal of the old version's occurrences is pinned in
tests/periodic/test_withdrawal.py.
"""

from __future__ import annotations

import pytest
import redis
from celery import Celery

from celery_zdelay import periodic
from celery_zdelay.errors import StoreRefusedError
from celery_zdelay.parking import store_for
from celery_zdelay.periodic.definition import (
    SOURCE_API,
    SOURCE_DJANGO_BEAT,
    Definition,
    from_beat_entry,
)
from celery_zdelay.periodic.store import PeriodicStore
from tests.support.clock import redis_ms
from tests.support.periodic import parked_ids, server_for, tend

pytestmark = pytest.mark.timeout(60)


def _entry(name: str, seconds: float = 10.0, source: str = "config") -> Definition:
    return from_beat_entry(name, {"task": "tests.record", "schedule": seconds}, source=source)


def _versions(periodic_store: PeriodicStore) -> dict[str, int]:
    return {n: p.version for n, p in periodic_store.snapshot().pointers.items()}


def test_an_entry_added_replaced_and_removed_is_reported_and_its_version_only_grows(
    app: Celery,
) -> None:
    periodic_store = PeriodicStore(store_for(app))
    before = redis_ms(periodic_store.store.client)

    assert periodic_store.put(_entry("a"), writer="api") is True
    pointer = periodic_store.snapshot().pointers["a"]
    assert (pointer.version, pointer.parked, pointer.inclusive) == (1, [], False)
    assert before <= pointer.ms <= redis_ms(periodic_store.store.client)

    assert periodic_store.put(_entry("a"), writer="api") is False
    assert _versions(periodic_store) == {"a": 1}
    assert periodic_store.put(_entry("a", 20.0), writer="api") is True
    assert _versions(periodic_store) == {"a": 2}
    assert periodic_store.snapshot().definitions["a"] == _entry("a", 20.0)

    assert periodic_store.drop(["a", "never-stored"]) == ["a"]
    snap = periodic_store.snapshot()
    assert (snap.definitions, snap.pointers) == ({}, {})
    assert periodic_store.drop(["a"]) == []
    # Added again: a version never given before, so no old id comes back
    assert periodic_store.put(_entry("a"), writer="api") is True
    assert _versions(periodic_store) == {"a": 3}


def test_a_removed_entry_is_no_longer_paused(app: Celery) -> None:
    periodic_store = PeriodicStore(store_for(app))
    periodic_store.put(_entry("a"), writer="api")
    assert periodic.pause("a", app=app)
    periodic_store.drop(["a"])
    periodic_store.put(_entry("a"), writer="api")
    assert periodic_store.snapshot().paused == set()


def test_a_new_entry_goes_on_from_its_last_run_elsewhere_never_from_the_future(
    app: Celery,
) -> None:
    periodic_store = PeriodicStore(store_for(app))
    now = redis_ms(periodic_store.store.client)
    since = {"ran": now - 3_600_000, "ahead": now + 3_600_000, "changed": now - 3_600_000}
    periodic_store.store_config([_entry("changed")], "h0", writer="c", force=False)

    status, changed = periodic_store.store_config(
        [_entry("ran"), _entry("ahead"), _entry("changed", 20.0)],
        "h1",
        writer="c",
        force=False,
        since=since,
    )

    assert (status, sorted(changed)) == (
        "done",
        [("changed", "changed"), ("new", "ahead"), ("new", "ran")],
    )
    pointers = periodic_store.snapshot().pointers
    assert pointers["ran"].ms == now - 3_600_000
    assert now <= pointers["ahead"].ms < now + 3_600_000
    # Only a new entry takes the time it last ran elsewhere
    assert now <= pointers["changed"].ms < now + 3_600_000


def test_the_newest_configuration_wins_unless_an_older_one_is_forced_back(
    app: Celery,
) -> None:
    periodic_store = PeriodicStore(store_for(app))
    client, keys = periodic_store.store.client, periodic_store.keys
    store = periodic_store.store_config
    before = redis_ms(client)

    assert store([_entry("a")], "h1", writer="c1", force=False) == ("done", [("new", "a")])
    assert store([_entry("a")], "h1", writer="c1", force=False) == ("same", [])
    meta = periodic_store.snapshot().meta
    assert (meta["hash"], meta["written_by"]) == ("h1", "c1")
    assert before <= int(meta["written_ms"]) <= redis_ms(client)

    replaced = store([_entry("a", 20.0)], "h2", writer="c2", force=False)
    assert replaced == ("done", [("changed", "a")])
    assert client.smembers(keys.superseded) == {b"h1"}

    # A companion of the previous deploy, restarted, does not write it back
    assert store([_entry("a")], "h1", writer="c1", force=False) == ("older", [("", "h2")])
    assert periodic_store.snapshot().meta["hash"] == "h2"
    assert periodic_store.snapshot().definitions["a"] == _entry("a", 20.0)

    # A deliberate rollback does
    assert store([_entry("a")], "h1", writer="ops", force=True) == ("done", [("changed", "a")])
    assert client.smembers(keys.superseded) == {b"h2"}
    assert periodic_store.snapshot().meta["written_by"] == "ops"


def test_a_new_configuration_removes_only_the_configured_entries_it_no_longer_names(
    app: Celery,
) -> None:
    periodic_store = PeriodicStore(store_for(app))
    store = periodic_store.store_config
    store([_entry("gone"), _entry("kept"), _entry("unservable")], "h1", writer="c", force=False)
    periodic_store.put(_entry("added", source=SOURCE_API), writer="api")

    status, changed = store(
        [_entry("kept"), _entry("new")],
        "h2",
        writer="c",
        force=False,
        keep={"unservable": "no task module"},
    )

    assert (status, sorted(changed)) == ("done", [("new", "new"), ("removed", "gone")])
    assert sorted(periodic_store.snapshot().definitions) == ["added", "kept", "new", "unservable"]
    assert _versions(periodic_store) == {"added": 1, "kept": 1, "new": 1, "unservable": 1}


def test_a_version_counter_that_cannot_count_refuses_the_whole_change_with_the_fix(
    app: Celery,
) -> None:
    periodic_store = PeriodicStore(store_for(app))
    store = periodic_store.store_config
    store([_entry("a"), _entry("b")], "h1", writer="c", force=False)
    periodic_store.store.client.hset(periodic_store.keys.versions, "a", "not a count")

    # A deploy that changes "a" and removes "b"
    with pytest.raises(StoreRefusedError, match="holds not a count, not a count: delete that"):
        store([_entry("a", 20.0)], "h2", writer="c", force=False)

    # Nothing of it was written: "b" is still there, "a" as it was
    snap = periodic_store.snapshot()
    assert snap.definitions == {"a": _entry("a"), "b": _entry("b")}
    assert snap.meta["hash"] == "h1"


def test_the_entries_no_companion_serves_are_stored_with_why_kept_or_withdrawn(
    app: Celery,
) -> None:
    periodic_store = PeriodicStore(store_for(app))
    store = periodic_store.store_config
    served = [_entry("a"), _entry("b")]
    store([*served, _entry("no-module"), _entry("bad-row")], "h1", writer="c", force=False)

    store(
        served,
        "h2",
        writer="c",
        force=False,
        keep={"no-module": "no task module here"},
        withdraw={"bad-row": "a crontab that does not parse"},
    )

    assert periodic_store.unserved() == {
        "no-module": "no task module here",
        "bad-row": "a crontab that does not parse",
    }
    # Kept as stored where this companion cannot import it; withdrawn for all
    snap = periodic_store.snapshot()
    assert (sorted(snap.definitions), snap.unreadable) == (["a", "b", "no-module"], {})
    assert periodic_store.snapshot().definitions["no-module"] == _entry("no-module")

    store(served, "h3", writer="c", force=False)
    assert periodic_store.unserved() == {}


def test_a_configuration_that_names_none_of_the_stored_entries_removes_each_of_them(
    app: Celery,
) -> None:
    periodic_store = PeriodicStore(store_for(app))
    store = periodic_store.store_config
    store([_entry(name) for name in "abcde"], "h1", writer="c", force=False)

    status, changed = store([_entry("f")], "h2", writer="c", force=False)

    assert status == "done"
    assert sorted(changed) == [("new", "f"), *(("removed", name) for name in "abcde")]
    assert sorted(periodic_store.snapshot().definitions) == ["f"]


def test_rows_are_ordered_by_when_they_were_made_not_by_what_they_hold(
    app: Celery,
) -> None:
    # Given django-celery-beat's rows stored as made at t=100 (their change marker)
    periodic_store = PeriodicStore(store_for(app))
    store = periodic_store.store_config
    assert store([_entry("a")], "h1", writer="c1", force=False, made=100) == (
        "done",
        [("new", "a")],
    )

    # When a row is edited (t=200), then edited back to what it was (t=300)
    assert store([_entry("a", 20.0)], "h2", writer="c1", force=False, made=200)[0] == "done"
    back = store([_entry("a")], "h1", writer="c2", force=False, made=300)

    # Then the edit back is stored, though its fingerprint was replaced before
    assert back == ("done", [("changed", "a")])
    assert periodic_store.snapshot().definitions["a"] == _entry("a")
    assert periodic_store.snapshot().meta["made"] == "300"

    # And a companion that read the rows before (t=200, at the same time as
    # another stored ones, t=300) does not roll them back
    assert store([_entry("a", 20.0)], "h2", writer="c3", force=False, made=200) == (
        "older",
        [("", "h1")],
    )
    assert store([_entry("a", 30.0)], "h3", writer="c3", force=False, made=300)[0] == "older"
    assert periodic_store.snapshot().definitions["a"] == _entry("a")

    # The same rows read again later move the time on without a change, so a
    # read made in between (t=350) is older too
    assert store([_entry("a")], "h1", writer="c1", force=False, made=400) == ("same", [])
    assert periodic_store.snapshot().meta["made"] == "400"
    assert store([_entry("a", 20.0)], "h2", writer="c3", force=False, made=350)[0] == "older"
    # ...and an older read of the same rows does not move it back
    assert store([_entry("a")], "h1", writer="c3", force=False, made=350) == ("same", [])
    assert periodic_store.snapshot().meta["made"] == "400"

    # A deliberate rollback still goes through
    assert store([_entry("a", 20.0)], "h2", writer="ops", force=True, made=10)[0] == "done"


def test_a_beat_schedule_after_rows_keeps_the_fingerprint_rule(app: Celery) -> None:
    # Given rows stored as made at t=100, then a beat_schedule (no time of its own)
    periodic_store = PeriodicStore(store_for(app))
    store = periodic_store.store_config
    store([_entry("a")], "h1", writer="rows", force=False, made=100)
    assert store([_entry("a", 20.0)], "h2", writer="deploy", force=False)[0] == "done"

    # Then a companion of that earlier configuration, restarted, is refused
    assert store([_entry("a")], "h1", writer="old", force=False)[0] == "older"
    # and rows read before the beat_schedule was stored do not come back either
    assert store([_entry("a", 30.0)], "h3", writer="rows", force=False, made=100)[0] == "older"
    assert periodic_store.snapshot().definitions["a"] == _entry("a", 20.0)


def _row(name: str, seconds: float = 10.0, *, shown: str | None = None) -> Definition:
    """A django-celery-beat row as this release stores it: its source, its admin name."""
    return from_beat_entry(
        name,
        {"task": "tests.record", "schedule": seconds},
        source=SOURCE_DJANGO_BEAT,
        display_name=shown or name.replace("_", " "),
    )


def test_a_row_no_longer_read_is_removed_as_an_entry_no_longer_configured_is(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given rows stored from django-celery-beat, one added at run time, and
    # one stored by a release that wrote no source (read as "config")
    periodic_store = PeriodicStore(store_for(app))
    store = periodic_store.store_config
    store([_row("Every_second"), _row("Nightly")], "h1", writer="c", force=False, made=100)
    periodic_store.put(_entry("added", source=SOURCE_API), writer="api")
    redis_client.hset(periodic_store.keys.defs, "sourceless", '{"task":"tests.record"}')

    # When the rows are read again without "Nightly" (deleted in the admin)
    status, changed = store([_row("Every_second")], "h2", writer="c", force=False, made=200)

    # Then it is removed, as the one without a source; the one added at run time stays
    assert (status, sorted(changed)) == (
        "done",
        [("removed", "Nightly"), ("removed", "sourceless")],
    )
    assert sorted(periodic_store.snapshot().definitions) == ["Every_second", "added"]


def test_a_definition_shown_or_owned_otherwise_keeps_its_version_pointer_and_occurrences(
    app: Celery,
) -> None:
    # Given a row stored as the release before stored it (source "config",
    # no display name), with its occurrences parked by a pass
    server = server_for(app, {"Every_second": {"task": "tests.record", "schedule": 1.0}})
    assert server.reconcile() == "done"
    assert tend(server) > 0
    periodic_store = server.periodic
    pointer = periodic_store.snapshot().pointers["Every_second"]
    parked = parked_ids(periodic_store.store.client, "Every_second")
    assert parked
    assert pointer.version == 1

    # When this release stores it under its admin name and its own source
    after = _row("Every_second", 1.0, shown="Every second")
    status, changed = periodic_store.store_config(
        [after], "h2", writer="new", force=False, made=100, reading=2
    )

    # Then it is relabelled: the new text stored, the same version, pointer
    # and parked occurrences (no phase started again, nothing withdrawn)
    assert (status, changed) == ("done", [("relabelled", "Every_second")])
    snap = periodic_store.snapshot()
    assert snap.definitions["Every_second"] == after
    assert snap.pointers["Every_second"] == pointer
    assert parked_ids(periodic_store.store.client, "Every_second") == parked
    assert snap.to_cancel == []
    # and an added run-time entry taken over by the configuration likewise
    periodic_store.put(_entry("x", source=SOURCE_API), writer="api")
    assert periodic_store.put(_entry("x"), writer="c") is True
    assert _versions(periodic_store)["x"] == 1
    # but a change of what runs or when is a change: a new version
    edited = from_beat_entry(
        "Every_second",
        {"task": "tests.record", "schedule": 1.0, "args": [1]},
        source=SOURCE_DJANGO_BEAT,
        display_name="Every second",
    )
    assert periodic_store.put(edited, writer="c")
    assert _versions(periodic_store)["Every_second"] == 2
    assert periodic_store.put(_row("Every_second", 2.0, shown="Every second"), writer="c")
    assert _versions(periodic_store)["Every_second"] == 3


def test_rows_read_otherwise_by_a_later_release_replace_an_earlier_reading_of_them(
    app: Celery,
) -> None:
    # Given rows stored by the release before, read at marker 100 (reading 1)
    periodic_store = PeriodicStore(store_for(app))
    store = periodic_store.store_config
    old = [from_beat_entry("Every_second", {"task": "tests.record", "schedule": 1.0})]
    assert store(old, "h1", writer="old", force=False, made=100, reading=1)[0] == "done"

    # When this release reads the same rows (same marker), then its reading is stored
    new = [_row("Every_second", 1.0)]
    assert store(new, "h2", writer="new", force=False, made=100, reading=2) == (
        "done",
        [("relabelled", "Every_second")],
    )
    # and the release before, restarted, does not store its reading back at that marker
    assert store(old, "h1", writer="old", force=False, made=100, reading=1)[0] == "older"
    # nor does another reading of this release at that marker (not stored over each other)
    assert (
        store([_row("Every_second", 5.0)], "h3", writer="x", force=False, made=100, reading=2)[0]
        == "older"
    )
    assert periodic_store.snapshot().definitions["Every_second"] == new[0]

    # When the release before stores an edit (marker 200) with its own
    # script, which leaves the reading field as it was
    assert store(old, "h4", writer="old", force=False, made=200, reading=1)[0] == "done"
    periodic_store.store.client.hset(periodic_store.keys.meta, "reading", "2 h2")
    # Then this release's reading of that edit is stored over it all the same
    assert store(new, "h5", writer="new", force=False, made=200, reading=2)[0] == "done"
    assert periodic_store.snapshot().definitions["Every_second"] == new[0]
