"""What the periodic-task tests share: companions serving a schedule, tending it, tick checks."""

from __future__ import annotations

import itertools
import json
from datetime import datetime
from typing import Any

import redis
from celery import Celery

from celery_zdelay import periodic
from celery_zdelay.parking import store_for
from celery_zdelay.periodic.server import PeriodicServer
from tests.helpers import CeleryProcess, Runs
from tests.support.keys import SHARD0

BEAT_ENV = "ZDELAY_TEST_BEAT"  # read by tests.periodic_app

__all__ = [
    "BeatCompanion",
    "CeleryBeat",
    "finished_runs",
    "occurrence_ms",
    "overlapping_runs",
    "parked_ids",
    "run_spans",
    "server_for",
    "start_beat_companion",
    "tend",
    "tick_counts",
    "ticked_ids",
    "ticks_of",
]


class BeatCompanion(CeleryProcess):
    """``celery -A tests.periodic_app zdelay --beat`` with a schedule from JSON."""

    app_module = "tests.periodic_app"

    def __init__(self, app: Celery, schedule: dict[str, Any], *args: str) -> None:
        super().__init__(
            app, "zdelay", "-l", "DEBUG", "--beat", *args, env={BEAT_ENV: json.dumps(schedule)}
        )


class CeleryBeat(BeatCompanion):
    """A real ``celery -A tests.periodic_app beat -s FILE`` with a schedule from JSON."""

    def __init__(self, app: Celery, schedule: dict[str, Any], schedule_file: str) -> None:
        super().__init__(app, schedule)
        self.args = ["beat", "-l", "INFO", "-s", schedule_file]


def start_beat_companion(app: Celery, schedule: dict[str, Any], *args: str) -> BeatCompanion:
    companion = BeatCompanion(app, schedule, *args).start()
    companion.wait_for_log(" started: ")
    return companion


def occurrence_ms(task_id: str) -> int:
    """Return the occurrence time an id like ``periodic:name:v1:<iso>Z`` names."""
    iso = task_id.rsplit(":v", 1)[1].split(":", 1)[1]
    return int(datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp() * 1000)


def ticks_of(runs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """Return the runs of schedule *name*'s occurrences, by occurrence time."""
    prefix = f"periodic:{name}:"
    mine = [r for r in runs if r["id"].startswith(prefix) and ":run:" not in r["id"]]
    return sorted(mine, key=lambda r: occurrence_ms(r["id"]))


def server_for(app: Celery, beat_schedule: dict[str, Any], name: str = "c") -> PeriodicServer:
    """A companion's periodic part, id *name*, for *beat_schedule* (not reconciled yet)."""
    app.conf.beat_schedule = beat_schedule
    return PeriodicServer(app, store_for(app), companion_id=name)


def tend(server: PeriodicServer) -> int:
    """Run one pass of *server*'s planning; return what it parked."""
    server._last_tend = 0.0  # every call is a pass, however close together
    return server.tend()


def parked_ids(client: redis.Redis, name: str) -> set[str]:
    """Ids of schedule *name*'s occurrences parked now (a one-shard store)."""
    prefix = f"periodic:{name}:"
    return {i.decode() for i in client.zrange(SHARD0.due, 0, -1) if i.decode().startswith(prefix)}


def ticked_ids(client: redis.Redis, name: str = "") -> list[str]:
    """Every occurrence remembered as parked (parked, leased or released), of *name* or of all."""
    prefix = f"periodic:{name}:" if name else ""
    return [i.decode() for i in client.zrange(SHARD0.ticks, 0, -1) if i.decode().startswith(prefix)]


def run_spans(runs: Runs, name: str) -> dict[str, tuple[int, int | None]]:
    """Occurrence id -> (Redis ms it started, Redis ms it finished or None).

    For a task that records "started" and "finished" (``tests.slow_late``).
    """
    spans: dict[str, tuple[int, int | None]] = {}
    for tick in ticks_of(runs.all(), name):
        start, end = spans.get(tick["id"], (tick["redis_ms"], None))
        finished = tick["result"] == "finished"
        spans[tick["id"]] = (start, tick["redis_ms"]) if finished else (start, end)
    return spans


def finished_runs(runs: Runs, name: str) -> int:
    """How many runs of schedule *name* finished."""
    return sum(1 for _, end in run_spans(runs, name).values() if end is not None)


def overlapping_runs(spans: dict[str, tuple[int, int | None]]) -> list[tuple[str, str]]:
    """Pairs of runs of which the second started before the first finished."""
    ordered = sorted(spans.items(), key=lambda item: item[1][0])
    pairs = []
    for (first, (_, end)), (second, (start, _)) in itertools.pairwise(ordered):
        if end is None or start < end:
            pairs.append((first, second))
    return pairs


def tick_counts(app: Celery, name: str) -> dict[str, int]:
    """The tick counters of schedule *name*, as periodic list shows them."""
    return next(i.counts for i in periodic.schedules(app)[1] if i.name == name)
