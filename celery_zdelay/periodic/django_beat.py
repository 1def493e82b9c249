"""django-celery-beat's ``PeriodicTask`` rows as the companions' schedule source.

A Django shop edits its periodic tasks in the Django admin, as rows of
django-celery-beat. With Celery's own ``beat_scheduler`` naming
django-celery-beat's ``DatabaseScheduler`` (``celery beat -S django``), the
companions serve the enabled rows instead of ``beat_schedule``: each row
becomes a :class:`~celery_zdelay.periodic.definition.Definition` of source
``django-celery-beat``, stored in Redis and served with the same promises
(each tick once, any number of companions). Its schedule name is the
row's with ``_`` for spaces (the key of what is stored for it, part of its
occurrence ids); the row's own name is kept as its display name, shown
wherever schedules are listed and taken wherever a name is (see
:meth:`~celery_zdelay.periodic.store.PeriodicStore.stored_name`). The
rows are read again when django-celery-beat's own change marker
(``PeriodicTasks.last_update``, set on every save and delete) moves,
checked on every reconcile of the periodic server. Each such read takes
every enabled row's columns, and its schedule's, but builds a definition
again only for a row where they changed (see
:meth:`DjangoBeatSource.definitions`).

What is kept as django-celery-beat keeps it: ``last_run_at`` and
``total_run_count`` of a row are updated when one of its occurrences is
released, so the admin stays true. A crontab's time zone, ``start_time``,
``expires`` and ``one_off`` become the periodic options ``zdelay_timezone``,
``zdelay_start``, ``zdelay_end`` and ``zdelay_one_off``. A row that cannot
be served (an unknown task, bad JSON in ``args``, ``kwargs`` or
``headers``, an invalid crontab, an unknown time zone, an interval of 0, a
name that differs from an older row's by spaces and ``_`` only) is
reported by its name and skipped (and what was stored for it withdrawn); the
others are served. A clocked row runs once at its ``clocked_time``; a
moment already past when the row is read (first, or after an edit) runs at
once, as django-celery-beat runs it, unless the row ran at or after it.

Rows have no field for the overlap policy: it is read from the row's
``headers`` JSON, ``{"zdelay_overlap": "skip", "zdelay_overlap_timeout":
600}``, which the admin's "Execution Options" edit and keep (see
``docs/beat.rst``); those two keys are not sent as message headers.

A database that is down or restarting stops nothing: every read and write
here raises :class:`SourceUnavailableError`, and the periodic server goes on
serving the rows as last read (they are stored in Redis) and writes the runs
back once the database answers (django-celery-beat's own scheduler likewise
keeps its schedule when the database errors).

Only imported when that scheduler is configured: django-celery-beat and
Django are optional.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from functools import cache
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError
from .clocked import ClockedAt
from .definition import SOURCE_DJANGO_BEAT, Definition, from_beat_entry, schedule_name

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "DATABASE_SCHEDULER",
    "OVERLAP_KEYS",
    "ROWS_READING",
    "DjangoBeatSource",
    "SourceUnavailableError",
    "uses_django_beat",
]

logger = logging.getLogger(__name__)

#: django-celery-beat's scheduler, as Celery's ``beat_scheduler`` names it.
DATABASE_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
#: Names ``celery beat -S`` accepts for it (the entry point alias and its paths).
_NAMES = {"django", DATABASE_SCHEDULER, DATABASE_SCHEDULER.replace(":", ".")}

#: Keys of a row's ``headers`` JSON read as its overlap policy (not sent).
OVERLAP_KEYS = ("zdelay_overlap", "zdelay_overlap_timeout")

#: How this release reads the rows, stored with them (``define.lua``): rows
#: read at the same change marker by a later reading replace an earlier
#: one's, so an upgrade that reads them otherwise shows without an edit.
#: 1: source ``config``, the rows' names with ``_`` for spaces; 2: source
#: ``django-celery-beat``, and the rows' own names kept as display names.
ROWS_READING = 2

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)

#: Seconds per django-celery-beat interval period.
_PERIOD_SECONDS = {
    "days": 86400.0,
    "hours": 3600.0,
    "minutes": 60.0,
    "seconds": 1.0,
    "microseconds": 1e-6,
}


def uses_django_beat(app: Celery) -> bool:
    """Whether *app*'s ``beat_scheduler`` is django-celery-beat's database scheduler."""
    scheduler = app.conf.beat_scheduler
    return isinstance(scheduler, str) and scheduler in _NAMES


class SourceUnavailableError(Exception):
    """The Django database could not be read or written: down, restarting, refusing."""


@contextmanager
def _database(doing: str) -> Iterator[None]:
    """Turn Django's database errors while *doing* into :class:`SourceUnavailableError`."""
    from django.db import DatabaseError, close_old_connections

    # A long-lived process: connections the database closed (or that failed
    # in an outage) are replaced rather than used again.
    close_old_connections()
    try:
        yield
    except DatabaseError as exc:
        raise SourceUnavailableError(f"{doing} failed: {exc}") from exc


