"""Periodic ticks through an outage of every companion (issue 20 items 1 and 3).

The occurrence times after any gap are a function of the schedule alone
(its anchor and period), so companions that come back together compute the
same ids; and ``zdelay_missed="once"`` means one run for the whole gap,
however many occurrences were parked ahead before the outage.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
import redis
from celery import Celery

from celery_zdelay.companion import Companion
from celery_zdelay.parking import store_for
from celery_zdelay.periodic.server import HORIZON_MS, PeriodicServer
from tests.helpers import CeleryProcess, Runs, wait_for
from tests.support.clock import redis_ms
from tests.support.periodic import BeatCompanion, occurrence_ms, ticks_of

pytestmark = pytest.mark.timeout(240)

PERIOD_MS = 100
#: A tick that ran this much after its time was missed (server.STALE_MS).
LATE_MS = 2000
SCHEDULE = {"fast": {"task": "tests.record", "schedule": PERIOD_MS / 1000}}


def late_runs(ticks: list[dict[str, Any]], back_ms: int) -> list[str]:
    """The missed ticks that ran: due more than LATE_MS before *back_ms*, run after it.

    Every companion back at *back_ms* or later finds those stale, so each
    one that ran is a missed run. (Counting the ticks that ran LATE_MS after
    their time instead also counts ticks parked on time that a loaded
    worker ran late.)
    """
    return [
        t["id"]
        for t in ticks
        if occurrence_ms(t["id"]) < back_ms - LATE_MS and t["redis_ms"] > back_ms
    ]


def test_three_companions_back_together_after_an_outage_run_no_tick_twice(
    app: Celery,
    worker,
    processes: list[CeleryProcess],
    runs: Runs,
    redis_client: redis.Redis,
) -> None:
    # Given a companion serving a 100 ms schedule, and a worker
    worker(app)
    first = BeatCompanion(app, SCHEDULE).start()
    processes.append(first)
    first.wait_for_log(" started: ")
    wait_for(lambda: len(ticks_of(runs.all(), "fast")) >= 5, timeout=60)

    # When every companion is down for more than 100 periods beyond what was
    # parked ahead (the planner's jump over a long outage)...
    first.kill()
    down_ms = redis_ms(redis_client)
    outage_ms = HORIZON_MS + 120 * PERIOD_MS
    wait_for(lambda: redis_ms(redis_client) > down_ms + outage_ms, timeout=60, interval=0.1)
    # ...and three companions come back together (a deploy)
    restart_ms = redis_ms(redis_client)
    back = [BeatCompanion(app, SCHEDULE).start() for _ in range(3)]
    processes.extend(back)
    for companion in back:
        companion.wait_for_log(" started: ", timeout=60)
    back_ms = redis_ms(redis_client)
    wait_for(
        lambda: any(occurrence_ms(i) > back_ms + 3000 for i in runs.ids() if "fast" in i),
        timeout=60,
    )
    for companion in back:
        assert companion.terminate() == 0

    # Then no tick ran twice,
    ticks = ticks_of(runs.all(), "fast")
    twice = {i: n for i, n in Counter(t["id"] for t in ticks).items() if n > 1}
    assert not twice, f"{len(twice)} ticks ran more than once, e.g. {sorted(twice)[:3]}"
    # nor did any period of the schedule get two runs under different ids,
    slots = Counter(occurrence_ms(t["id"]) // PERIOD_MS for t in ticks)
    assert max(slots.values()) == 1, f"{sum(n > 1 for n in slots.values())} periods ran twice"
    # every tick is on the schedule's own phase (anchor + k * period),
    phases = Counter(occurrence_ms(t["id"]) % PERIOD_MS for t in ticks)
    assert len(phases) == 1, phases
    # and of the ticks the outage missed (those parked ahead before it
    # included), one ran
    assert len(late_runs(ticks, restart_ms)) == 1, late_runs(ticks, restart_ms)
    # while every tick from shortly after the companions were back ran
    (phase,) = phases
    start = back_ms + 500 - (back_ms + 500) % PERIOD_MS + phase + PERIOD_MS
    wanted = (back_ms + 3000 - start) // PERIOD_MS + 1

    def ran_since_back() -> int:
        times = {occurrence_ms(t["id"]) for t in ticks_of(runs.all(), "fast")}
        return len([ms for ms in times if start <= ms <= back_ms + 3000])

    wait_for(lambda: ran_since_back() == wanted, timeout=30)


def test_a_companion_whose_first_pass_overlaps_anothers_adds_no_second_missed_run(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given a 200 ms schedule parked a second ahead, then no companion for
    # long enough that what was parked is stale and more was never parked
    app.conf.beat_schedule = {"f": {"task": "tests.record", "schedule": 0.2}}
    first = PeriodicServer(app, store_for(app), companion_id="first")
    first.horizon_ms = 1000
    first.reconcile()
    first.tend()
    pointer = first.periodic.snapshot().pointers["f"].ms
    wait_for(lambda: redis_ms(redis_client) > pointer + LATE_MS + 600, timeout=20, interval=0.05)

    # When two companions come back: B reads the schedules, then A runs its
    # whole first pass and releases the missed run it kept, then B goes on
    # from what it read
    a, b = (PeriodicServer(app, store_for(app), companion_id=n) for n in ("a", "b"))
    back_ms = redis_ms(redis_client)
    snap_b = b.periodic.snapshot()
    a.tend()
    with Companion(app) as companion:
        companion.release_due()
    definition = snap_b.definitions["f"]
    b._tend_one(definition, snap_b, gap_decided=b._sort_out_missed(definition, snap_b))
    with Companion(app) as companion:
        companion.release_due()

    # Then the whole gap ran once: one occurrence older than the stale bound
    # when they came back (not when this line runs: on a loaded machine the
    # ticks parked on time are that old by now)
    queued = [json.loads(raw)["headers"]["id"] for raw in redis_client.lrange("celery", 0, -1)]
    missed = [i for i in queued if occurrence_ms(i) < back_ms - LATE_MS]
    assert len(missed) == 1, missed
