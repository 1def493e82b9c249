"""What a planner pass costs Redis: the schedules due, not every schedule stored.

Given N schedules none of which is due for a day, a pass (``PeriodicServer._tend``)
used to read and decode every definition, pointer and run (``HGETALL`` of each
hash): its bytes grew with N. Now it reads the visits zset up to its horizon,
and only the schedules found there. Counted on a private Redis from ``INFO``
(commands and bytes sent to clients), not timed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_zdelay import periodic
from celery_zdelay.periodic import server as server_module
from celery_zdelay.periodic.server import PeriodicServer
from celery_zdelay.testing import RedisServer
from tests.conftest import AppFactory
from tests.support.periodic import server_for, tend

pytestmark = pytest.mark.timeout(240)

#: Passes measured per size (the median is compared).
PASSES = 5


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A Redis of this test's own: INFO counts its commands only."""
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()


def _served(make_test_app: AppFactory, url: str, prefix: str, count: int) -> PeriodicServer:
    """A companion's planner serving *count* daily schedules, none due, after its first pass."""
    app = make_test_app(
        broker=f"{url}/0", conf={"zdelay_redis_url": f"{url}/0", "zdelay_key_prefix": prefix}
    )
    schedule = {
        f"daily-{i}": {"task": "tests.record", "schedule": 86_400.0, "args": (i,)}
        for i in range(count)
    }
    server = server_for(app, schedule, f"c-{prefix}")
    server.reconcile()
    # The first pass parks none: each one's next occurrence is a day ahead,
    # further than the planner parks (PARK_LEAD_MS), and is written down.
    assert tend(server) == 0
    pointers = server.periodic.snapshot().pointers
    assert sum(1 for p in pointers.values() if p.next_ms and not p.parked) == count
    return server


def _stats(client: redis.Redis) -> tuple[int, int]:
    """(commands run, bytes sent to clients) so far, this INFO's own call and reply left out."""
    info: dict[str, Any] = client.info("all")
    calls = sum(int(v["calls"]) for k, v in info.items() if k.startswith("cmdstat_"))
    return calls, int(info["total_net_output_bytes"])