class DjangoBeatSource:
    """Reads the enabled rows; writes back their runs."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        #: The change marker of the rows as last read successfully.
        self._last_change: datetime | None = None
        #: The change marker read by changed(), kept once the rows are read.
        self._seen_change: datetime | None = None
        self._read_once = False
        #: Definition name -> the row's primary key (the schedule's name is
        #: the row's with ``_`` for spaces: see schedule_name).
        self._rows: dict[str, int] = {}
        #: Names of the one_off rows, disabled after their run as django-celery-beat does.
        self._one_off: set[str] = set()
        #: Definition name -> the row's last_run_at, epoch ms (rows that ran).
        self._last_runs: dict[str, int] = {}
        #: Definition name -> where a clocked row that has not run at its moment starts.
        self._pinned: dict[str, str] = {}
        #: Row primary key -> (fingerprint of what makes its definition, the
        #: definition or why it cannot be served), as last read: a read
        #: builds again only the rows whose fingerprint changed.
        self._built: dict[int, tuple[int, Definition | str]] = {}
        #: What every definition also depends on when it was built: the
        #: app's registered tasks and time zone.
        self._built_for: tuple[frozenset[str], str] | None = None

    def changed(self) -> bool:
        """Whether the rows changed since they were last read (always true at first)."""
        from django_celery_beat.models import PeriodicTasks

        with _database("Reading django-celery-beat's change marker"):
            last = PeriodicTasks.last_change()
        if self._read_once and last == self._last_change:
            return False
        # Not kept until the rows are read: a read that fails is tried again.
        self._seen_change = last
        return True

    def made(self) -> int | None:
        """When the rows as last read were made: their change marker, epoch microseconds.

        Configurations of rows are ordered by it, not by what they hold (see
        ``define.lua``): a row edited back to what it was is a new edit. None
        when no save ever set the marker.
        """
        last = self._last_change
        if last is None:
            return None
        if last.tzinfo is None:
            # Django without USE_TZ: the marker is naive, in its TIME_ZONE.
            from django.utils import timezone as django_timezone

            last = django_timezone.make_aware(last)
        return (last - _EPOCH) // timedelta(microseconds=1)

    def read_again(self) -> None:
        """Have the next :meth:`changed` say yes: the rows are read again.

        For a Redis that lost what was stored: the rows did not change, but
        they must be stored again. Every row is built again too: what was
        read last is not trusted where something went wrong.
        """
        self._read_once = False
        self._built = {}

    @staticmethod
    def close() -> None:
        """Close this thread's database connections (a thread that read the rows, ending)."""
        from django.db import connections

        connections.close_all()

    def definitions(self) -> tuple[list[Definition], dict[str, str]]:
        """Return the definitions of the enabled rows, and the errors by row name.

        A row that cannot be served is reported under its own name (as the
        admin shows it); what was stored for it is withdrawn all the same,
        since the configuration no longer names its schedule.

        Every enabled row is read, as plain columns, at each change, but a
        definition is built again only for a row whose fingerprint changed
        (see :func:`_fingerprint`): at 100,000 rows, the SQL took 0.7 s of a
        17.6 s read, making model instances and every definition the rest. The
        change marker says that something changed, not what, and a row's
        ``date_changed`` does not either: the admin's enable/disable
        actions, a bulk update and an edit of a shared interval or crontab
        leave it as it was.
        """
        from django_celery_beat.models import PeriodicTask

        known = set(self.app.tasks.keys())
        built_for = (frozenset(known), str(self.app.timezone))
        if built_for != self._built_for:
            # A task registered since, or another time zone: any row may differ.
            self._built = {}
            self._built_for = built_for
        definitions: list[Definition] = []
        errors: dict[str, str] = {}
        rows: dict[str, int] = {}
        one_off: set[str] = set()
        last_runs: dict[str, int] = {}
        pinned: dict[str, str] = {}
        built: dict[int, tuple[int, Definition | str]] = {}
        #: Schedule name -> the name of the row that has it.
        claimed: dict[str, str] = {}
        # By primary key: of two rows whose names differ only by spaces and
        # '_', the older has the schedule whatever order the database
        # returns them in (PostgreSQL returns an updated row last).
        query = PeriodicTask.objects.filter(enabled=True).order_by("pk")
        task_columns = _task_columns()
        with _database("Reading the django-celery-beat rows"):
            loaded = list(query.values_list(*task_columns))
            tables = {kind: _schedule_table(kind) for kind in _SCHEDULE_KINDS}
        for values in loaded:
            columns = dict(zip(task_columns, values, strict=True))
            schedules = {kind: tables[kind].get(columns[f"{kind}_id"]) for kind in _SCHEDULE_KINDS}
            row_name: str = columns["name"]
            name = schedule_name(row_name)
            first = claimed.setdefault(name, row_name)
            if first != row_name:
                errors[row_name] = (
                    f"django-celery-beat row {row_name!r} has the same schedule name, "
                    f"{name!r} (spaces as '_'), as the older row {first!r}, which has it: "
                    "rename one of them in the admin."
                )
                continue
            fingerprint = _fingerprint(values, schedules)
            before = self._built.get(columns["id"])
            if before is not None and before[0] == fingerprint:
                made = before[1]
            else:
                made = self._build(values, schedules, name, known)
            built[columns["id"]] = (fingerprint, made)
            if isinstance(made, str):
                errors[row_name] = made
                continue
            definitions.append(made)
            rows[name] = columns["id"]
            if columns["one_off"]:
                one_off.add(name)
            last_run = _ms(columns["last_run_at"])
            if last_run is not None:
                last_runs[name] = last_run
            clocked = schedules["clocked"]
            if clocked is None:
                continue
            moment_ms = _clocked_ms(_schedule_fields("clocked", clocked)["clocked_time"])
            if last_run is None or last_run < moment_ms:
                # django-celery-beat sends a clocked row whose moment has
                # passed at once, whenever it reads it: one that passed while
                # nothing served the row, or one the row was edited to.
                pinned[name] = f"={moment_ms - 1}"
        self._built = built
        self._rows = rows
        self._one_off = one_off
        self._last_runs = last_runs
        self._last_change = self._seen_change
        self._pinned = pinned
        self._read_once = True
        return definitions, errors

    def _build(
        self,
        values: tuple[Any, ...],
        schedules: dict[str, tuple[Any, ...] | None],
        name: str,
        known: set[str],
    ) -> Definition | str:
        """Build one row's definition from what was read, or say why it cannot be served."""
        try:
            return self._definition(_row(values, schedules), name, known)
        except ConfigurationError as exc:
            return str(exc)
        except Exception as exc:
            # Whatever else a hand-written row holds: it alone is not served.
            row_name = values[_task_columns().index("name")]
            return f"django-celery-beat row {row_name!r} cannot be read: {exc!r}"

    def last_runs(self) -> dict[str, int]:
        """Name -> when each row last ran (``last_run_at``, epoch ms), as last read.

        A schedule stored for the first time goes on from there: the switch
        from ``celery beat -S django`` loses and doubles no tick.
        """
        return dict(self._last_runs)

    def pinned(self) -> dict[str, str]:
        """Name -> ``"=<ms>"``: clocked rows that have not run at their moment, as last read.

        Stored or changed, such a schedule goes on from just before its
        moment, so a moment already past runs once, at once (see
        ``define.lua``); once it ran, the row's ``last_run_at`` says so.
        """
        return dict(self._pinned)

    def note_runs(self, runs: dict[str, int]) -> None:
        """Record released occurrences (definition name -> occurrence ms) on their rows.

        As django-celery-beat does after it sends a task: ``last_run_at`` and
        ``total_run_count``, and a ``one_off`` row disabled. Updated with
        ``QuerySet.update``, which sends no ``post_save``: the change marker
        does not move, so the schedule is not read again for a run (a
        disabled one-off row is dropped at the next edit: rows read at the
        same marker are not stored over each other; it has run its one run
        already). Each run written is removed from *runs*:
        when the database fails midway, what is left is what to write later
        (none counted twice).
        """
        from django.db.models import F
        from django_celery_beat.models import PeriodicTask

        with _database("Writing last_run_at to the django-celery-beat rows"):
            for name, occurrence_ms in list(runs.items()):
                pk = self._rows.get(name)
                if pk is not None:
                    changes: dict[str, Any] = {
                        "last_run_at": datetime.fromtimestamp(
                            occurrence_ms / 1000, tz=timezone.utc
                        ),
                        "total_run_count": F("total_run_count") + 1,
                    }
                    if name in self._one_off:
                        changes["enabled"] = False
                    PeriodicTask.objects.filter(pk=pk).update(**changes)
                del runs[name]

    def _definition(self, row: Any, name: str, known: set[str]) -> Definition:
        where = f"django-celery-beat row {row.name!r}"
        entry: dict[str, Any] = {
            "task": row.task,
            "schedule": self._schedule(row, where),
            "args": _json(row.args, list, "args", where),
            "kwargs": _json(row.kwargs, dict, "kwargs", where),
            "options": self._options(row, where),
        }
        # The overlap policy rides in the headers (rows have no field for it).
        headers = entry["options"].get("headers") or {}
        for key in OVERLAP_KEYS:
            if key in headers:
                entry[key] = headers.pop(key)
        if not headers:
            entry["options"].pop("headers", None)
        if row.one_off:
            # django-celery-beat disables the row after its run; here it is
            # counted once across companions (zdelay_one_off).
            entry["zdelay_one_off"] = True
        if row.start_time is not None:
            entry["zdelay_start"] = row.start_time
        if row.expires is not None:
            entry["zdelay_end"] = row.expires
        if row.crontab is not None and str(row.crontab.timezone) != str(self.app.timezone):
            entry["zdelay_timezone"] = str(row.crontab.timezone)
        return from_beat_entry(
            name,
            entry,
            known_tasks=known,
            source=SOURCE_DJANGO_BEAT,
            display_name=row.name,
            where=where,
        )

    def _schedule(self, row: Any, where: str) -> Any:
        from celery.schedules import crontab, solar

        if row.interval is not None:
            seconds = row.interval.every * _PERIOD_SECONDS.get(row.interval.period, 0.0)
            if seconds <= 0:
                raise ConfigurationError(f"{where}: interval {row.interval} is not positive.")
            return seconds
        if row.crontab is not None:
            cron = row.crontab
            try:
                return crontab(
                    minute=cron.minute,
                    hour=cron.hour,
                    day_of_week=cron.day_of_week,
                    day_of_month=cron.day_of_month,
                    month_of_year=cron.month_of_year,
                    app=self.app,
                )
            except (ValueError, TypeError) as exc:
                raise ConfigurationError(f"{where}: invalid crontab: {exc}") from None
        if row.solar is not None:
            sun = row.solar
            try:
                return solar(sun.event, float(sun.latitude), float(sun.longitude), app=self.app)
            except (ValueError, TypeError) as exc:
                raise ConfigurationError(f"{where}: invalid solar schedule: {exc}") from None
        if row.clocked is not None:
            return ClockedAt(_clocked_ms(row.clocked.clocked_time), app=self.app)
        raise ConfigurationError(f"{where} has no schedule.")

    @staticmethod
    def _options(row: Any, where: str) -> dict[str, Any]:
        options: dict[str, Any] = {}
        for field in ("queue", "exchange", "routing_key"):
            value = getattr(row, field)
            if value:
                options[field] = value
        if row.priority is not None:
            options["priority"] = row.priority
        headers = _json(row.headers, dict, "headers", where)
        if headers:
            options["headers"] = headers
        if row.expire_seconds:
            # Seconds after the occurrence, as celery beat counts from sending it.
            options["expires"] = row.expire_seconds
        return options


