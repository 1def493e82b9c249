"""A configuration stored as its changes stores what the whole one would.

Pins ``define.lua``'s "diff" mode (see its header, "A configuration as its
changes") through :class:`PeriodicStore` on a private Redis, no worker or
companion: twin stores, one given each configuration whole and one its
changes, hold the same definitions, versions, pointers, pause state, visits
and meta after every random edit; a diff made against a configuration no
longer stored as it was left (another stored since, an entry added or
removed at run time, by this release or one before it) is refused with
nothing written and the whole configuration is stored instead; one that is
older is refused as the whole one is; removals, re-adds and relabels
through a diff are what they are whole. A kill test of ``define.lua``
(docs/mutation.rst).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

from celery_zdelay import periodic
from celery_zdelay.parking import store_for
from celery_zdelay.periodic.definition import (
    SOURCE_API,
    SOURCE_DJANGO_BEAT,
    Definition,
    from_beat_entry,
)
from celery_zdelay.periodic.server import PeriodicServer
from celery_zdelay.periodic.store import PeriodicStore
from tests.support.clock import redis_ms
from tests.support.periodic import parked_ids, server_for, tend

pytestmark = pytest.mark.timeout(120)

#: A configuration as the tests give it: definitions, kept and withdrawn reasons, since.
Config = tuple[list[Definition], dict[str, str], dict[str, str], dict[str, int | str]]


def _row(name: str, seconds: float = 10.0, shown: str | None = None) -> Definition:
    return from_beat_entry(
        name,
        {"task": "tests.record", "schedule": seconds},
        source=SOURCE_DJANGO_BEAT,
        display_name=shown or name,
    )


def _api(name: str, seconds: float = 7.0) -> Definition:
    return from_beat_entry(name, {"task": "tests.record", "schedule": seconds}, source=SOURCE_API)


class Recorder:
    """Wrap a store's define calls: (mode, status) of each, in order."""

    def __init__(self, periodic_store: PeriodicStore) -> None:
        self.calls: list[tuple[str, str]] = []
        wrapped = periodic_store._define_call

        def call(args: list[Any]) -> tuple[str, list[tuple[str, str]]]:
            reply = wrapped(args)
            self.calls.append((str(args[0]), reply[0]))
            return reply

        periodic_store._define_call = call  # type: ignore[method-assign]

    def take(self) -> list[tuple[str, str]]:
        calls, self.calls = self.calls, []
        return calls


def _store(
    periodic_store: PeriodicStore,
    config: Config,
    config_hash: str,
    *,
    made: int | None,
    incremental: bool,
) -> tuple[str, list[tuple[str, str]]]:
    definitions, keep, withdraw, since = config
    status, changed = periodic_store.store_config(
        definitions,
        config_hash,
        writer="c",
        force=False,
        keep=keep,
        withdraw=withdraw,
        since=since,
        made=made,
        reading=2,
        incremental=incremental,
    )
    return status, sorted(changed)


def _dump(periodic_store: PeriodicStore, windows: list[tuple[int, int]]) -> dict[str, Any]:
    """Everything define.lua writes, each time it took from Redis's clock named by its call."""

    def when(ms: float) -> Any:
        for step, (since, until) in enumerate(windows):
            if since <= ms <= until:
                return f"call {step}"
        return ms

    client, k = periodic_store.store.client, periodic_store.keys
    pointers = {}
    for name, raw in client.hgetall(k.pointers).items():
        record = json.loads(raw)
        record["ms"] = when(record["ms"])
        pointers[name] = record
    meta = {f.decode(): v.decode() for f, v in client.hgetall(k.meta).items()}
    meta["written_ms"] = when(int(meta.get("written_ms", 0)))
    meta["unserved"] = json.loads(meta.get("unserved", "{}"))
    return {
        "defs": client.hgetall(k.defs),
        "versions": client.hgetall(k.versions),
        "pointers": pointers,
        "paused": client.smembers(k.paused),
        "cancel": client.smembers(k.cancel),
        "meta": meta,
        "superseded": client.smembers(k.superseded),
        "visits": {n: when(s) for n, s in client.zrange(k.visits, 0, -1, withscores=True)},
    }


