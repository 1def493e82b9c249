"""A change or a pause of a schedule takes effect when it returns (issue 20 item 2).

``periodic add`` (a new version) and ``periodic pause`` withdraw the old
definition's occurrences in the same script that writes the change: from
then on no companion can release one of them, so a tick is run by at most
one version and none runs while paused. Tried with a live companion, the
change landing tens of milliseconds before a tick.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
from celery import Celery

from celery_zdelay import periodic
from celery_zdelay.parking import store_for
from tests.helpers import CeleryProcess, Runs, wait_for
from tests.support.clock import redis_ms
from tests.support.keys import SHARD0
from tests.support.periodic import occurrence_ms, start_beat_companion, ticks_of

pytestmark = pytest.mark.timeout(180)

DUE = SHARD0.due
SCHEDULE = {"a": {"task": "tests.record", "schedule": 0.5, "args": [0]}}
#: How long before a tick each change lands, in ms (the review saw doubles at 30-120 ms).
BEFORE_TICK_MS = (30, 60, 90, 120)


def _next_tick_ms(client: redis.Redis, now_ms: int) -> int | None:
    ticks = [
        occurrence_ms(raw.decode())
        for raw in client.zrange(DUE, 0, -1)
        if raw.decode().startswith("periodic:a:")
    ]
    upcoming = [ms for ms in ticks if ms > now_ms + 200]
    return min(upcoming) if upcoming else None


def _just_before_next_tick(client: redis.Redis, before_ms: int) -> int:
    """Wait (polling the Redis clock) until *before_ms* before the next parked tick."""
    tick = wait_for(lambda: _next_tick_ms(client, redis_ms(client)), timeout=20)
    wait_for(lambda: redis_ms(client) >= tick - before_ms, timeout=20, interval=0.002)
    return tick


def _served(app: Celery, worker: Any, runs: Runs, processes: list[CeleryProcess]) -> None:
    worker(app)
    app.conf.beat_schedule = SCHEDULE
    processes.append(start_beat_companion(app, SCHEDULE))
    wait_for(lambda: len(ticks_of(runs.all(), "a")) >= 2, timeout=60)


def test_a_change_just_before_a_tick_leaves_no_tick_to_the_old_version(
    app: Celery, worker: Any, processes: list[CeleryProcess], runs: Runs, redis_client: redis.Redis
) -> None:
    # Given a live companion serving a 500 ms schedule, and a worker
    _served(app, worker, runs, processes)

    # When the entry is changed (new arguments: a new version) just before a tick, four times
    changed_at: dict[int, int] = {}  # version -> Redis ms when the change returned
    for version, before_ms in enumerate(BEFORE_TICK_MS, start=2):
        _just_before_next_tick(redis_client, before_ms)
        assert periodic.add("a", app=app, task="tests.record", schedule=0.5, args=[version - 1])
        changed_at[version] = redis_ms(redis_client)
    last = changed_at[len(BEFORE_TICK_MS) + 1]
    wait_for(
        lambda: any(occurrence_ms(t["id"]) > last + 1500 for t in ticks_of(runs.all(), "a")),
        timeout=30,
    )

    # Then every tick of a version is older than the change that replaced it
    late = [
        (t["id"], changed_at[int(t["id"].split(":v")[-1].split(":")[0]) + 1])
        for t in ticks_of(runs.all(), "a")
        if int(t["id"].split(":v")[-1].split(":")[0]) + 1 in changed_at
        and occurrence_ms(t["id"]) > changed_at[int(t["id"].split(":v")[-1].split(":")[0]) + 1]
    ]
    assert not late, f"ticks of a replaced version ran after the change: {late}"
    # and no tick time ran under two versions
    times = [occurrence_ms(t["id"]) for t in ticks_of(runs.all(), "a")]
    assert len(times) == len(set(times))


def test_nothing_runs_once_pause_returns(
    app: Celery, worker: Any, processes: list[CeleryProcess], runs: Runs, redis_client: redis.Redis
) -> None:
    # Given a live companion serving a 500 ms schedule, and a worker
    _served(app, worker, runs, processes)

    # When the schedule is paused just before a tick
    _just_before_next_tick(redis_client, 40)
    assert periodic.pause("a", app=app)
    paused_at = redis_ms(redis_client)

    # Then, three ticks later, none due after the pause ran
    wait_for(lambda: redis_ms(redis_client) > paused_at + 1600, timeout=20, interval=0.05)
    after = [t["id"] for t in ticks_of(runs.all(), "a") if occurrence_ms(t["id"]) > paused_at]
    assert not after, after
    assert not [i for i in redis_client.zrange(DUE, 0, -1) if i.startswith(b"periodic:a:")]
    assert store_for(app).config.shards == 1