def _pass_cost(server: PeriodicServer, client: redis.Redis) -> tuple[int, int]:
    """Median commands and bytes of :data:`PASSES` passes with nothing due."""
    costs = []
    for _ in range(PASSES):
        # What two INFOs in a row count of themselves (the first one's call and reply).
        calls, sent = _stats(client)
        info_calls, info_sent = (a - b for a, b in zip(_stats(client), (calls, sent), strict=True))
        # No reconcile check in the pass: it compares the app's own beat_schedule.
        server._last_check = time.monotonic()
        calls, sent = _stats(client)
        assert tend(server) == 0
        after_calls, after_sent = _stats(client)
        costs.append((after_calls - calls - info_calls, after_sent - sent - info_sent))
    commands = sorted(c for c, _ in costs)[PASSES // 2]
    sent = sorted(b for _, b in costs)[PASSES // 2]
    return commands, sent


def test_a_pass_with_nothing_due_costs_the_same_with_100_or_5000_schedules(
    make_test_app: AppFactory, private_redis: RedisServer
) -> None:
    # Given 100 schedules on one store and 5,000 on another, none due for a day
    client = private_redis.client(0)
    small = _served(make_test_app, private_redis.url, "small", 100)
    large = _served(make_test_app, private_redis.url, "large", 5_000)

    # When each companion makes passes with nothing to park
    small_commands, small_bytes = _pass_cost(small, client)
    large_commands, large_bytes = _pass_cost(large, client)

    # Then a pass over 5,000 sends as many commands and as many bytes as one
    # over 100 (before the visits zset: 9 commands either way, but every
    # definition, pointer and run, 1,483,753 B a pass at 5,000 against 28,951 B
    # at 100; now 5 commands and 108 B at both)
    print(
        f"pass with nothing due: 100 schedules {small_commands} commands {small_bytes} B; "
        f"5,000 schedules {large_commands} commands {large_bytes} B"
    )
    assert large_commands == small_commands
    # (The INFO replies counted around a pass differ by a few digits.)
    assert large_bytes <= small_bytes + 64, (small_bytes, large_bytes)


def test_a_schedule_not_due_is_served_when_it_comes_due(
    make_test_app: AppFactory, private_redis: RedisServer
) -> None:
    # Given 1,000 daily schedules not due, and a companion that has made its first pass
    server = _served(make_test_app, private_redis.url, "due", 1_000)
    # When one of them changes (a new version from now) and another is added
    # at run time, both due within the horizon
    app = server.app
    periodic.add("every-second", app=app, task="tests.record", schedule=1.0)
    assert periodic.pause("daily-7", app=app)
    assert periodic.resume("daily-7", app=app)

    # Then the next pass reads those two (and nothing else) and parks their occurrences
    server._last_check = time.monotonic()
    tend(server)
    snap = server.periodic.view(server.horizon_ms)
    assert set(snap.visits) == {"every-second"}
    assert any(t.startswith("periodic:every-second:v1:") for t in server._pending)
    # (daily-7 looked at, its next occurrence a day ahead written down)
    pointer = server.periodic.snapshot().pointers["daily-7"]
    assert pointer.version == 2
    assert pointer.parked == []
    assert pointer.next_ms is not None
    assert pointer.next_ms > snap.now_ms + 23 * 3_600_000


def test_an_unchanged_beat_schedule_is_not_rebuilt_and_an_edit_in_place_is_seen(
    make_test_app: AppFactory, private_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a companion serving 1,000 schedules, its configuration stored
    server = _served(make_test_app, private_redis.url, "conf", 1_000)
    built: list[int] = []
    real = server_module.definitions_from_config

    def counting(app: Any, **options: Any) -> Any:
        built.append(1)
        return real(app, **options)

    monkeypatch.setattr(server_module, "definitions_from_config", counting)

    # When its periodic check compares the same beat_schedule again
    assert server.reconcile() == "same"

    # Then no definition is built (a second at 10,000 entries, every 5 s, before)
    assert built == []

    # And an entry edited in place is still a change, stored and served,
    # the other entries' definitions kept as they were
    kept = server.periodic.snapshot().definitions["daily-4"]
    server.app.conf.beat_schedule["daily-3"]["args"] = (3, "edited")
    assert server.reconcile() == "done"
    assert built == [1]
    stored = server.periodic.snapshot().definitions
    assert json.loads(stored["daily-3"].body())["args"] == [3, "edited"]
    assert stored["daily-4"] == kept
    assert server._config_seen is not None
    assert server._config_seen[0]["daily-3"][1].args == [3, "edited"]


def test_a_schedule_made_relative_in_place_of_the_same_interval_is_a_change(
    make_test_app: AppFactory, private_redis: RedisServer
) -> None:
    # Given a companion serving an entry every 60 s, its configuration stored
    from celery.schedules import schedule

    app = make_test_app(
        broker=f"{private_redis.url}/0", conf={"zdelay_redis_url": f"{private_redis.url}/0"}
    )
    server = server_for(app, {"a": {"task": "tests.record", "schedule": schedule(60.0)}})
    assert server.reconcile() == "done"
    assert server.reconcile() == "same"

    # When the entry gets schedule(60, relative=True), which Celery's == finds equal
    app.conf.beat_schedule["a"]["schedule"] = schedule(60.0, relative=True)

    # Then it is a change all the same
    assert server.reconcile() == "done"
    assert server.periodic.snapshot().definitions["a"].schedule.get("relative") is True


def test_a_store_without_the_visits_zset_gets_it_built_and_every_schedule_served(
    make_test_app: AppFactory, private_redis: RedisServer
) -> None:
    # Given 200 schedules stored, and a store that lost (or never had) the visits zset
    server = _served(make_test_app, private_redis.url, "upgrade", 200)
    client = server.periodic.store.client
    keys = server.periodic.keys
    scores = dict(client.zrange(keys.visits, 0, -1, withscores=True))
    client.delete(keys.visits)

    # When a companion starts on it (its first pass checks the zset)
    again = PeriodicServer(server.app, server.periodic.store, companion_id="upgraded")
    tend(again)

    # Then every schedule is scored again as its stored state says
    assert dict(client.zrange(keys.visits, 0, -1, withscores=True)) == scores


def test_an_occurrence_that_never_runs_stops_being_looked_at_once_forgotten(
    make_test_app: AppFactory, private_redis: RedisServer
) -> None:
    # Given a 60 s schedule with three occurrences parked ahead (a long horizon)
    app = make_test_app(
        broker=f"{private_redis.url}/0", conf={"zdelay_redis_url": f"{private_redis.url}/0"}
    )
    server = server_for(app, {"a": {"task": "tests.record", "schedule": 60.0}})
    server.reconcile()
    server.horizon_ms = 150_000
    assert tend(server) == 3
    periodic_store = server.periodic
    pointer = periodic_store.snapshot().pointers["a"]
    first_ms = min(ms for ms, _ in pointer.parked)
    client = periodic_store.store.client
    # scored at the first of them: it has not run
    assert client.zscore(periodic_store.keys.visits, "a") == first_ms

    # When they are cancelled (they never run), and a pass looks at the
    # schedule after its pointer would forget them (a minute after their
    # time: here at once), with nothing to plan (its pointer beyond the horizon)
    periodic_store.store.cancel([task_id for _, task_id in pointer.parked])
    periodic_store.remember_parked_ms = -600_000
    server.horizon_ms = 100_000
    assert tend(server) == 0

    # Then revisit.lua forgets them, and the schedule is scored at its pointer:
    # not looked at by every pass until its next occurrence to plan
    after = periodic_store.snapshot().pointers["a"]
    assert after.ms == pointer.ms
    assert after.parked == []
    assert client.zscore(periodic_store.keys.visits, "a") == pointer.ms