def _random_config(rng: random.Random, now_ms: int) -> Config:
    """Rows of a pool of ten, each absent, a row (often as it was), kept or withdrawn."""
    definitions: list[Definition] = []
    keep: dict[str, str] = {}
    withdraw: dict[str, str] = {}
    since: dict[str, int | str] = {}
    for i in range(10):
        name = f"row{i}"
        kind = rng.choice(["row", "row", "row", "row", "absent", "keep", "withdraw"])
        if kind == "row":
            # The same row most of the time; else edited, or only shown otherwise.
            definitions.append(
                _row(name, rng.choice([10.0, 10.0, 10.0, 20.0]), rng.choice([None, None, "Shown"]))
            )
            if rng.random() < 0.3:
                since[name] = rng.choice([now_ms - 3_600_000, f"={now_ms - 1_800_000}"])
        elif kind == "keep":
            keep[name] = rng.choice(["no module", "gone"])
        elif kind == "withdraw":
            withdraw[name] = rng.choice(["bad row", "bad crontab"])
    if rng.random() < 0.3:
        # The configuration takes over the name an entry added at run time has.
        definitions.append(_row("shared"))
    for definition in definitions:
        if rng.random() < 0.15:
            # A row whose schedule name another row has: a definition and a reason.
            withdraw[definition.name] = rng.choice(["same name", "taken"])
    return definitions, keep, withdraw, since


Twins = tuple[PeriodicStore, PeriodicStore, dict[str, list[tuple[int, int]]]]


@pytest.fixture
def twins(make_test_app: Callable[..., Celery]) -> Twins:
    """Two stores on one Redis (their own key prefixes), each with the same run-time state.

    With the span of Redis's clock each took its state in ("whole", "diff").
    """
    windows: dict[str, list[tuple[int, int]]] = {}
    stores = []
    for prefix in ("whole", "diff"):
        periodic_store = PeriodicStore(store_for(make_test_app(conf={"zdelay_key_prefix": prefix})))
        before = redis_ms(periodic_store.store.client)
        periodic_store.put(_api("added"), writer="api")
        periodic_store.put(_api("shared"), writer="api")
        windows[prefix] = [(before, redis_ms(periodic_store.store.client))]
        stores.append(periodic_store)
    return stores[0], stores[1], windows


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("rows", [True, False], ids=["rows", "beat_schedule"])
def test_random_edits_stored_as_their_changes_leave_what_the_whole_configuration_leaves(
    twins: Twins, seed: int, rows: bool
) -> None:
    # Given twin stores, one given each configuration whole and one its changes
    whole, diff, windows = twins
    rng = random.Random(seed)
    client = whole.store.client
    now_ms = redis_ms(client)
    recorder = Recorder(diff)
    configs: list[tuple[Config, str]] = []
    for step in range(12):
        # When a random edit is stored (now and then one stored before: a
        # beat_schedule's superseded fingerprint, rows read again)
        if configs and rng.random() < 0.15:
            config, config_hash = rng.choice(configs)
        else:
            config, config_hash = _random_config(rng, now_ms), f"h{step}"
            configs.append((config, config_hash))
        made = 100 + step if rows else None
        replies = []
        for side, periodic_store, incremental in (("whole", whole, False), ("diff", diff, True)):
            before = redis_ms(client)
            replies.append(
                _store(periodic_store, config, config_hash, made=made, incremental=incremental)
            )
            windows[side].append((before, redis_ms(client)))
        # Then both say the same, and hold the same
        assert replies[0] == replies[1], f"step {step}"
        assert _dump(whole, windows["whole"]) == _dump(diff, windows["diff"]), f"step {step}"
    # and the changes were sent as changes, not only whole
    modes = recorder.take()
    assert ("diff", "done") in modes
    assert ("config", "done") in modes[:1]


def test_a_diff_against_a_store_changed_since_is_refused_with_nothing_written(
    app: Celery,
) -> None:
    # Given a configuration stored, then an entry added at run time
    periodic_store = PeriodicStore(store_for(app))
    config: Config = ([_row("a"), _row("b")], {}, {}, {})
    assert _store(periodic_store, config, "h1", made=100, incremental=True)[0] == "done"
    periodic_store.put(_api("x"), writer="api")
    before = _dump(periodic_store, [])

    # When the changes from it are sent (as a companion that stored it would)
    reply = periodic_store._define_call(
        ["diff", "h2", "0", "c", 200, 2, "h1", "a", _row("a", 20.0).body(), ""]
    )

    # Then they are refused ("stale") and nothing is written
    assert reply == ("stale", [("", "h1")])
    assert _dump(periodic_store, []) == before
    # and so are changes from a configuration that is not the stored one,
    # though nothing was written since that one
    periodic_store.store_config(
        [_row("a"), _row("b", 30.0)], "h3", writer="c", force=False, made=300, reading=2
    )
    before = _dump(periodic_store, [])
    reply = periodic_store._define_call(
        ["diff", "h4", "0", "c", 400, 2, "h1", "a", _row("a", 20.0).body(), ""]
    )
    assert reply == ("stale", [("", "h3")])
    assert _dump(periodic_store, []) == before
    # and, from the stored one, when its unserved entries cannot be read
    # (stored otherwise than as an object of reasons)
    client, meta = periodic_store.store.client, periodic_store.keys.meta
    for unreadable in ('"reasons"', "{not json"):
        client.hset(meta, "unserved", unreadable)
        before = _dump_raw(periodic_store)
        reply = periodic_store._define_call(
            ["diff", "h4", "0", "c", 400, 2, "h3", "a", _row("a", 20.0).body(), ""]
        )
        assert reply == ("stale", [("", "h3")])
        assert _dump_raw(periodic_store) == before
    # while a readable one takes the changes
    client.hset(meta, "unserved", "{}")
    reply = periodic_store._define_call(
        ["diff", "h4", "0", "c", 400, 2, "h3", "a", _row("a", 20.0).body(), ""]
    )
    assert reply == ("done", [("changed", "a")])


