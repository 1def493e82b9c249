"""Periodic tasks served by the companions: ``beat_schedule`` without celery beat.

Each occurrence of a schedule is an ordinary parked entry with a
deterministic id, so any number of companions serve the schedule with no
leader and no lock (see ``docs/beat.rst``). This package holds the pieces:
:mod:`.definition` (reading ``beat_schedule``), :mod:`.occurrences` (next
runs, by Celery's own schedule classes), :mod:`.store` (Redis),
:mod:`.server` (what a companion does each pass) and :mod:`.api`.
"""

from __future__ import annotations

from .api import (
    ScheduleInfo,
    add,
    backfill,
    pause,
    remove,
    resume,
    run_now,
    schedules,
    stored_name,
    sync,
    unserved,
)

__all__ = [
    "ScheduleInfo",
    "add",
    "backfill",
    "pause",
    "remove",
    "resume",
    "run_now",
    "schedules",
    "stored_name",
    "sync",
    "unserved",
]
