"""Steer periodic schedules at run time: list, pause, resume, run now, add, remove.

Everything is stored in Redis, so it holds for every companion and survives
their restarts. Names are those of ``beat_schedule`` (or given to :func:`add`);
a django-celery-beat row's schedule is named by the row's name in the admin
("Every ten seconds") as well as by its schedule name (``Every_ten_seconds``,
see :func:`stored_name`).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..app_state import cached, store_for
from ..errors import ConfigurationError
from ..parking import send_delayed
from .definition import SOURCE_API, Definition, from_beat_entry, validate_spec
from .store import COUNTERS, PeriodicStore, Pointer
from .withdrawals import announcer

if TYPE_CHECKING:
    from celery import Celery

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


@dataclass(frozen=True)
class ScheduleInfo:
    """One periodic schedule as stored, with where it stands."""

    #: The schedule's name: the key of what is stored for it, in its occurrence ids.
    name: str
    task: str
    #: The schedule as a person reads it: ``every 10s``, ``crontab 0 3 * * *``.
    schedule: str
    #: ``config`` (beat_schedule), ``django-celery-beat`` (a row) or ``api``
    #: (added at run time).
    source: str
    missed: str
    paused: bool
    version: int
    #: Earliest occurrence parked and not yet due (epoch ms), if any.
    next_run_ms: int | None
    #: Last occurrence a companion released (before one is seen: the last due), epoch ms.
    last_run_ms: int | None
    #: How late the companion released it (ms), when it was seen released.
    last_run_lateness_ms: int | None
    args: list[Any]
    kwargs: dict[str, Any]
    options: dict[str, Any]
    #: The name people know it by: a django-celery-beat row's name in the
    #: admin ("Every ten seconds"), else *name*. Either names it to every
    #: function here and every ``zdelay periodic`` command.
    display_name: str
    #: ``zdelay_overlap``: allow, skip or buffer_one.
    overlap: str = "allow"
    #: Task id of the last occurrence a companion released, when it was seen released.
    last_run_id: str | None = None
    #: Ticks counted so far: missed, skipped_overlap, late (see ``periodic/store.py``).
    counts: dict[str, int] = field(default_factory=dict)


def schedules(app: Celery) -> tuple[int, list[ScheduleInfo]]:
    """Return the Redis clock (ms) and every stored schedule, by name."""
    return schedules_in(_periodic(app))


def schedules_in(
    periodic: PeriodicStore, names: Sequence[str] | None = None
) -> tuple[int, list[ScheduleInfo]]:
    """Return the Redis clock (ms) and every schedule stored in *periodic*, by name.

    With *names*, those of them stored, in that order: read for what they
    are (see :meth:`PeriodicStore.snapshot_of`), not for what is stored.
    """
    snap = periodic.snapshot() if names is None else periodic.snapshot_of(names)
    result = []
    for name in sorted(snap.definitions) if names is None else names:
        if name not in snap.definitions:
            continue
        definition = snap.definitions[name]
        pointer = snap.pointers.get(name) or Pointer(0, 0, [])
        # When each runs: its time plus the schedule's jitter offset.
        times = [ms + definition.offset_ms(ms) for ms, _ in pointer.parked]
        upcoming = [ms for ms in times if ms > snap.now_ms]
        if not upcoming and pointer.next_ms is not None and pointer.next_ms > snap.now_ms:
            # Too far ahead to be parked yet (PARK_LEAD_MS): the planner wrote it down.
            upcoming = [pointer.next_ms + definition.offset_ms(pointer.next_ms)]
        past = [ms for ms in times if ms <= snap.now_ms]
        result.append(
            ScheduleInfo(
                name=name,
                task=definition.task,
                schedule=definition.describe(),
                source=definition.source,
                missed=definition.missed,
                paused=name in snap.paused,
                version=pointer.version,
                next_run_ms=None if name in snap.paused or not upcoming else min(upcoming),
                last_run_ms=_last_run(snap.runs.get(name), past),
                last_run_lateness_ms=snap.runs[name][1] if name in snap.runs else None,
                args=definition.args,
                kwargs=definition.kwargs,
                options=definition.options,
                display_name=definition.label,
                overlap=definition.overlap,
                last_run_id=snap.last_ids.get(name),
                counts={c: snap.counts.get(name, {}).get(c, 0) for c in COUNTERS},
            )
        )
    return snap.now_ms, result


def unserved(app: Celery) -> dict[str, str]:
    """Return name -> why, of the configured entries no companion serves (bad rows, say)."""
    return _periodic(app).unserved()


def stored_name(name: str, *, app: Celery) -> str | None:
    """Return the name of the schedule *name* designates, or None if none is stored.

    *name* is a schedule's name, or the name people know it by: a
    django-celery-beat row's name in the admin ("Every ten seconds") names
    the row's schedule (``Every_ten_seconds``). Every function here that
    takes a name takes either.
    """
    return _periodic(app).stored_name(name)


def pause(name: str, *, app: Celery) -> bool:
    """Pause a schedule (its parked occurrences are cancelled); False if unknown."""
    periodic = _periodic(app)
    stored = periodic.stored_name(name)
    return stored is not None and periodic.set_paused(stored, True) != 0


def resume(name: str, *, app: Celery) -> bool:
    """Resume a paused schedule from now (what passed meanwhile does not run); False if unknown."""
    periodic = _periodic(app)
    stored = periodic.stored_name(name)
    return stored is not None and periodic.set_paused(stored, False) != 0


def run_now(name: str, *, app: Celery) -> str:
    """Run a schedule's task once now, outside its schedule; return the task id.

    Raises:
        ConfigurationError: no schedule has that name.
    """
    definition = _definition(_periodic(app), name)
    task_id = f"periodic:{definition.name}:run:{uuid.uuid4().hex[:12]}"
    send_delayed(
        app,
        definition.task,
        definition.args,
        definition.kwargs,
        countdown=0,
        task_id=task_id,
        **definition.options,
    )
    return task_id


def add(
    name: str,
    *,
    app: Celery,
    task: str,
    schedule: Any,
    args: Any = (),
    kwargs: Any = None,
    options: Any = None,
    relative: bool = False,
    missed: str = "once",
    jitter: float = 0.0,
    timezone: str | None = None,
    start: Any = None,
    end: Any = None,
    max_runs: int | None = None,
    one_off: bool = False,
    overlap: str = "allow",
    overlap_timeout: float | None = None,
) -> bool:
    """Add (or replace) a schedule at run time, in ``beat_schedule``'s terms.

    Returns whether anything changed. A later ``beat_schedule`` deploy
    replaces an entry of the same name. *jitter* (seconds) is
    ``zdelay_jitter``: each occurrence runs at an offset of its own in
    ``[0, jitter)`` after its time. *timezone* (an IANA name) is
    ``zdelay_timezone``: a crontab in that zone rather than the app's.
    *start* and *end* (datetimes or ISO strings), *max_runs* and *one_off*
    are ``zdelay_start``, ``zdelay_end``, ``zdelay_max_runs`` and
    ``zdelay_one_off``. *overlap* and *overlap_timeout* (seconds) are
    ``zdelay_overlap`` and ``zdelay_overlap_timeout``.

    Raises:
        ConfigurationError: the task is unknown to *app*, or the entry cannot
            be stored (invalid schedule, arguments that are not JSON).
    """
    entry = {
        "task": task,
        "schedule": schedule,
        "args": args,
        "kwargs": kwargs or {},
        "options": options or {},
        "relative": relative,
        "zdelay_missed": missed,
        "zdelay_jitter": jitter,
    }
    optional = {
        "zdelay_timezone": timezone,
        "zdelay_start": start,
        "zdelay_end": end,
        "zdelay_max_runs": max_runs,
        "zdelay_one_off": one_off or None,
        "zdelay_overlap": None if overlap == "allow" else overlap,
        "zdelay_overlap_timeout": overlap_timeout,
    }
    entry.update({key: value for key, value in optional.items() if value is not None})
    app.loader.import_default_modules()
    definition = from_beat_entry(name, entry, known_tasks=set(app.tasks.keys()), source=SOURCE_API)
    validate_spec(definition.schedule, app, f"periodic schedule {name!r}")
    return _periodic(app).put(definition, writer="api")


def remove(name: str, *, app: Celery) -> bool:
    """Remove a schedule (its parked occurrences are cancelled); False if unknown.

    An entry of ``beat_schedule`` comes back with the next deploy that
    changes ``beat_schedule``; remove it there too.
    """
    periodic = _periodic(app)
    stored = periodic.stored_name(name)
    return stored is not None and bool(periodic.drop([stored]))


def sync(app: Celery, *, force: bool = False) -> str:
    """Store *app*'s ``beat_schedule`` now, as a starting companion does.

    With *force*, even a configuration that a newer one replaced (a rollback).
    Returns "same", "older" (not written: pass force) or "done".
    """
    from .server import PeriodicServer

    app.loader.import_default_modules()
    server = PeriodicServer(app, store_for(app), companion_id="cli")
    return server.reconcile(force=force)


def backfill(name: str, *, app: Celery, since: Any, until: Any = None) -> list[str]:
    """Run now, once each, the missed occurrences of *name* between *since* and *until*.

    Missed occurrences are those the missed policy (``zdelay_missed``) left
    out while no companion or broker served the schedule; the companions
    remember the last 1,000 of each schedule. Each runs under its own
    occurrence id, as the companions would have run it, and is taken from
    that memory as it is parked: a second backfill of the same window, or
    one running at the same time, finds nothing to run. *since* and
    *until* (default: now) are datetimes (naive: UTC) or ISO 8601 strings.
    Returns the ids parked, oldest first.

    Raises:
        ConfigurationError: no schedule has that name, or the window is invalid.
    """
    from .definition import moment_ms
    from .server import PeriodicServer

    periodic = _periodic(app)
    definition = _definition(periodic, name)
    name = definition.name
    now_ms = periodic.store.time_ms()
    where = f"backfill of {definition.label!r}"
    since_ms = moment_ms(since, "since", where)
    until_ms = moment_ms(until, "until", where)
    until_ms = now_ms if until_ms is None else min(until_ms, now_ms)
    if since_ms is None or until_ms < since_ms:
        raise ConfigurationError(
            f"{where}: give since (an ISO 8601 time), before until and before now."
        )
    app.loader.import_default_modules()
    server = PeriodicServer(app, periodic.store, companion_id="backfill")
    parked = []
    for ms, task_id in periodic.missed_between(name, since_ms, until_ms):
        # Claimed first: whoever claims it parks it, so it never runs twice
        # (an interrupted backfill leaves it out rather than run it twice).
        requests = server.requests_for(definition, task_id, ms, due_ms=now_ms)
        if periodic.claim_missed(name, task_id):
            periodic.store.park(requests)
            parked.append(task_id)
    return parked


def _last_run(run: tuple[int, int] | None, past: list[int]) -> int | None:
    """The last occurrence a companion released; before any is seen, the last one due."""
    if run is not None:
        return run[0]
    return max(past) if past else None


def _definition(periodic: PeriodicStore, name: str) -> Definition:
    """The stored definition *name* designates (see :func:`stored_name`).

    Raises:
        ConfigurationError: no schedule has that name.
    """
    stored = periodic.stored_name(name)
    definition = None if stored is None else periodic.snapshot_of([stored]).definitions.get(stored)
    if definition is None:
        raise ConfigurationError(
            f"No periodic schedule is named {name!r}: see zdelay periodic list."
        )
    return definition


def _periodic(app: Celery) -> PeriodicStore:
    store = store_for(app)
    periodic: PeriodicStore = cached(
        app,
        "periodic",
        # A change made here is the caller's: the audit line names no companion.
        lambda: PeriodicStore(store, on_withdrawn=announcer(app, None)),
        valid=lambda known: known.store is store,
    )
    return periodic