def _dump_raw(periodic_store: PeriodicStore) -> dict[str, Any]:
    """What :func:`_dump` reads, the meta hash as stored (its "unserved" not read as JSON)."""
    client, k = periodic_store.store.client, periodic_store.keys
    return {"meta": client.hgetall(k.meta), "defs": client.hgetall(k.defs)}


@pytest.mark.parametrize(
    "between",
    [
        "put",
        "put over a row",
        "put relabelling a row",
        "drop",
        "drop and put",
        "drop and old put",
        "old drop",
        "old put",
    ],
)
def test_a_change_at_run_time_between_two_stores_makes_the_next_one_whole(
    app: Celery, redis_client: redis.Redis, between: str
) -> None:
    # Given rows stored by a companion
    periodic_store = PeriodicStore(store_for(app))
    recorder = Recorder(periodic_store)
    config: Config = ([_row("a"), _row("b")], {}, {}, {})
    assert _store(periodic_store, config, "h1", made=100, incremental=True)[0] == "done"
    k = periodic_store.keys

    # When, before the next edit is stored, an entry is added or removed at
    # run time (by this release, or by one before it, which counts no write)
    other = PeriodicStore(store_for(app))
    if between == "put":
        other.put(_api("x"), writer="api")
    elif between == "put over a row":
        other.put(_api("a"), writer="api")
    elif between == "put relabelling a row":
        # The same schedule, owned otherwise: relabelled, not changed (define.lua)
        other.put(_api("a", 10.0), writer="api")
    elif between == "drop":
        assert other.drop(["a"]) == ["a"]
    elif between == "drop and put":
        # As many definitions as before: only the counter sees it.
        assert other.drop(["a"]) == ["a"]
        other.put(_api("x"), writer="api")
    elif between == "drop and old put":
        # Likewise, the put by a release that counts no write.
        assert other.drop(["a"]) == ["a"]
        redis_client.hset(k.defs, "x", _api("x").body())
    elif between == "old drop":
        redis_client.hdel(k.defs, "a")
        redis_client.hdel(k.pointers, "a")
        redis_client.zrem(k.visits, "a")
    else:
        redis_client.hset(k.defs, "x", _api("x").body())
    recorder.take()
    edited: Config = ([_row("a"), _row("b", 20.0)], {}, {}, {})
    status, changed = _store(periodic_store, edited, "h2", made=200, incremental=True)

    # Then the changes are refused and the whole configuration is stored:
    # the row removed or replaced at run time is the configuration's again
    assert recorder.take() == [("diff", "stale"), ("config", "done")]
    assert status == "done"
    assert ("changed", "b") in changed
    stored = periodic_store.snapshot().definitions
    assert stored["a"] == _row("a")
    # and the store after it takes changes again
    again: Config = ([_row("a", 30.0), _row("b", 20.0)], {}, {}, {})
    assert _store(periodic_store, again, "h3", made=300, incremental=True) == (
        "done",
        [("changed", "a")],
    )
    assert recorder.take() == [("diff", "done")]


