"""A periodic occurrence is parked once, by a current version of a running schedule.

Pins the lines of ``periodic/lua/park_once.lua`` and of the pointer reader
``periodic/lua/_pointer.lua`` it shares with ``define.lua`` and
``pause.lua`` (see docs/mutation.rst), through :class:`PeriodicStore` on a
private Redis, no worker or companion.

``park_once.lua``: the occurrence parked is the one the call names (with or
without a template in front of it, ``ARGV[4 + 2 * n]``), remembered in the
shard's ticks set at the Redis time it was parked, never parked again while
remembered, forgotten once older than the memory (``ZREMRANGEBYSCORE`` up
to now minus the memory, not beyond); an occurrence of a paused schedule,
of a version that is no longer current or of a schedule whose pointer
cannot be read is refused (no error, nothing written); and a key of another
type refuses the call with the fix, before the tick is written, so that an
occurrence refused once is parked by the next call.

``_pointer.lua``: a pause takes back every occurrence the pointer lists; a
change takes back those due and those ahead, and goes on from the earliest
one due (``ms <= now``, the very millisecond included) or, with none due,
from now; a pointer that cannot be read, or lists what is not an
occurrence (not a pair, an id that is not a string, a time that is not a
number), stops neither a pause nor a change, and the occurrences it does
list are still taken back. The companion's own reader of pointers
(:meth:`Pointer.from_json`, in :meth:`PeriodicStore.snapshot`) leaves such
a pointer out too, and reads every other schedule.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import redis
from celery import Celery

from celery_zdelay.parking import store_for
from celery_zdelay.periodic.definition import Definition, from_beat_entry
from celery_zdelay.periodic.server import PeriodicServer, occurrence_id
from celery_zdelay.periodic.store import PeriodicStore
from celery_zdelay.schedule import Due
from celery_zdelay.store import ParkRequest
from tests.support.clock import redis_ms
from tests.support.keys import SHARD0, refused_while_written_over

pytestmark = pytest.mark.timeout(60)

HOUR_MS = 3_600_000
TICKS = SHARD0.ticks


def _entry(seconds: float = 600.0, name: str = "a") -> Definition:
    return from_beat_entry(name, {"task": "tests.record", "schedule": seconds})


def _defined(app: Celery) -> PeriodicServer:
    """Schedule "a" stored (version 1), nothing parked yet."""
    app.conf.beat_schedule = {}
    server = PeriodicServer(app, store_for(app), companion_id="c")
    assert server.periodic.put(_entry(), writer="api")
    return server


def _request(server: PeriodicServer, task_id: str, ms: int, *, template: bool) -> ParkRequest:
    """The request that parks *task_id* at *ms*: as a companion builds it, or in one part."""
    if not template:
        return ParkRequest(task_id, Due("a", ms), b'{"v":1}\nbody')
    definition = server.periodic.snapshot().definitions["a"]
    (request,) = server._requests(definition, task_id, ms)
    assert request.template is not None
    return request


def _ticks(client: redis.Redis) -> dict[str, int]:
    return {m.decode(): int(s) for m, s in client.zrange(TICKS, 0, -1, withscores=True)}


def _parked(client: redis.Redis) -> set[str]:
    return {m.decode() for m in client.zrange(SHARD0.due, 0, -1)}


# -- park_once.lua --------------------------------------------------------------


@pytest.mark.parametrize("template", [True, False], ids=["template", "one-part"])
def test_an_occurrence_is_parked_once_and_remembered_from_when_it_was_parked(
    app: Celery, redis_client: redis.Redis, template: bool
) -> None:
    server = _defined(app)
    periodic = server.periodic
    tick = redis_ms(redis_client) + HOUR_MS
    first, second = occurrence_id("a", 1, tick), occurrence_id("a", 1, tick + 600_000)

    before = redis_ms(redis_client)
    assert (
        periodic.park_once(_request(server, first, tick, template=template), occurrence_ms=tick)
        is True
    )
    after = redis_ms(redis_client)
    assert _parked(redis_client) == {first}
    remembered = _ticks(redis_client)
    assert list(remembered) == [first]
    assert before <= remembered[first] <= after

    # Parked again, even by a companion that would park it elsewhere: refused
    assert (
        periodic.park_once(
            _request(server, first, tick + 1, template=template), occurrence_ms=tick + 1
        )
        is False
    )
    assert _ticks(redis_client) == remembered

    # Another occurrence parks, and parking it forgets nothing recent
    assert periodic.park_once(
        _request(server, second, tick + 600_000, template=template), occurrence_ms=tick + 600_000
    )
    assert set(_ticks(redis_client)) == {first, second}
    assert _ticks(redis_client)[first] == remembered[first]
    assert _parked(redis_client) == {first, second}
    # Gone from the due set since (as once released): still not parked again
    periodic.store.cancel([first])
    assert (
        periodic.park_once(_request(server, first, tick, template=template), occurrence_ms=tick)
        is False
    )
    assert _parked(redis_client) == {second}


def test_an_occurrence_refused_as_parked_before_keeps_its_due_time(
    app: Celery, redis_client: redis.Redis
) -> None:
    server = _defined(app)
    tick = redis_ms(redis_client) + HOUR_MS
    first = occurrence_id("a", 1, tick)
    assert server.periodic.park_once(
        _request(server, first, tick, template=True), occurrence_ms=tick
    )
    score = redis_client.zscore(SHARD0.due, first)

    assert (
        server.periodic.park_once(
            _request(server, first, tick + 5_000, template=True), occurrence_ms=tick + 5_000
        )
        is False
    )

    assert redis_client.zscore(SHARD0.due, first) == score


def test_the_memory_forgets_only_what_was_parked_longer_ago_than_it_keeps(
    app: Celery, redis_client: redis.Redis
) -> None:
    server = _defined(app)
    periodic = server.periodic
    now = redis_ms(redis_client)
    old, kept = occurrence_id("a", 1, now - 2 * HOUR_MS), occurrence_id("a", 1, now - HOUR_MS)
    redis_client.zadd(TICKS, {old: now - HOUR_MS - 60_000, kept: now - HOUR_MS + 60_000})
    tick = now + HOUR_MS
    new = occurrence_id("a", 1, tick)

    assert periodic.park_once(_request(server, new, tick, template=True), occurrence_ms=tick)

    assert set(_ticks(redis_client)) == {kept, new}
    # Forgotten: a stalled companion could park it again (the memory's bound)
    assert periodic.park_once(
        _request(server, old, now + 2 * HOUR_MS, template=True), occurrence_ms=now + 2 * HOUR_MS
    )
    assert (
        periodic.park_once(
            _request(server, kept, now + 2 * HOUR_MS, template=True),
            occurrence_ms=now + 2 * HOUR_MS,
        )
        is False
    )

    # A shorter memory forgets sooner, counted from when each was parked
    periodic.tick_memory_ms = 1
    deadline = time.monotonic() + 10
    while redis_ms(redis_client) <= max(_ticks(redis_client).values()) + 1:
        assert time.monotonic() < deadline
    later = occurrence_id("a", 1, tick + 600_000)
    assert periodic.park_once(
        _request(server, later, tick + 600_000, template=True), occurrence_ms=tick + 600_000
    )
    assert set(_ticks(redis_client)) == {later}
    assert periodic.park_once(_request(server, new, tick, template=True), occurrence_ms=tick)


def test_an_occurrence_of_a_paused_schedule_or_an_old_version_is_refused(
    app: Celery, redis_client: redis.Redis
) -> None:
    server = _defined(app)
    periodic = server.periodic
    tick = redis_ms(redis_client) + HOUR_MS
    v1, v2 = occurrence_id("a", 1, tick), occurrence_id("a", 2, tick)

    assert periodic.set_paused("a", True) == 1
    assert (
        periodic.park_once(_request(server, v1, tick, template=True), occurrence_ms=tick) is False
    )
    assert periodic.set_paused("a", False) == 1  # resumed under version 2
    assert (
        periodic.park_once(_request(server, v1, tick, template=True), occurrence_ms=tick) is False
    )
    assert (_parked(redis_client), _ticks(redis_client)) == (set(), {})

    assert periodic.park_once(_request(server, v2, tick, template=True), occurrence_ms=tick) is True
    assert _parked(redis_client) == {v2}
    # An id that names no schedule is not checked against one
    assert periodic.park_once(
        _request(server, "not-periodic", tick, template=False), occurrence_ms=tick
    )
    assert _parked(redis_client) == {v2, "not-periodic"}


@pytest.mark.parametrize(
    "pointer",
    ["not json", "7", "null", '"a"', '{"ms": 5}', '{"v": "1x", "ms": 5}', None],
    ids=["not-json", "number", "null", "string", "no-version", "other-version", "none"],
)
def test_an_occurrence_of_a_schedule_whose_pointer_cannot_be_read_is_refused(
    app: Celery, redis_client: redis.Redis, pointer: str | None
) -> None:
    server = _defined(app)
    periodic = server.periodic
    tick = redis_ms(redis_client) + HOUR_MS
    request = _request(server, occurrence_id("a", 1, tick), tick, template=True)
    if pointer is None:
        redis_client.hdel(periodic.keys.pointers, "a")
    else:
        redis_client.hset(periodic.keys.pointers, "a", pointer)

    assert periodic.park_once(request, occurrence_ms=tick) is False

    assert (_parked(redis_client), _ticks(redis_client)) == (set(), {})


@pytest.mark.parametrize(
    ("key", "kind"),
    [
        (SHARD0.due, "zset"),
        (SHARD0.msg, "hash"),
        (SHARD0.templates, "hash"),
        (SHARD0.dests, "set"),
        (SHARD0.lease, "zset"),
        (SHARD0.leased, "hash"),
        (TICKS, "zset"),
        ("pointers", "hash"),
        ("paused", "set"),
    ],
    ids=["due", "msg", "templates", "dests", "lease", "leased", "ticks", "pointers", "paused"],
)
def test_a_key_of_another_type_refuses_the_park_before_the_tick_is_written(
    app: Celery, redis_client: redis.Redis, key: str, kind: str
) -> None:
    server = _defined(app)
    periodic = server.periodic
    key = {"pointers": periodic.keys.pointers, "paused": periodic.keys.paused}.get(key, key)
    tick = redis_ms(redis_client) + HOUR_MS
    request = _request(server, occurrence_id("a", 1, tick), tick, template=True)
    with refused_while_written_over(redis_client, key, kind):
        periodic.park_once(request, occurrence_ms=tick)

    assert (_parked(redis_client), _ticks(redis_client)) == (set(), {})
    # Refused, not remembered: the next pass parks it
    assert periodic.park_once(request, occurrence_ms=tick) is True
    assert _parked(redis_client) == {request.task_id}


def test_an_occurrence_is_listed_in_its_pointer_as_it_is_parked_and_counted_once(
    app: Celery, redis_client: redis.Redis
) -> None:
    server = _defined(app)
    periodic = server.periodic
    tick = redis_ms(redis_client) + HOUR_MS
    planned = [
        (tick, occurrence_id("a", 1, tick)),
        (tick + 600_000, occurrence_id("a", 1, tick + 600_000)),
    ]
    for ms, task_id in planned:
        # Due 7 ms after its time (a jitter offset): listed at its time
        request = _request(server, task_id, ms + 7, template=True)
        assert periodic.park_once(request, occurrence_ms=ms)

    pointer = periodic.snapshot().pointers["a"]
    assert (pointer.parked, pointer.runs) == (planned, 2)
    # The planner's record of them (advance.lua) lists and counts none again
    assert periodic.advance("a", 1, tick + 600_000, planned, redis_ms(redis_client)) == "done"
    pointer = periodic.snapshot().pointers["a"]
    assert (pointer.parked, pointer.runs) == (planned, 2)


@pytest.mark.parametrize("change", ["change", "pause"])
def test_an_occurrence_is_taken_back_by_a_change_before_its_planner_records_it(
    app: Celery, redis_client: redis.Redis, change: str
) -> None:
    # Breaks if: park_once.lua no longer lists the occurrence in its
    # schedule's pointer. A planner records what it parked (advance.lua) a
    # call after parking it; a change or pause landing in between took back
    # only what the pointer listed, and left this tick to run under a
    # version already replaced (seen once under load, 48 ms before a tick).
    server = _defined(app)
    periodic = server.periodic
    tick = redis_ms(redis_client) + HOUR_MS
    task_id = occurrence_id("a", 1, tick)
    assert periodic.park_once(_request(server, task_id, tick, template=True), occurrence_ms=tick)

    # When the schedule changes (or pauses) before the planner records it
    if change == "change":
        assert periodic.put(_entry(300.0), writer="api") is True
    else:
        assert periodic.set_paused("a", True) == 1

    # Then it is taken back: no companion can release it any more
    assert _parked(redis_client) == set()


# -- _pointer.lua (through pause.lua and define.lua) ------------------------------


def _listing(
    app: Celery, redis_client: redis.Redis, times: dict[str, int], extra: list[Any] | None = None
) -> PeriodicStore:
    """Schedule "a" whose pointer lists *times* (id -> ms), each parked at its time.

    *extra* goes in front of the listed pairs, as a bug or an older writer
    could have left it.
    """
    periodic = _defined(app).periodic
    for task_id, ms in times.items():
        periodic.store.park([ParkRequest(task_id, Due("a", ms), b'{"v":1}\nbody')])
    record = json.loads(redis_client.hget(periodic.keys.pointers, "a") or "")
    record["ids"] = [*(extra or []), *([ms, task_id] for task_id, ms in times.items())]
    redis_client.hset(periodic.keys.pointers, "a", json.dumps(record))
    return periodic


def test_a_pause_takes_back_every_occurrence_the_pointer_lists(
    app: Celery, redis_client: redis.Redis
) -> None:
    now = redis_ms(redis_client)
    times = {
        "due-1": now - 2_000,
        "due-2": now - 1_000,
        "ahead-1": now + HOUR_MS,
        "ahead-2": now + 2 * HOUR_MS,
    }
    periodic = _listing(app, redis_client, times)
    periodic.store.park([ParkRequest("unlisted", Due("a", now + HOUR_MS), b'{"v":1}\nbody')])

    assert periodic.set_paused("a", True) == 1

    assert _parked(redis_client) == {"unlisted"}


def test_a_change_takes_back_what_is_due_and_ahead_and_goes_on_from_the_earliest_due(
    app: Celery, redis_client: redis.Redis
) -> None:
    now = redis_ms(redis_client)
    times = {
        "ahead-1": now + HOUR_MS,
        "due-2": now - 1_000,
        "due-1": now - 2_000,
        "ahead-2": now + 2 * HOUR_MS,
    }
    periodic = _listing(app, redis_client, times)

    assert periodic.put(_entry(300.0), writer="api") is True

    assert _parked(redis_client) == set()
    pointer = periodic.snapshot().pointers["a"]
    assert (pointer.version, pointer.ms, pointer.inclusive) == (2, now - 2_000, True)


def test_a_change_with_nothing_due_goes_on_from_now_not_from_a_tick_ahead(
    app: Celery, redis_client: redis.Redis
) -> None:
    now = redis_ms(redis_client)
    periodic = _listing(app, redis_client, {"ahead-1": now + HOUR_MS, "ahead-2": now + 2 * HOUR_MS})

    assert periodic.put(_entry(300.0), writer="api") is True
    after = redis_ms(redis_client)

    assert _parked(redis_client) == set()
    pointer = periodic.snapshot().pointers["a"]
    assert pointer.inclusive is False
    assert now <= pointer.ms <= after


def test_an_occurrence_due_in_the_very_millisecond_of_a_change_is_due(
    app: Celery, redis_client: redis.Redis
) -> None:
    # The change's own clock (the configuration's written_ms) tells when it
    # ran: aimed at the millisecond of the occurrence until it lands there.
    periodic = _defined(app).periodic
    hits = 0
    deadline = time.monotonic() + 30
    attempt = 0
    while hits < 3 and time.monotonic() < deadline:
        attempt += 1
        tick = redis_ms(redis_client) + 3
        task_id = f"tick-{attempt}"
        periodic.store.park([ParkRequest(task_id, Due("a", tick), b'{"v":1}\nbody')])
        record = json.loads(redis_client.hget(periodic.keys.pointers, "a") or "")
        record["ids"] = [[tick, task_id]]
        redis_client.hset(periodic.keys.pointers, "a", json.dumps(record))
        seen = redis_ms(redis_client)
        while seen < tick:
            seen = redis_ms(redis_client)
        if seen > tick:
            periodic.store.cancel([task_id])  # the millisecond went by: aim again
            continue
        status, changed = periodic.store_config(
            [_entry(300.0 + attempt)], f"config-{attempt}", writer="c", force=False
        )
        assert (status, changed) == ("done", [("changed", "a")])
        ran = int(redis_client.hget(periodic.keys.meta, "written_ms") or 0)
        pointer = periodic.snapshot().pointers["a"]
        assert ran >= tick
        assert (pointer.ms, pointer.inclusive) == (tick, True), f"changed at {ran}, tick {tick}"
        hits += int(ran == tick)
    assert hits, "no change ran in its occurrence's millisecond within 30 s"


@pytest.mark.parametrize(
    "pointer",
    [
        "not json",
        "7",
        '{"v": 1, "ms": 5}',
        '{"v": 1, "ms": 5, "ids": "x"}',
    ],
    ids=["not-json", "number", "no-ids", "ids-not-a-list"],
)
def test_a_pointer_that_cannot_be_read_stops_neither_a_pause_nor_a_change(
    app: Celery, redis_client: redis.Redis, pointer: str
) -> None:
    periodic = _defined(app).periodic
    redis_client.hset(periodic.keys.pointers, "a", pointer)

    assert periodic.set_paused("a", True) == 1
    assert periodic.set_paused("a", False) == 1
    redis_client.hset(periodic.keys.pointers, "a", pointer)
    assert periodic.put(_entry(300.0), writer="api") is True
    assert periodic.snapshot().pointers["a"].inclusive is False


@pytest.mark.parametrize("change", ["pause", "change"])
def test_what_a_pointer_lists_that_is_not_an_occurrence_is_left_out(
    app: Celery, redis_client: redis.Redis, change: str
) -> None:
    now = redis_ms(redis_client)
    # Not a pair; a pair whose id is an object, true, a number or missing;
    # a time that is not a number: none of them stops the change
    junk = [
        5,
        "x",
        [now - 5_000, {"id": 1}],
        [now - 5_000, True],
        [now - 5_000, 7],
        [now - 5_000],
        ["soon", "junk-time"],
    ]
    periodic = _listing(app, redis_client, {"due": now - 1_000, "ahead": now + HOUR_MS}, junk)
    periodic.store.park([ParkRequest("junk-time", Due("a", now + HOUR_MS), b'{"v":1}\nbody')])

    if change == "pause":
        assert periodic.set_paused("a", True) == 1
        # The pair without a time is still an occurrence parked: taken back
        assert _parked(redis_client) == set()
    else:
        assert periodic.put(_entry(300.0), writer="api") is True
        assert _parked(redis_client) == set()
        pointer = periodic.snapshot().pointers["a"]
        assert (pointer.ms, pointer.inclusive) == (now - 1_000, True)


@pytest.mark.parametrize(
    "pointer",
    [
        "null",
        "7",
        '"a"',
        "[1, 2]",
        '{"v": 1, "ms": 5, "ids": [[1]]}',
        '{"v": 1, "ms": 5, "ids": [5]}',
    ],
    ids=["null", "number", "string", "list", "short-pair", "not-a-pair"],
)
def test_a_pointer_that_cannot_be_read_leaves_the_other_schedules_served(
    app: Celery, redis_client: redis.Redis, pointer: str
) -> None:
    # The companion's pass reads every schedule in one snapshot: one pointer
    # it cannot read leaves that schedule unserved (as define.lua and
    # pause.lua read it: none), not every schedule
    periodic = _defined(app).periodic
    assert periodic.put(_entry(name="b"), writer="api")
    redis_client.hset(periodic.keys.pointers, "a", pointer)

    snap = periodic.snapshot()

    assert set(snap.definitions) == {"a", "b"}
    assert set(snap.pointers) == {"b"}


def test_an_occurrence_without_a_valid_due_time_is_refused_before_the_tick_is_written(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Breaks if: park_once.lua's guard (zdelay_expect_park) leaves out
    # park.lua's check of its entries: the tick would be remembered, then
    # park.lua fail on the due time, and the occurrence never be parked.
    server = _defined(app)
    tick = redis_ms(redis_client) + HOUR_MS
    task_id = occurrence_id("a", 1, tick)
    bad = ParkRequest(task_id, Due("a", float("nan")), b'{"v":1}\nbody')
    with pytest.raises(Exception, match="no valid due time"):
        server.periodic.park_once(bad, occurrence_ms=tick)

    assert (_parked(redis_client), _ticks(redis_client)) == (set(), {})
    assert server.periodic.park_once(
        ParkRequest(task_id, Due("a", tick), b'{"v":1}\nbody'), occurrence_ms=tick
    )
