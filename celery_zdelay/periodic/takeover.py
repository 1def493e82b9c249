"""Taking schedules over from celery beat: when each entry last ran there.

A schedule stored for the first time starts from now, as a new entry does
in celery beat; one that celery beat served until a moment ago must go on
from its last run instead, or the switch loses the tick that falls between
beat's last run and the companion's first (and an interval would restart a
full period later). celery beat's ``PersistentScheduler`` keeps that time
per entry in its schedule file (``beat_schedule_filename``, beat's ``-s``,
default ``celerybeat-schedule``); ``--since`` gives one time for every
entry when there is no file (beat ran elsewhere, or with another
scheduler).

The file is celery beat's own (a ``shelve`` of pickled entries, written by
the project's beat process), read only by a companion started with
``--beat``; nothing read from Redis is ever unpickled.
"""

from __future__ import annotations

import logging
import os
import shelve
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from ..app_state import set_value, value

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["beat_last_runs", "set_since", "since_for"]

logger = logging.getLogger(__name__)


def set_since(app: Celery, since_ms: int | None) -> None:
    """Make entries stored for the first time by *app*'s companions go on from *since_ms*."""
    set_value(app, "since", since_ms)


def since_for(app: Celery, names: list[str]) -> dict[str, int]:
    """Return name -> epoch ms each entry last ran before this companion served it.

    From celery beat's schedule file when it exists (``beat_schedule_filename``),
    else the ``--since`` time for every name, else nothing (new entries
    start from now). Only entries stored for the first time use it.
    """
    since: int | None = value(app, "since")
    path = str(app.conf.beat_schedule_filename or "")
    runs = beat_last_runs(path) if path else {}
    result = {name: since for name in names if since is not None}
    result.update({name: ms for name, ms in runs.items() if name in names})
    return result


def beat_last_runs(path: str) -> dict[str, int]:
    """Return entry name -> epoch ms of its last run, read from celery beat's schedule file.

    An empty mapping when there is no such file or it cannot be read (logged).
    """
    if not _exists(path):
        return {}
    try:
        with shelve.open(path, flag="r") as db:
            entries: Mapping[str, Any] = db.get("entries") or {}
            utc = bool(db.get("utc_enabled", True))
            runs = {}
            for name, entry in entries.items():
                ms = _epoch_ms(getattr(entry, "last_run_at", None), utc=utc)
                if ms is not None:
                    runs[str(name)] = ms
    except Exception as exc:  # a damaged or locked file must not stop the companion
        logger.warning(
            "celery beat's schedule file %s cannot be read (%s): schedules stored for the "
            "first time start from now. Stop celery beat before starting companions, or "
            "pass --since with the time beat stopped.",
            path,
            exc,
        )
        return {}
    if runs:
        logger.info(
            "Read the last runs of %d celery beat entries from %s: new schedules go on from there",
            len(runs),
            path,
        )
    return runs


def _exists(path: str) -> bool:
    # dbm backends add their own suffixes (.db, .dat/.dir/.bak).
    return any(os.path.exists(path + suffix) for suffix in ("", ".db", ".dat", ".dir"))


def _epoch_ms(value: Any, *, utc: bool) -> int | None:
    if not isinstance(value, datetime):
        return None
    if value.tzinfo is None:
        # celery beat stores naive times in UTC unless enable_utc is off.
        value = value.replace(tzinfo=timezone.utc) if utc else value.astimezone()
    return int(value.timestamp() * 1000)