def test_a_diff_from_an_older_configuration_is_refused_as_the_whole_one_is(
    app: Celery,
) -> None:
    # Given two companions that stored the same rows, and one that stored an edit since
    first, second = PeriodicStore(store_for(app)), PeriodicStore(store_for(app))
    rows: Config = ([_row("a"), _row("b")], {}, {}, {})
    assert _store(first, rows, "h1", made=100, incremental=True)[0] == "done"
    assert _store(second, rows, "h1", made=100, incremental=True)[0] == "same"
    edited: Config = ([_row("a", 20.0), _row("b")], {}, {}, {})
    assert _store(first, edited, "h2", made=300, incremental=True)[0] == "done"
    recorder = Recorder(second)

    # When the other sends an edit it read before that one
    stale_read: Config = ([_row("a"), _row("b", 20.0)], {}, {}, {})
    reply = _store(second, stale_read, "h3", made=200, incremental=True)

    # Then it is refused as older, by the diff itself, and nothing changes
    assert reply == ("older", [("", "h2")])
    assert recorder.take() == [("diff", "older")]
    assert periodic_store_defs(first) == {"a": _row("a", 20.0), "b": _row("b")}
    # and a beat_schedule replaced once likewise
    assert _store(second, edited, "h2", made=None, incremental=True)[0] == "same"
    assert _store(second, rows, "h1", made=None, incremental=True) == ("older", [("", "h2")])
    # (after a refusal the companion sends the next one whole: it knows no stored one)
    assert recorder.take() == [("config", "same"), ("diff", "older")]


def periodic_store_defs(periodic_store: PeriodicStore) -> dict[str, Definition]:
    return periodic_store.snapshot().definitions


def _rows_server(app: Celery) -> PeriodicServer:
    """A companion's periodic part whose passes plan the rows stored by the
    test, not its own (empty) ``beat_schedule``."""
    server = server_for(app, {})
    server._last_check = time.monotonic() + 3600
    return server


def test_a_row_removed_and_added_again_through_diffs_withdraws_and_gets_a_new_version(
    app: Celery,
) -> None:
    # Given rows stored, their occurrences parked by a pass
    server = _rows_server(app)
    periodic_store = server.periodic
    withdrawn: list[str] = []
    periodic_store.on_withdrawn = withdrawn.extend
    rows: Config = ([_row("a", 1.0), _row("b", 1.0)], {}, {}, {})
    assert _store(periodic_store, rows, "h1", made=100, incremental=True)[0] == "done"
    assert tend(server) > 0
    parked = parked_ids(periodic_store.store.client, "b")
    assert parked
    recorder = Recorder(periodic_store)

    # When one is deleted, then added again
    one: Config = ([_row("a", 1.0)], {}, {}, {})
    removed = _store(periodic_store, one, "h2", made=200, incremental=True)
    snap = periodic_store.snapshot()
    back = _store(periodic_store, rows, "h3", made=300, incremental=True)

    # Then, through diffs, its occurrences are withdrawn and it comes back
    # under a version never given before
    assert recorder.take() == [("diff", "done"), ("diff", "done")]
    assert removed == ("done", [("removed", "b")])
    assert "b" not in snap.definitions
    assert "b" not in snap.pointers
    assert parked_ids(periodic_store.store.client, "b") == set()
    assert set(withdrawn) >= parked
    assert back == ("done", [("new", "b")])
    assert periodic_store.snapshot().pointers["b"].version == 2


def test_a_row_shown_otherwise_through_a_diff_is_relabelled_keeping_its_occurrences(
    app: Celery,
) -> None:
    # Given a row stored, its occurrences parked by a pass
    server = _rows_server(app)
    periodic_store = server.periodic
    rows: Config = ([_row("a", 1.0), _row("b", 1.0)], {}, {}, {})
    assert _store(periodic_store, rows, "h1", made=100, incremental=True)[0] == "done"
    assert tend(server) > 0
    pointer = periodic_store.snapshot().pointers["a"]
    parked = parked_ids(periodic_store.store.client, "a")
    recorder = Recorder(periodic_store)

    # When it is renamed in the admin
    renamed = _row("a", 1.0, shown="Every second")
    status, changed = _store(
        periodic_store, ([renamed, _row("b", 1.0)], {}, {}, {}), "h2", made=200, incremental=True
    )

    # Then the diff relabels it: the new text, the same version, pointer and occurrences
    assert recorder.take() == [("diff", "done")]
    assert (status, changed) == ("done", [("relabelled", "a")])
    snap = periodic_store.snapshot()
    assert snap.definitions["a"] == renamed
    assert snap.pointers["a"] == pointer
    assert parked_ids(periodic_store.store.client, "a") == parked


