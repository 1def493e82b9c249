"""An occurrence far ahead is parked within the planner's lead before it is due, not at once.

A first pass over 100,000 new daily schedules used to park each one's next
occurrence, a day ahead: 97 s before the first tick of any schedule (issue
34, ``benchmarks/beat_rows.py``). Now a schedule whose next occurrence is
more than ``PeriodicServer.park_lead_ms`` ahead (``PARK_LEAD_MS``, an hour)
parks nothing: ``defer.lua`` writes the occurrence down in its pointer and
puts the schedule's next visit off to between the lead and half of it before
(spread by name). Each test names the one-line change it catches.
"""

from __future__ import annotations

import json

import pytest
import redis
from celery import Celery

from celery_zdelay import periodic
from celery_zdelay.errors import StoreRefusedError
from celery_zdelay.periodic.server import PARK_LEAD_MS, PeriodicServer
from celery_zdelay.periodic.store import Pointer
from tests.helpers import wait_for
from tests.support.clock import redis_ms
from tests.support.periodic import occurrence_ms, parked_ids, server_for, tend

pytestmark = pytest.mark.timeout(60)


def _pointer(server: PeriodicServer, name: str) -> Pointer:
    return server.periodic.snapshot().pointers[name]


def test_a_schedule_further_ahead_than_the_lead_is_parked_within_it_and_before_it_is_due(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given a 15 s schedule and a planner that parks 8 s ahead at most
    server = server_for(app, {"a": {"task": "tests.record", "schedule": 15.0}})
    server.reconcile()
    server.park_lead_ms = 8_000

    # When its first pass looks at it
    assert tend(server) == 0

    # Then nothing is parked: its next occurrence is written down, the
    # schedule looked at again at its wake, between 8 s and 4 s before it
    # (mutants: the comparison with now + horizon flipped; the wake not
    # written; periodic_next_visit ignoring it)
    pointer = _pointer(server, "a")
    assert parked_ids(redis_client, "a") == set()
    assert pointer.next_ms is not None
    assert pointer.wake_ms is not None
    assert pointer.next_ms - 8_000 <= pointer.wake_ms < pointer.next_ms - 4_000
    keys = server.periodic.keys
    assert redis_client.zscore(keys.visits, "a") == pointer.wake_ms
    (info,) = periodic.schedules(app)[1]
    assert info.next_run_ms == pointer.next_ms
    # and a pass before then does not read it
    assert "a" not in server.periodic.view(server.horizon_ms).definitions

    # When passes go on until it is parked
    wait_for(lambda: tend(server) >= 0 and parked_ids(redis_client, "a"), timeout=20)

    # Then the occurrence written down is the one parked, before its time,
    # and the wake is over (mutant: advance.lua keeping it)
    (task_id,) = parked_ids(redis_client, "a")
    assert occurrence_ms(task_id) == pointer.next_ms
    assert redis_ms(redis_client) < pointer.next_ms
    after = _pointer(server, "a")
    assert after.wake_ms is None
    assert after.next_ms is None
    assert redis_client.zscore(keys.visits, "a") == pointer.next_ms


def test_a_first_pass_over_many_far_schedules_parks_only_what_is_near(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given 2,000 daily schedules and one every 2 s, all new
    schedule = {
        f"daily-{i}": {"task": "tests.record", "schedule": 86_400.0, "args": [i]}
        for i in range(2_000)
    }
    schedule["fast"] = {"task": "tests.record", "schedule": 2.0}
    server = server_for(app, schedule)
    server.reconcile()

    # When the first pass runs
    parked = tend(server)

    # Then it parks the fast one's occurrences within the horizon (and the
    # next), none of the daily ones, and puts each daily one off to an hour
    # or half an hour before its tick (mutant: no schedule ever put off)
    fast = parked_ids(redis_client, "fast")
    assert parked == len(fast) >= 3
    assert parked_ids(redis_client, "daily-") == set()
    pointers = server.periodic.snapshot().pointers
    wakes = [pointers[f"daily-{i}"] for i in range(2_000)]
    assert all(
        p.wake_ms is not None
        and p.next_ms is not None
        and p.next_ms - PARK_LEAD_MS <= p.wake_ms < p.next_ms - PARK_LEAD_MS // 2
        for p in wakes
    )
    # spread over that half hour, not all at one instant (mutant: no spread)
    spread = max(p.wake_ms or 0 for p in wakes) - min(p.wake_ms or 0 for p in wakes)
    assert spread > PARK_LEAD_MS // 4


def test_defer_leaves_a_schedule_changed_or_paused_since_it_was_read(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given two schedules read by a planner (their pointers as read)
    server = server_for(
        app,
        {
            "changed": {"task": "tests.record", "schedule": 86_400.0},
            "paused": {"task": "tests.record", "schedule": 86_400.0},
            "kept": {"task": "tests.record", "schedule": 86_400.0},
        },
    )
    server.reconcile()
    read = server.periodic.snapshot().pointers
    store = server.periodic
    # When one changes (a new version) and one is paused before the planner writes
    app.conf.beat_schedule["changed"]["args"] = [1]
    assert server.reconcile() == "done"
    assert periodic.pause("paused", app=app)
    before = {n: redis_client.hget(store.keys.pointers, n) for n in ("changed", "paused")}
    wake, next_ms = read["kept"].ms + 1_000_000, read["kept"].ms + 2_000_000
    done = store.defer([(n, read[n], wake, next_ms) for n in ("changed", "paused", "kept")])

    # Then only the one as read is put off (mutants: the version or the
    # pause check removed from defer.lua)
    assert done == 1
    assert {n: redis_client.hget(store.keys.pointers, n) for n in before} == before
    assert redis_client.zscore(store.keys.visits, "paused") is None
    kept = json.loads(redis_client.hget(store.keys.pointers, "kept") or "{}")
    assert (kept["wake"], kept["next"]) == (wake, next_ms)
    assert redis_client.zscore(store.keys.visits, "kept") == wake


def test_defer_refuses_a_wake_that_is_not_a_time_and_a_key_of_another_type(
    app: Celery, redis_client: redis.Redis
) -> None:
    server = server_for(app, {"a": {"task": "tests.record", "schedule": 86_400.0}})
    server.reconcile()
    store = server.periodic
    pointer = store.snapshot().pointers["a"]
    keys = [store.keys.pointers, store.keys.runs, store.keys.visits]
    with pytest.raises(redis.ResponseError, match="wake and next must be ms, not soon"):
        store._defer(keys=keys, args=["a", pointer.version, pointer.ms, "soon", 1])
    # A runs key someone else wrote: refused before the pointer is written
    # (mutant: the type check removed, the pointer written, then WRONGTYPE)
    redis_client.set(store.keys.runs, "not a hash")
    with pytest.raises(StoreRefusedError, match="holds a string, not a hash"):
        store.defer([("a", pointer, pointer.ms + 10_000_000, pointer.ms + 20_000_000)])
    redis_client.delete(store.keys.runs)
    assert store.snapshot().pointers["a"] == pointer


def test_a_written_down_run_already_past_is_not_shown_as_next(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given a schedule whose pointer holds a run written down and nothing parked
    server = server_for(app, {"a": {"task": "tests.record", "schedule": 86_400.0}})
    server.reconcile()
    keys = server.periodic.keys
    record = json.loads(redis_client.hget(keys.pointers, "a") or "{}")

    # When that run's time has passed (no companion parked it), it is not the
    # next run (mutant: the comparison with now left out of schedules_in)
    record["next"] = record["ms"] - 60_000
    redis_client.hset(keys.pointers, "a", json.dumps(record))
    (info,) = periodic.schedules(app)[1]
    assert info.next_run_ms is None

    # and one still ahead is
    record["next"] = record["ms"] + 7_200_000
    redis_client.hset(keys.pointers, "a", json.dumps(record))
    (info,) = periodic.schedules(app)[1]
    assert info.next_run_ms == record["next"]