#: PeriodicTask's foreign keys to its schedules, one of which a row has.
_SCHEDULE_KINDS = ("interval", "crontab", "solar", "clocked")
#: Columns this package writes itself (note_runs): read each time, but not
#: part of a row's fingerprint, or each run would build its row again.
_WRITTEN_HERE = ("last_run_at", "total_run_count")


@cache
def _task_columns() -> tuple[str, ...]:
    """PeriodicTask's columns as read, in the model's order.

    All of them, whatever django-celery-beat's version adds: a column left
    out would be an edit never seen.
    """
    from django_celery_beat.models import PeriodicTask

    return tuple(f.attname for f in PeriodicTask._meta.concrete_fields)


@cache
def _fingerprinted() -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """Of a row's columns as read, those its fingerprint is made of: all but those written here."""
    columns = _task_columns()
    return itemgetter(*(i for i, column in enumerate(columns) if column not in _WRITTEN_HERE))


@cache
def _schedule_model(kind: str) -> Any:
    from django_celery_beat.models import PeriodicTask

    return PeriodicTask._meta.get_field(kind).related_model


@cache
def _schedule_columns(kind: str) -> tuple[str, ...]:
    return tuple(f.attname for f in _schedule_model(kind)._meta.concrete_fields)


def _schedule_fields(kind: str, values: tuple[Any, ...]) -> dict[str, Any]:
    """A schedule's columns by name (*values* as :func:`_schedule_table` read them)."""
    return dict(zip(_schedule_columns(kind), values, strict=True))