def test_a_pause_between_two_stores_does_not_make_the_next_one_whole(app: Celery) -> None:
    # Given rows stored, one of them then paused (no definition written)
    periodic_store = PeriodicStore(store_for(app))
    recorder = Recorder(periodic_store)
    rows: Config = ([_row("a"), _row("b")], {}, {}, {})
    assert _store(periodic_store, rows, "h1", made=100, incremental=True)[0] == "done"
    assert periodic.pause("a", app=app)

    # When an edit is stored
    edited: Config = ([_row("a", 20.0), _row("b")], {}, {}, {})
    reply = _store(periodic_store, edited, "h2", made=200, incremental=True)

    # Then as changes: the paused row changed, still paused, not visited
    assert reply == ("done", [("changed", "a")])
    assert recorder.take() == [("config", "done"), ("diff", "done")]
    snap = periodic_store.snapshot()
    assert snap.paused == {"a"}
    assert periodic_store.store.client.zscore(periodic_store.keys.visits, "a") is None


def test_an_entry_added_at_run_time_stays_under_a_name_a_diff_withdraws_or_no_longer_names(
    app: Celery,
) -> None:
    # Given an entry added at run time, and rows that name it as a bad row
    periodic_store = PeriodicStore(store_for(app))
    periodic_store.put(_api("added"), writer="api")
    recorder = Recorder(periodic_store)
    withdrawn: Config = ([_row("a")], {}, {"added": "bad row"}, {})
    assert _store(periodic_store, withdrawn, "h1", made=100, incremental=True)[0] == "done"

    # When the rows no longer name it, then name it as a bad row again
    gone = _store(periodic_store, ([_row("a")], {}, {}, {}), "h2", made=200, incremental=True)
    after_gone = periodic_store.snapshot()
    again = _store(periodic_store, withdrawn, "h3", made=300, incremental=True)

    # Then, through diffs, the entry added at run time stays as it is,
    # as the whole configuration leaves it; only the reasons change
    assert recorder.take() == [("config", "done"), ("diff", "done"), ("diff", "done")]
    assert gone == again == ("done", [])
    assert after_gone.definitions["added"] == _api("added")
    assert periodic_store.unserved() == {"added": "bad row"}
    assert periodic_store.snapshot().definitions["added"] == _api("added")


def test_a_put_or_drop_that_changes_nothing_between_two_stores_keeps_the_next_one_a_diff(
    app: Celery,
) -> None:
    # Given rows stored, and an entry added at run time that is added again
    # as it is, and a name never stored removed
    periodic_store = PeriodicStore(store_for(app))
    periodic_store.put(_api("x"), writer="api")
    recorder = Recorder(periodic_store)
    rows: Config = ([_row("a"), _row("b")], {}, {}, {})
    assert _store(periodic_store, rows, "h1", made=100, incremental=True)[0] == "done"
    assert periodic_store.put(_api("x"), writer="api") is False
    assert periodic_store.drop(["never-stored"]) == []
    assert recorder.take() == [("config", "done"), ("put", "done"), ("drop", "done")]

    # When an edit is stored
    edited: Config = ([_row("a", 20.0), _row("b")], {}, {}, {})
    reply = _store(periodic_store, edited, "h2", made=200, incremental=True)

    # Then as its changes: nothing was written in between
    assert reply == ("done", [("changed", "a")])
    assert recorder.take() == [("diff", "done")]


def test_a_row_stored_with_a_reason_under_its_name_stays_as_its_reason_changes(
    app: Celery,
) -> None:
    # Given a row stored under a name another row's reason names too (that
    # row's schedule name is taken by it)
    periodic_store = PeriodicStore(store_for(app))
    recorder = Recorder(periodic_store)
    both: Config = ([_row("a"), _row("b")], {}, {"a": "taken"}, {})
    assert _store(periodic_store, both, "h1", made=100, incremental=True) == (
        "done",
        [("new", "a"), ("new", "b")],
    )
    version = periodic_store.snapshot().pointers["a"].version

    # When the reason changes, then goes, through diffs
    other_reason: Config = ([_row("a"), _row("b")], {}, {"a": "taken again"}, {})
    changed = _store(periodic_store, other_reason, "h2", made=200, incremental=True)
    unserved = periodic_store.unserved()
    gone = _store(
        periodic_store, ([_row("a"), _row("b")], {}, {}, {}), "h3", made=300, incremental=True
    )

    # Then the row stays as it was stored, and only the reasons change
    assert recorder.take() == [("config", "done"), ("diff", "done"), ("diff", "done")]
    assert changed == gone == ("done", [])
    assert unserved == {"a": "taken again"}
    assert periodic_store.unserved() == {}
    snap = periodic_store.snapshot()
    assert snap.definitions["a"] == _row("a")
    assert snap.pointers["a"].version == version
