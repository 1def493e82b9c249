"""Jitter: each occurrence runs at an offset of its own, the same on every companion.

Issue 26 item 3: ``zdelay_jitter`` spreads schedules due at the same moment (the top of the
hour) over a window: each occurrence runs at its time plus a deterministic
offset in ``[0, jitter)``, a hash of the schedule's name and the occurrence
time, so every companion parks it at the same due time under the same id,
and exactly once still holds.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import redis
from celery import Celery

from celery_zdelay import ConfigurationError, periodic
from celery_zdelay.parking import store_for
from celery_zdelay.periodic.definition import Definition, from_beat_entry
from celery_zdelay.periodic.server import PeriodicServer
from tests.helpers import CeleryProcess, Runs, wait_for
from tests.support.keys import SHARD0
from tests.support.periodic import occurrence_ms, start_beat_companion, tend, ticks_of

pytestmark = [pytest.mark.timeout(180), pytest.mark.timing]

DUE = SHARD0.due
JITTER_MS = 800
SCHEDULE = {
    f"s{i}": {"task": "tests.record", "schedule": 1.0, "zdelay_jitter": JITTER_MS / 1000}
    for i in range(4)
}


def _definition(name: str = "a", jitter_ms: int = JITTER_MS) -> Definition:
    return Definition(name=name, task="tests.record", schedule={"every": 1.0}, jitter_ms=jitter_ms)


def test_offsets_are_deterministic_within_the_window_and_spread() -> None:
    a, again, b = _definition("a"), _definition("a"), _definition("b")
    times = range(1_800_000_000_000, 1_800_000_000_000 + 3_600_000, 60_000)  # an hour of minutes
    offsets = [a.offset_ms(ms) for ms in times]
    # The same for every companion (a fresh object, as another process builds it)
    assert offsets == [again.offset_ms(ms) for ms in times]
    # Within [0, jitter)
    assert all(0 <= o < JITTER_MS for o in offsets)
    # Spread over the window, and different from one schedule to another
    assert max(offsets) - min(offsets) > JITTER_MS / 2
    assert len(set(offsets)) > len(offsets) / 2
    assert offsets != [b.offset_ms(ms) for ms in times]
    # No jitter: no offset
    assert _definition(jitter_ms=0).offset_ms(times[0]) == 0


def test_bad_jitter_is_refused_with_the_fix() -> None:
    for bad in (-1, "5", True, 90_000):
        with pytest.raises(ConfigurationError, match="zdelay_jitter must be a number of seconds"):
            from_beat_entry(
                "a", {"task": "t", "schedule": 10.0, "zdelay_jitter": bad}, known_tasks={"t"}
            )


def test_two_companions_park_each_occurrence_once_at_the_same_jittered_time(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given two companions serving the same jittered schedules
    app.conf.beat_schedule = SCHEDULE
    servers = [PeriodicServer(app, store_for(app), companion_id=n) for n in ("c1", "c2")]
    for server in servers:
        server.reconcile()
        tend(server)

    # Then each occurrence is parked once, due at its time plus its own offset
    scores: dict[str, int] = {
        raw.decode(): int(score) // 1024
        for raw, score in redis_client.zrange(DUE, 0, -1, withscores=True)
    }
    definitions = servers[0].periodic.snapshot().definitions
    assert len(scores) >= 4 * 5
    for task_id, due_ms in scores.items():
        name = task_id.split(":")[1]
        at = occurrence_ms(task_id)
        assert due_ms == at + definitions[name].offset_ms(at)
        assert at <= due_ms < at + JITTER_MS
    # and the schedules due at the same moment are spread over the window
    assert len({due % 1000 for due in scores.values()}) > 4
    assert "jitter 0.8s" in periodic.schedules(app)[1][0].schedule


def test_jittered_ticks_run_once_and_never_before_their_offset(
    app: Celery,
    worker: Any,
    processes: list[CeleryProcess],
    runs: Runs,
) -> None:
    # Given a worker and two companions serving four jittered 1-second schedules
    worker(app)
    processes.extend(start_beat_companion(app, SCHEDULE) for _ in range(2))

    # When they have served a few seconds
    wait_for(lambda: all(len(ticks_of(runs.all(), n)) >= 4 for n in SCHEDULE), timeout=60)

    # Then each tick ran once, never before its time plus its offset
    definitions = {
        n: from_beat_entry(n, entry, known_tasks={"tests.record"}) for n, entry in SCHEDULE.items()
    }
    for name in SCHEDULE:
        ticks = ticks_of(runs.all(), name)
        assert max(Counter(t["id"] for t in ticks).values()) == 1
        for tick in ticks:
            at = occurrence_ms(tick["id"])
            assert tick["redis_ms"] >= at + definitions[name].offset_ms(at), tick["id"]
