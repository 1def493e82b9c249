"""Helpers of the periodic-task tests: companions serving a schedule, tick checks."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from typing import Any

from celery import Celery

from tests.helpers import ROOT, CeleryProcess

BEAT_ENV = "ZDELAY_TEST_BEAT"  # read by tests.periodic_app

__all__ = [
    "BeatCompanion",
    "CeleryBeat",
    "occurrence_ms",
    "redis_ms",
    "start_beat_companion",
    "ticks_of",
]


class BeatCompanion(CeleryProcess):
    """``celery -A tests.periodic_app zdelay --beat`` with a schedule from JSON."""

    def __init__(self, app: Celery, schedule: dict[str, Any], *args: str) -> None:
        super().__init__(
            app, "zdelay", "-l", "DEBUG", "--beat", *args, env={BEAT_ENV: json.dumps(schedule)}
        )

    def start(self) -> BeatCompanion:
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "tests.periodic_app", *self.args],
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self


class CeleryBeat(BeatCompanion):
    """A real ``celery -A tests.periodic_app beat -s FILE`` with a schedule from JSON."""

    def __init__(self, app: Celery, schedule: dict[str, Any], schedule_file: str) -> None:
        super().__init__(app, schedule)
        self.args = ["beat", "-l", "INFO", "-s", schedule_file]


def redis_ms(client: Any) -> int:
    """The Redis clock in epoch ms (the one clock every due decision uses)."""
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


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
