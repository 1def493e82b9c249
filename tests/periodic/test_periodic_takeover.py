"""The switch from a running celery beat loses and doubles no tick (issue 20 item 3).

Following docs/beat.rst's cut-over (stop celery beat, start companions with
``--beat``), a companion reads celery beat's schedule file and each entry
stored for the first time goes on from its last run there: an interval keeps
beat's phase, and a tick due during the switch runs once (``zdelay_missed``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.schedules import crontab

from celery_zdelay.parking import store_for
from celery_zdelay.periodic.server import PeriodicServer, occurrence_id
from celery_zdelay.periodic.takeover import beat_last_runs, set_since
from tests.helpers import CeleryProcess, Runs, wait_for
from tests.support.clock import redis_ms
from tests.support.keys import SHARD0
from tests.support.periodic import BeatCompanion, CeleryBeat, occurrence_ms, tend

pytestmark = pytest.mark.timeout(180)

PERIOD_MS = 3000
SCHEDULE = {"every3": {"task": "tests.record", "schedule": PERIOD_MS / 1000, "args": ["x"]}}


def _runs_of(runs: Runs) -> list[dict[str, Any]]:
    return sorted(
        (r for r in runs.all() if r["task"] == "tests.record" and r["args"] == ["x"]),
        key=lambda r: r["redis_ms"],
    )


def test_switching_from_a_running_celery_beat_loses_and_doubles_no_tick(
    app: Celery,
    worker: Any,
    processes: list[CeleryProcess],
    runs: Runs,
    redis_client: redis.Redis,
    tmp_path: Path,
) -> None:
    # Given celery beat running a 3 s schedule with its schedule file, and a worker
    worker(app)
    schedule_file = str(tmp_path / "celerybeat-schedule")
    beat = CeleryBeat(app, SCHEDULE, schedule_file).start()
    processes.append(beat)
    wait_for(lambda: len(_runs_of(runs)) >= 2, timeout=60)

    # When it is stopped and a companion started in its place (docs/beat.rst)
    assert beat.terminate(resend_after=10) == 0
    stopped_ms = redis_ms(redis_client)
    by_beat = _runs_of(runs)
    last_by_beat = beat_last_runs(schedule_file)["every3"]
    assert last_by_beat <= by_beat[-1]["redis_ms"]
    companion = BeatCompanion(app, SCHEDULE, "-s", schedule_file).start()
    processes.append(companion)
    companion.wait_for_log(" started: ", timeout=60)
    up_ms = redis_ms(redis_client)
    wait_for(
        lambda: any(
            occurrence_ms(r["id"]) > up_ms + 2 * PERIOD_MS
            for r in _runs_of(runs)
            if r["id"].startswith("periodic:")
        ),
        timeout=60,
    )

    # Then the companion's ticks are beat's: its last run plus whole periods
    served = sorted(
        occurrence_ms(r["id"]) for r in _runs_of(runs) if r["id"].startswith("periodic:every3:")
    )
    assert len(served) == len(set(served)) >= 2
    assert all((ms - last_by_beat) % PERIOD_MS == 0 for ms in served), (served, last_by_beat)
    # none lost at the switch: the first tick after beat's last run ran (on
    # time, or as the one missed run if the switch took longer than that),
    first = last_by_beat + PERIOD_MS
    assert served[0] == first, (served, last_by_beat)
    # the other ticks due while nothing served were missed ones ("once": not run),
    assert not [ms for ms in served if first < ms <= stopped_ms], served
    # and from the companion's start on, every tick ran, each once
    on = [ms for ms in served if ms > up_ms]
    assert on == list(range(on[0], on[-1] + 1, PERIOD_MS)), served
    # while the beat stopped ran nothing more
    assert len([r for r in _runs_of(runs) if not r["id"].startswith("periodic:")]) == len(by_beat)
    assert "goes on from its last run elsewhere" in companion.log()


def test_without_beats_file_since_carries_a_crontab_over_the_switch(
    app: Celery, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # Given a per-minute crontab that celery beat last ran 3 minutes ago,
    # no beat schedule file here, and the time given with --since
    now = redis_ms(redis_client)
    last_run = now - now % 60_000 - 3 * 60_000
    app.conf.beat_schedule_filename = str(tmp_path / "no-such-file")
    app.conf.beat_schedule = {"minutely": {"task": "tests.record", "schedule": crontab()}}
    set_since(app, last_run)

    # When a companion stores the schedule for the first time
    server = PeriodicServer(app, store_for(app), companion_id="c")
    server.reconcile()
    server.tend()

    # Then it goes on from beat's last run: the first minute after it is the
    # missed run (once), then the next minute ahead; nothing between
    parked = {i.decode() for i in redis_client.zrange(SHARD0.due, 0, -1)}
    missed_run = occurrence_id("minutely", 1, last_run + 60_000)
    assert missed_run in parked
    assert all(occurrence_ms(i) > now for i in parked - {missed_run}), parked
    # and a companion that stores it again later does not move it back
    again = PeriodicServer(app, store_for(app), companion_id="c2")
    set_since(app, last_run - 3_600_000)
    again.reconcile()
    assert again.periodic.snapshot().pointers["minutely"].ms > last_run
    # nor does the same companion after Redis lost everything (beat's last
    # run is long out of date by then): the schedule starts again from now
    redis_client.flushall()
    tend(server)
    parked = {i.decode() for i in redis_client.zrange(SHARD0.due, 0, -1)}
    assert parked
    assert all(occurrence_ms(i) > now for i in parked), parked
