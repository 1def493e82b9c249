"""What the periodic-task tests share: companions serving a schedule, tending it, tick checks."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import redis
from celery import Celery

from celery_zdelay.parking import store_for
from celery_zdelay.periodic.server import PeriodicServer
from tests.helpers import CeleryProcess
from tests.support.keys import SHARD0

BEAT_ENV = "ZDELAY_TEST_BEAT"  # read by tests.periodic_app

__all__ = [
    "BeatCompanion",
    "CeleryBeat",
    "occurrence_ms",
    "parked_ids",
    "server_for",
    "start_beat_companion",
    "tend",
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