def _schedule_table(kind: str) -> dict[Any, tuple[Any, ...]]:
    """Every schedule of *kind*: primary key -> its columns (:func:`_schedule_columns`).

    A crontab's time zone is read as its text: turned into a zone as it is
    read, a name that does not exist would fail the whole read, where it
    must fail its rows alone (see :func:`_row`).
    """
    from django.db.models import CharField
    from django.db.models.functions import Cast

    columns = [
        Cast(column, CharField()) if column == "timezone" else column
        for column in _schedule_columns(kind)
    ]
    return {values[0]: values for values in _schedule_model(kind).objects.values_list(*columns)}


def _fingerprint(values: tuple[Any, ...], schedules: dict[str, tuple[Any, ...] | None]) -> int:
    """What a row's definition is built from: its columns and its schedule's, hashed.

    The columns written here are left out (:func:`_fingerprinted`). A
    64-bit hash rather than the values themselves: kept for every row,
    those would take tens of MiB at 100,000 rows; two versions of one row
    hashing alike is a chance of one in 2**64.
    """
    return hash((_fingerprinted()(values), *schedules.values()))


def _row(values: tuple[Any, ...], schedules: dict[str, tuple[Any, ...] | None]) -> Any:
    """A row as a model instance, its schedule attached, from what was read (no query).

    Built from the very values its fingerprint is made of, so a definition
    kept for a fingerprint is the one those values make, whatever changed
    in the database between the reads.

    Raises:
        ConfigurationError: its crontab's time zone does not exist (a name
            removed from the tz database, or written by hand):
            django-celery-beat's time zone field refuses it as it is set.
    """
    from django.core.exceptions import ValidationError
    from django_celery_beat.models import PeriodicTask

    # As Django makes the instances of a query: positional, about twice as
    # fast as by keyword.
    row = PeriodicTask.from_db(None, _task_columns(), values)
    for kind, columns in schedules.items():
        schedule = None
        if columns is not None:
            try:
                schedule = _schedule_model(kind).from_db(None, _schedule_columns(kind), columns)
            except ValidationError as exc:
                raise ConfigurationError(
                    f"django-celery-beat row {row.name!r}: its crontab's time zone does not "
                    f"exist ({' '.join(exc.messages)}): pick an IANA name such as "
                    "'Europe/Paris' in the admin."
                ) from None
        if schedule is not None or getattr(row, f"{kind}_id") is not None:
            # None too: a schedule gone since the rows were read is not queried.
            setattr(row, kind, schedule)
    return row


def _ms(moment: datetime | None) -> int | None:
    """A moment as epoch ms (None stays None)."""
    return None if moment is None else round(moment.timestamp() * 1000)


def _clocked_ms(moment: datetime) -> int:
    """A clocked row's moment, epoch ms (a naive time is in Django's ``TIME_ZONE``)."""
    from django.utils import timezone as django_timezone

    if django_timezone.is_naive(moment):
        moment = django_timezone.make_aware(moment)
    return round(float(moment.timestamp()) * 1000)


def _json(text: str | None, kind: type, field: str, where: str) -> Any:
    try:
        value = json.loads(text or ("[]" if kind is list else "{}"))
    except ValueError as exc:
        raise ConfigurationError(f"{where}: {field} is not valid JSON ({exc}).") from None
    if not isinstance(value, kind):
        raise ConfigurationError(f"{where}: {field} must be a JSON {kind.__name__}.")
    return value
