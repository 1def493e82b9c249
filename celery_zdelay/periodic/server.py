"""Serve periodic schedules from a companion: reconcile, then park ahead.

Every companion does the same thing, with no leader and no lock:

* at start (and when its ``beat_schedule`` changes) it stores its
  configuration in Redis, unless a newer one is stored already
  (:meth:`PeriodicServer.reconcile`);
* on every pass it reads the schedules due (those whose score in the
  visits zset, kept by the scripts that write pointers and runs, falls
  within :data:`HORIZON_MS`) and parks each one's occurrences up to
  :data:`HORIZON_MS` ahead, each under a deterministic id (schedule,
  version, occurrence time) and through ``park_once``, so a second
  companion parking the same occurrence changes nothing, and an occurrence
  already released is never parked again (:meth:`tend`). A pass costs what
  is due, not what is stored;
* an occurrence more than :data:`PARK_LEAD_MS` ahead is not parked yet:
  its schedule is looked at again within the hour before (``defer.lua``).

Releasing is the companion's ordinary job: an occurrence is a parked entry.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import zlib
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from celery.schedules import BaseSchedule

from ..capture import announce_parked, capture
from ..errors import ZDelayError
from ..parking import park_requests
from ..schedule import Due
from ..store import ParkRequest, Store
from .definition import (
    Definition,
    config_hash,
    definitions_from_config,
    entry_copy,
    same_entry,
)
from .django_beat import (
    ROWS_READING,
    DjangoBeatSource,
    SourceUnavailableError,
    uses_django_beat,
)
from .occurrences import plan
from .overlap import overlap_headers
from .recent import Recent
from .rows_reader import Rows, RowsReader, read_rows
from .store import (
    LATE_MS,
    WAITING_HELD,
    PeriodicStore,
    Pointer,
    Snapshot,
    next_visit_ms,
)
from .takeover import since_for
from .withdrawals import announcer

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "HORIZON_MS",
    "PARK_LEAD_MS",
    "STALE_MS",
    "TEND_EVERY_SECONDS",
    "PeriodicServer",
    "occurrence_id",
]

logger = logging.getLogger(__name__)

#: Occurrences are parked this far ahead (and the first one after that
#: too, unless it is more than :data:`PARK_LEAD_MS` ahead), so the next one
#: is parked long before the current one is released, even by a companion
#: that stalls.
HORIZON_MS = 5000
#: An occurrence still parked this long after its time was missed: no
#: companion released it (all were down, or the broker was). Its schedule's
#: ``zdelay_missed`` then decides which of the missed ones run.
STALE_MS = 2000
#: An occurrence further ahead than this is not parked yet: its schedule
#: is looked at again between this long and half as long before it is due
#: (:meth:`PeriodicServer._wake_ms`, spread by name), so a first start over
#: 100,000 schedules, or 100,000 ticks at one instant, parks them over half
#: an hour instead of in one pass that every other schedule waits for.
PARK_LEAD_MS = 3_600_000
#: Least time between two passes over the stored schedules.
TEND_EVERY_SECONDS = 0.25
#: How often the app's own beat_schedule is compared with what was stored
#: (a comparison of every entry: 377 ms at 10,000 entries).
RECONCILE_CHECK_SECONDS = 5.0
#: How often django-celery-beat's change marker is read instead: one row of
#: one table, read by django-celery-beat's own scheduler at each of its
#: ticks too. Each second of it is a second of every edit's bound.
ROWS_CHECK_SECONDS = 1.0
#: A round of the rows' reader (:class:`RowsReader`) waiting this long on
#: the database is logged as an outage: periodic tasks go on meanwhile.
#: Longer than a read of 100,000 rows (seconds), shorter than a host that
#: drops packets keeps a connection waiting (about 2 minutes of SYN retries).
ROWS_SILENT_SECONDS = 60.0
#: How long a starting companion waits for its first read of the rows
#: before its first pass: a database that hangs does not hold the schedules
#: stored in Redis (the rows are stored once read).
FIRST_READ_SECONDS = 10.0
#: Celery schedule objects kept for reuse, by spec (:meth:`PeriodicServer._schedule`):
#: at most 50 MB of crontabs, and specs that differ row by row are built
#: again only when visited (about once per occurrence).
SCHEDULES_KEPT = 10_000


def occurrence_id(name: str, version: int, occurrence_ms: int) -> str:
    """Return the task id of one occurrence: the same in every companion."""
    when = datetime.fromtimestamp(occurrence_ms / 1000, tz=timezone.utc)
    return f"{_version_prefix(name, version)}{when.isoformat(timespec='milliseconds')[:-6]}Z"


def _seen_entries(
    beat_schedule: Any, definitions: Sequence[Definition]
) -> dict[str, tuple[Any, Definition]]:
    """Name -> (a copy of its entry, its definition), for the entries served.

    Those in error are left out: they are checked again at the next read.
    """
    built = {d.name: d for d in definitions}
    if not isinstance(beat_schedule, dict):
        return {}
    return {
        str(name): (entry_copy(entry), built[str(name)])
        for name, entry in beat_schedule.items()
        if str(name) in built
    }


def _version_prefix(name: str, version: int) -> str:
    """What the ids of one version's occurrences start with."""
    return f"periodic:{name}:v{version}:"


class PeriodicServer:
    """The periodic part of one companion."""

    def __init__(self, app: Celery, store: Store, *, companion_id: str) -> None:
        self.app = app
        self.periodic = PeriodicStore(store, on_withdrawn=announcer(app, companion_id))
        self.companion_id = companion_id
        self.horizon_ms = HORIZON_MS
        self.park_lead_ms = PARK_LEAD_MS
        #: Celery's schedule objects by spec (:meth:`_schedule`), least
        #: recently used first.
        self._schedules: Recent[str, BaseSchedule] = Recent(SCHEDULES_KEPT)
        self._config_hash: str | None = None
        self._config_errors: dict[str, str] = {}
        #: The beat_schedule last compared with what is stored, as it was
        #: then (name -> (entry copy, definition), see :func:`entry_copy`),
        #: and the hash it gave.
        self._config_seen: tuple[dict[str, tuple[Any, Definition]], str] | None = None
        self._last_tend = 0.0
        self._imported = False
        #: Whether beat's last runs were offered to Redis (the first store).
        self._took_over = False
        self._last_check = 0.0
        #: (name, version) whose parking failed, logged once.
        self._failing: set[tuple[str, int]] = set()
        #: Occurrences this companion parked (first parker), for its totals.
        self.parked = 0
        #: Id -> (schedule name, occurrence ms) of the occurrences parked
        #: lately that no companion has recorded as run yet.
        self._pending: dict[str, tuple[str, int]] = {}
        #: The earliest occurrence ms in _pending (or earlier: one released
        #: since stays until the next tend), None when there is none.
        self._next_pending_ms: int | None = None
        #: Occurrences found released after their time (id -> schedule): not looked up again.
        self._settled: dict[str, str] = {}
        #: Whether the visits zset was checked against the schedules lately
        #: (at the first pass, then with each reconcile check).
        self._visits_checked = False
        #: Schedules with missed occurrences still waiting or held (logged once).
        self._gaps: set[str] = set()
        #: Set once the first pass is over: a starting companion releases
        #: only after it, so what an outage left parked is sorted out first.
        self.first_pass = threading.Event()
        #: django-celery-beat's rows, when they are the schedule source.
        self._source = DjangoBeatSource(app) if uses_django_beat(app) else None
        #: Every call to the rows' database once serving (started by the
        #: first pass): a pass never waits on the database.
        self._reader: RowsReader | None = None
        #: Runs to write back to those rows (name -> occurrence ms), noted
        #: by the release loop, handed to the reader by the next pass.
        self._rows_ran: dict[str, int] = {}
        self._rows_ran_lock = threading.Lock()
        #: Whether the rows' database failed last time it was asked (logged once).
        self._source_down = False
        #: Schedule name -> the name people know it by (a row's name in the
        #: admin), of what this companion read: its log lines say that one.
        self._labels: dict[str, str] = {}

    # -- configuration --------------------------------------------------------

    def reconcile(self, *, force: bool = False, rows: Rows | None = None) -> str:
        """Store this app's ``beat_schedule`` unless a newer one is stored.

        Returns "same", "older" or "done" (see ``define.lua``). Entries that
        cannot be served are logged by name and left out; the others are
        stored. With django-celery-beat, the rows are read here, unless
        *rows* were read already (by the reader of a serving companion,
        :meth:`begin`; ``periodic sync`` reads them here).
        """
        self._last_check = time.monotonic()
        self._import_tasks()
        if self._source is not None:
            if rows is None:
                assert self._reader is None, "a serving companion's rows are read by its reader"
                try:
                    if not self._source.changed() and not force:
                        self._source_answers()
                        return "same"
                    rows = read_rows(self._source)
                except SourceUnavailableError as exc:
                    # Serve the rows as last read: they are stored in Redis.
                    self._source_fails(exc)
                    return "same"
                self._source_answers()
            definitions, errors = rows.definitions, rows.errors
        else:
            current = self.app.conf.beat_schedule or {}
            seen = self._config_seen
            if (
                not force
                and seen is not None
                and seen[1] == self._config_hash
                and isinstance(current, dict)
                and current.keys() == seen[0].keys()
                and all(same_entry(seen[0][name][0], entry) for name, entry in current.items())
            ):
                # Entries equal to those compared last time: no definition is
                # built, no body encoded (a second at 10,000 entries).
                return "same"
            # Entries unchanged since keep their definitions: an edit builds one.
            definitions, errors = definitions_from_config(
                self.app, previous=seen[0] if seen is not None else None
            )
            self._config_seen = None
        digest = config_hash(definitions, errors)
        # Rows are read only when their change marker moved, and each read
        # goes to Redis with that marker: rows edited back to what this
        # companion stored before are newer than what another stored since.
        unchanged = digest == self._config_hash and errors == self._config_errors
        if unchanged and self._source is None and not force:
            self._config_seen = (_seen_entries(current, definitions), digest)
            return "same"
        for name, error in errors.items():
            logger.error("Periodic task %r is not served: %s", name, error)
        self._config_errors = errors
        # Only the first store of a starting companion takes over from celery
        # beat: after Redis lost everything, beat's file is long out of date.
        # Entries go on from their last run there (django-celery-beat's
        # last_run_at, or beat's schedule file).
        since: dict[str, int | str] = {}
        if not self._took_over:
            names = [d.name for d in definitions]
            since.update(rows.last_runs if rows is not None else since_for(self.app, names))
        if rows is not None:
            # A clocked row whose moment passed runs once, changed or not.
            since.update(rows.pinned)
        self._took_over = True
        # A bad row is withdrawn (every companion reads the same rows); an
        # entry of beat_schedule stays as stored (another companion may import
        # its task module).
        try:
            status, changed = self.periodic.store_config(
                definitions,
                digest,
                writer=self.companion_id,
                force=force,
                keep=errors if self._source is None else None,
                withdraw=errors if self._source is not None else None,
                since=since,
                made=None if rows is None else rows.made,
                reading=ROWS_READING,
                # Only what changed since the last store: an edit of one row
                # among 100,000 holds Redis for that row (see define.lua).
                incremental=True,
            )
        except Exception:
            if self._source is not None:
                # The source counts these rows as read: without this, an
                # edit Redis refused or missed would wait for the next edit.
                self._read_again()
            raise
        # Kept for the names removed: they are no longer read.
        self._labels.update((d.name, d.label) for d in definitions)
        self._config_hash = digest
        if self._source is None:
            self._config_seen = (_seen_entries(current, definitions), digest)
        if status == "older" and self._source is not None:
            # Read before another companion read a later edit: that is stored,
            # and this one reads the rows again at its next check.
            logger.info(
                "The django-celery-beat rows this companion read (%s) are older than those "
                "stored in Redis: serving the stored ones",
                digest,
            )
        elif status == "older":
            logger.warning(
                "This companion's beat_schedule (%s) was replaced by a newer one in Redis (%s): "
                "serving the stored schedule. To make this configuration the current one again, "
                "run: celery -A proj zdelay periodic sync --force",
                digest,
                changed[0][1] if changed else "?",
            )
        elif status == "done":
            by_kind = {
                kind: _some_names(
                    [self._labels.get(name, name) for k, name in changed if k == kind]
                )
                for kind in ("new", "changed", "removed", "relabelled")
            }
            logger.info(
                "Stored %s %s (%d %s); new: %s; changed: %s; removed: %s%s",
                "beat_schedule" if self._source is None else "django-celery-beat rows",
                digest,
                len(definitions),
                "entries" if self._source is None else "rows",
                by_kind["new"],
                by_kind["changed"],
                by_kind["removed"],
                # Shown or owned otherwise, served as before (see define.lua).
                "" if by_kind["relabelled"] == "none" else f"; relabelled: {by_kind['relabelled']}",
            )
            for kind, name in changed:
                last_run = since.get(name)
                if kind == "new" and isinstance(last_run, int):
                    logger.info(
                        "Periodic task %r goes on from its last run elsewhere (%s): %s",
                        self._labels.get(name, name),
                        "celery beat" if self._source is None else "its last_run_at",
                        datetime.fromtimestamp(last_run / 1000, tz=timezone.utc).isoformat(),
                    )
        return status

    def begin(self) -> None:
        """Store the configuration, as a starting companion does before its first pass.

        ``beat_schedule`` at once. django-celery-beat's rows through the
        reader: stored here when read within :data:`FIRST_READ_SECONDS`,
        otherwise by the pass after their read (meanwhile the schedules
        stored in Redis are served).
        """
        if self._source is None:
            self.reconcile()
            return
        self._last_check = time.monotonic()
        reader = self._rows_reader()
        reader.check()
        if reader.wait_for_round(FIRST_READ_SECONDS):
            rows = reader.take()
            if rows is not None:
                self.reconcile(rows=rows)

    def _import_tasks(self) -> None:
        """Import the app's task modules once, as celery beat does: the tasks named are known."""
        if not self._imported:
            self.app.loader.import_default_modules()
            self._imported = True

    def stop(self) -> None:
        """End the rows' reader, if one was started (a stopping companion)."""
        if self._reader is not None:
            self._reader.stop()

    # -- each pass ------------------------------------------------------------

    def tend(self) -> int:
        """Park what is due within the horizon for every schedule; return how many parked.

        Cheap when there is nothing to do, however many schedules are stored:
        the clock and one pipelined read of the schedules due
        (:meth:`PeriodicStore.view`).
        """
        now = time.monotonic()
        if now - self._last_tend < TEND_EVERY_SECONDS:
            return 0
        self._last_tend = now
        try:
            return self._tend()
        finally:
            self.first_pass.set()

    def _check_config(self) -> None:
        """Compare the configuration with what is stored: every :data:`RECONCILE_CHECK_SECONDS`
        (django-celery-beat's rows: :data:`ROWS_CHECK_SECONDS`).

        A ``beat_schedule`` here. django-celery-beat's rows by the reader
        (:class:`RowsReader`), which reads them once their change marker
        moved, for a later pass to store: reading 100,000 rows takes
        seconds, and a database that hangs takes minutes, while the
        occurrences parked ahead of every schedule run out.
        """
        self._last_check = time.monotonic()
        if self._source is None:
            self.reconcile()
            return
        self._rows_reader().check()

    def _rows_reader(self) -> RowsReader:
        """The reader of the rows, started at its first use (by a pass: one thread)."""
        if self._reader is None:
            assert self._source is not None
            # Before the reader's first call: Celery's Django fixup sets
            # Django up as the app's modules are imported (in a project that
            # leaves django.setup() to it, the rows' models are otherwise
            # "Apps aren't loaded yet").
            self._import_tasks()
            self._reader = RowsReader(
                self._source,
                name=f"zdelay-rows-{self.companion_id}",
                on_fail=self._source_fails,
                on_answer=self._source_answers,
            )
        return self._reader

    def _read_again(self) -> None:
        """Have the rows read and built again at the next check, though unchanged."""
        assert self._source is not None
        if self._reader is None:
            self._source.read_again()
        else:
            self._reader.check(again=True)

    def _source_fails(self, exc: SourceUnavailableError | str) -> None:
        if not self._source_down:
            logger.warning(
                "%s; periodic tasks go on as last read from the database, and "
                "edits and last_run_at wait until it answers",
                exc,
            )
        self._source_down = True

    def _source_answers(self) -> None:
        if self._source_down:
            logger.warning("The django-celery-beat database answers again")
        self._source_down = False

    def _tend(self) -> int:
        now = time.monotonic()
        if self._source is not None:
            reader = self._rows_reader()
            with self._rows_ran_lock:
                ran, self._rows_ran = self._rows_ran, {}
            # Written at the reader's next round, before it reads the rows.
            reader.note_runs(ran)
            rows = reader.take()
            if rows is not None:
                self.reconcile(rows=rows)
                self._visits_checked = False
            waited = reader.waiting_for()
            if waited >= ROWS_SILENT_SECONDS:
                self._source_fails(
                    f"The django-celery-beat database has kept the companion waiting "
                    f"for {waited:.0f} s (the change marker, the rows or last_run_at)"
                )
        every = RECONCILE_CHECK_SECONDS if self._source is None else ROWS_CHECK_SECONDS
        if now - self._last_check >= every:
            self._check_config()
            self._visits_checked = False
        if not self._visits_checked:
            self._check_visits()
        snap = self.periodic.view(self.horizon_ms)
        if not snap.meta and self._config_hash is not None:
            # Redis lost everything (restarted without persistence, flushed):
            # store this companion's schedule again rather than serve nothing.
            logger.warning("No beat_schedule stored in Redis any more: storing this one again")
            self._config_hash = None
            if self._source is None:
                self.reconcile()
                snap = self.periodic.view(self.horizon_ms)
            else:
                # The rows did not change, but what was stored from them is
                # gone: the reader reads them again for a later pass to store.
                self._read_again()
        self._cancel(snap)
        self._withdraw_held_of_the_past(snap)
        # Built aside, then swapped in: note_released may read it meanwhile
        # (the companion's release loop, while this runs in its own thread).
        pending: dict[str, tuple[str, int]] = {}
        for name, pointer in snap.pointers.items():
            last_run = snap.runs.get(name, (-1, 0))[0]
            for ms, task_id in pointer.parked:
                if ms > last_run:
                    pending[task_id] = (name, ms)
        for name, held in snap.held.items():
            # Held back longer than the pointer remembers: its run, after a
            # resume, is recorded all the same.
            for ms, task_id in held:
                pending.setdefault(task_id, (name, ms))
        self._settle_parked(pending, snap)
        self._pending = pending
        self._next_pending_ms = min((ms for _, ms in pending.values()), default=None)
        parked = 0
        # Kept while a pointer remembers them: each is asked about once (those
        # of schedules not read this pass are kept as they are).
        remembered = {task_id for p in snap.pointers.values() for _, task_id in p.parked}
        self._settled = {
            task_id: name
            for task_id, name in self._settled.items()
            if name not in snap.pointers or task_id in remembered or task_id in pending
        }
        advanced: set[str] = set()
        later: list[tuple[str, Pointer, int, int]] = []
        for name, definition in snap.definitions.items():
            if name in snap.paused:
                continue
            try:
                gap_decided = self._sort_out_missed(definition, snap)
                parked += self._tend_one(
                    definition, snap, gap_decided=gap_decided, moved=advanced, later=later
                )
            except Exception as exc:
                if isinstance(exc, ZDelayError) and exc.transient:
                    raise  # the store's state, not this schedule's: the caller waits
                logger.exception(
                    "Periodic task %r: parking its next occurrences failed", definition.label
                )
        if later:
            self.periodic.defer(later)
            advanced.update(name for name, *_ in later)
        self._revisit_stale(snap, advanced)
        self.parked += parked
        return parked

    def _check_visits(self) -> None:
        """Build the visits zset again when it does not hold every schedule not paused.

        A store written by a release without it (or a zset removed by hand)
        would leave schedules unserved: they are put back, each as its
        stored state says. Three counts when nothing is missing.
        """
        if not self.periodic.visits_complete():
            listed = self.periodic.revisit_all()
            logger.info("Periodic schedules indexed for the planner again: %d", listed)
        self._visits_checked = True

    def _revisit_stale(self, snap: Snapshot, advanced: set[str]) -> None:
        """Score again the schedules read this pass whose score their state no longer gives.

        ``advance.lua`` and ``record_runs.lua`` score a schedule as they
        write it; one left as it was keeps its score, which may point at an
        occurrence that never runs (withdrawn by the missed policy,
        cancelled, dead-lettered) or at ids its pointer no longer needs to
        remember. ``revisit.lua`` forgets those ids (as ``advance.lua``
        does) and scores it from its stored state, so it is looked at again
        when that state says, not at every pass.
        """
        forget_before = snap.now_ms - self.periodic.remember_parked_ms
        stale = []
        for name, score in snap.visits.items():
            if name in advanced:
                continue
            pointer = snap.pointers.get(name)
            last_run = snap.runs.get(name, (-1, 0))[0]
            if next_visit_ms(pointer, last_run) != score or (
                pointer is not None and any(ms < forget_before for ms, _ in pointer.parked)
            ):
                stale.append(name)
        if stale:
            self.periodic.revisit(stale, snap.now_ms)

    def due_by(self, ms: int) -> bool:
        """Whether an occurrence not yet seen released is due at or before *ms*.

        The handoff moves entries inside Redis and names them only when asked
        (it costs a string per entry): the companion asks while this is true.
        """
        earliest = self._next_pending_ms
        return earliest is not None and earliest <= ms

    def note_released(self, task_ids: Sequence[str | None], lateness_ms: Sequence[int]) -> None:
        """Record the periodic occurrences among released entries, and how late they ran.

        Matched by task id (None: released without its id, so not an
        occurrence, see :meth:`due_by`): schedules that share an occurrence
        time each get their own entry's run, and only once it ran. One
        released unnamed (another companion parked it since this one's last
        pass) is recorded by :meth:`_settle_parked`.
        """
        pending = self._pending
        runs: dict[str, tuple[int, int, str]] = {}
        late_ticks: dict[str, int] = {}
        for task_id, late in zip(task_ids, lateness_ms, strict=True):
            if task_id is None:
                continue
            hit = pending.pop(task_id, None)
            if hit is not None:
                name, ms = hit
                if late > LATE_MS:
                    late_ticks[name] = late_ticks.get(name, 0) + 1
                if ms >= runs.get(name, (-1, 0, ""))[0]:
                    runs[name] = (ms, late, task_id)
        if runs:
            self._record_runs(runs)
        for name, ticks in late_ticks.items():
            self.periodic.count(name, "late", ticks)

    def _record_runs(self, runs: dict[str, tuple[int, int, str]]) -> None:
        """Record name -> (occurrence ms, lateness ms, id) of runs, each once across companions."""
        recorded = self.periodic.record_runs(
            {
                name: json.dumps(
                    {"ms": ms, "lateness_ms": late, "id": task_id, "by": self.companion_id}
                )
                for name, (ms, late, task_id) in runs.items()
            }
        )
        if self._source is not None:
            # Written by the periodic thread (tend): no database round trip
            # in the release loop.
            with self._rows_ran_lock:
                for name in recorded:
                    ms = runs[name][0]
                    self._rows_ran[name] = max(ms, self._rows_ran.get(name, ms))

    def _settle_parked(self, pending: dict[str, tuple[str, int]], snap: Snapshot) -> None:
        """Record the runs of occurrences released without their id, a while after their time.

        A companion names what it releases only while it knows an
        occurrence is due (:meth:`due_by`): one parked by another companion
        since its last pass and due at once (a clocked moment already past,
        a missed run) goes out unnamed. Its parker finds it gone from the
        store here and records the run (once: see ``record_runs.lua``), its
        lateness being at most the time since it was due.
        """
        overdue = [
            (task_id, name, ms)
            for task_id, (name, ms) in pending.items()
            if name not in snap.paused
            and ms + self._offset(snap, name, ms) <= snap.now_ms - LATE_MS
        ]
        if not overdue:
            return
        gone = self.periodic.released_among([(name, task_id) for task_id, name, _ in overdue])
        runs: dict[str, tuple[int, int, str]] = {}
        for task_id, name, ms in sorted(overdue, key=lambda item: item[2]):
            if task_id in gone:
                due = ms + self._offset(snap, name, ms)
                runs[name] = (ms, snap.now_ms - due, task_id)
                pending.pop(task_id, None)
        if runs:
            self._record_runs(runs)

    @staticmethod
    def _offset(snap: Snapshot, name: str, ms: int) -> int:
        definition = snap.definitions.get(name)
        return 0 if definition is None else definition.offset_ms(ms)

    def _cancel(self, snap: Snapshot) -> None:
        if not snap.to_cancel:
            return
        found = self.periodic.withdraw(snap.to_cancel)
        for task_id, was_parked in zip(snap.to_cancel, found, strict=True):
            if was_parked:
                logger.info("Cancelled periodic occurrence %s", task_id, extra={"task_id": task_id})
        self.periodic.forget_cancelled(snap.to_cancel)

    def _withdraw_held_of_the_past(self, snap: Snapshot) -> None:
        """Withdraw held occurrences of a schedule removed, paused or changed since.

        A change, removal or pause withdraws what its schedule's pointer
        remembers, held ones included (``define.lua``, ``pause.lua``); an
        occurrence held back longer than that is known from
        ``{zdelay:periodic}:held`` only, and goes here, at the next pass.
        """
        past: dict[str, list[str]] = {}
        for name, held in snap.held.items():
            pointer = snap.pointers.get(name)
            current = (
                None
                if pointer is None or name in snap.paused or name not in snap.definitions
                else _version_prefix(name, pointer.version)
            )
            for _, task_id in held:
                if current is None or not task_id.startswith(current):
                    past.setdefault(name, []).append(task_id)
        if not past:
            return
        ids = [task_id for gone in past.values() for task_id in gone]
        for task_id, was in zip(ids, self.periodic.withdraw(ids), strict=True):
            if was:
                logger.info(
                    "Cancelled periodic occurrence %s held back since its schedule changed",
                    task_id,
                    extra={"task_id": task_id},
                )
        for name, gone in past.items():
            self.periodic.note_held(name, {}, forget=gone)

    def _sort_out_missed(self, definition: Definition, snap: Snapshot) -> bool:
        """Apply the missed policy to occurrences that were not released in time.

        Occurrences parked ahead before every companion (or the broker) went
        away are still parked when one comes back, long after their time;
        occurrences of a paused queue or task (or beyond a rate limit) are
        held back, due, until the resume. Not released within
        :data:`STALE_MS` of their time, they are missed ticks like those no
        companion parked, and ``zdelay_missed`` counts them together, with
        every other occurrence of the schedule held back meanwhile (it
        belongs to the same gap): ``once`` keeps the first and withdraws the
        others, ``skip`` withdraws them all, ``all`` keeps them all. So a
        resume runs one tick for the pause, not every tick it held. Returns
        whether the policy was applied to this gap already, here or by
        another companion (so the plan adds no missed run).

        A starting companion does this before it releases anything
        (:attr:`first_pass`), so the others are withdrawn before they run.
        """
        pointer = snap.pointers.get(definition.name)
        if pointer is None:
            return False
        last_run = snap.runs.get(definition.name, (-1, 0))[0]
        # Those late enough to ask about, once each, and those found held
        # before (a pause may outlast what the pointer remembers). Also those
        # before the last run: under two companions, one that had not seen a
        # pause yet may release a tick after the one the other held.
        known = {task_id: ms for ms, task_id in snap.held.get(definition.name, [])}
        asked = {
            task_id: ms
            for ms, task_id in pointer.parked
            if ms + definition.offset_ms(ms) <= snap.now_ms - LATE_MS
            and task_id not in self._settled
        }
        asked.update(known)
        if not asked:
            return False
        where = self.periodic.waiting_among(list(asked))
        # Released, in flight or withdrawn: not asked about again.
        self._settled.update(
            {t: definition.name for t in asked if t not in where and t not in known}
        )
        held = {t for t, place in where.items() if place == WAITING_HELD}
        if held != set(known):
            self.periodic.note_held(
                definition.name,
                {t: asked[t] for t in held - set(known)},
                forget=set(known) - held,
            )
        if definition.missed == "all":
            return False
        # Missed: not released within STALE_MS of its time. One gone that
        # was before the last run ran in its time; one after it that is gone
        # was released late, or withdrawn by another companion's pass.
        stale = sorted(
            (ms, task_id)
            for task_id, ms in asked.items()
            if ms + definition.offset_ms(ms) <= snap.now_ms - STALE_MS
            and (task_id in where or last_run < ms)
        )
        if not stale:
            if not held:
                self._gaps.discard(definition.name)
            return False
        if not any(task_id in where for _, task_id in stale):
            # Released or withdrawn by another companion back from the same
            # outage (it ran its first pass first): it applied the policy to
            # this gap, so no missed run is added here either.
            return True
        # The gap: the missed ones still waiting, and what is held with them.
        waiting = [
            task_id
            for ms, task_id in sorted({*stale, *((asked[t], t) for t in held)})
            if task_id in where
        ]
        kept = waiting[:1] if definition.missed == "once" else []
        withdrawn = waiting[len(kept) :]
        found = self.periodic.store.cancel(withdrawn, how="withdrawn") if withdrawn else []
        self._settled.update(dict.fromkeys(withdrawn, definition.name))
        # Those this companion took back: another one back from the same
        # outage finds them gone and counts none.
        self.periodic.count(definition.name, "missed", sum(found))
        self.periodic.note_missed(
            definition.name,
            [(asked[t], t) for t, was in zip(withdrawn, found, strict=True) if was],
        )
        # Once per gap: a pause goes on withdrawing what it holds, pass by pass.
        level = logging.INFO if definition.name in self._gaps else logging.WARNING
        self._gaps.add(definition.name)
        logger.log(
            level,
            "Periodic task %r: %d occurrences were not released within %d ms of their time "
            "(no companion, no broker, or held back by a pause or a rate limit); "
            "zdelay_missed=%r runs %d of them, withdrew %d",
            definition.label,
            len(waiting),
            STALE_MS,
            definition.missed,
            len(kept),
            sum(found),
        )
        return True

    def _tend_one(
        self,
        definition: Definition,
        snap: Snapshot,
        *,
        gap_decided: bool = False,
        moved: set[str] | None = None,
        later: list[tuple[str, Pointer, int, int]] | None = None,
    ) -> int:
        """Park what is due of one schedule; add its name to *moved* if its pointer is written.

        With *later*, a schedule whose next occurrence is more than
        :data:`PARK_LEAD_MS` ahead, with nothing parked that waits for its
        run, parks nothing: (name, pointer, wake ms, next ms) is added to
        *later*, for the caller to put its next look off (``defer.lua``).
        """
        pointer = snap.pointers.get(definition.name)
        if pointer is None:
            return 0
        version = pointer.version
        sched = self._schedule(definition)
        todo = plan(
            sched,
            pointer_ms=pointer.ms,
            now_ms=snap.now_ms,
            horizon_ms=self.horizon_ms,
            # Missed ones parked ahead were counted already: none more.
            missed="skip" if gap_decided else definition.missed,
            inclusive=pointer.inclusive,
        )
        # The start and end dates and the run limit leave some out; every
        # companion planning from this pointer leaves out the same.
        todo_park = [ms for ms in todo.park if definition.in_window(ms)]
        if definition.max_runs is not None:
            todo_park = todo_park[: max(0, definition.max_runs - pointer.runs)]
        if later is not None and todo_park and not (todo.skipped or todo.missed or gap_decided):
            wake = self._wake_ms(definition.name, todo_park[0])
            last_run = snap.runs.get(definition.name, (-1, 0))[0]
            waiting = any(ms > last_run for ms, _ in pointer.parked)
            if wake > snap.now_ms + self.horizon_ms and not waiting and not pointer.inclusive:
                later.append((definition.name, pointer, wake, todo_park[0]))
                return 0
        if not todo_park:
            if todo.pointer_ms != pointer.ms:
                if moved is not None:
                    moved.add(definition.name)
                self.periodic.advance(
                    definition.name,
                    version,
                    todo.pointer_ms,
                    [],
                    snap.now_ms,
                    missed=todo.skipped,
                    missed_ids=self._missed_ids(definition, version, todo.missed),
                )
            return 0
        if todo.skipped:
            logger.warning(
                "Periodic task %r: %d occurrences passed while no companion served it; "
                "zdelay_missed=%r ran %s of them",
                definition.label,
                todo.skipped + len([ms for ms in todo_park if ms <= snap.now_ms]),
                definition.missed,
                len([ms for ms in todo_park if ms <= snap.now_ms]),
            )
        parked: list[tuple[int, str]] = []
        first = 0
        for ms in todo_park:
            task_id = occurrence_id(definition.name, version, ms)
            try:
                requests = self._requests(definition, task_id, ms)
            except Exception as exc:
                if (definition.name, version) not in self._failing:
                    self._failing.add((definition.name, version))
                    logger.error(
                        "Periodic task %r cannot be parked: %s. Fix the entry "
                        "(celery -A proj zdelay periodic add/remove, or beat_schedule).",
                        definition.label,
                        exc,
                    )
                break
            for request in requests:
                if self.periodic.park_once(request, occurrence_ms=ms):
                    # Once, by the companion that parked it: the others built
                    # the same occurrence and parked nothing.
                    announce_parked([request.message])
                    first += 1
                    logger.debug(
                        "Parked periodic %s[%s]",
                        definition.task,
                        task_id,
                        extra={"task_id": task_id, "task_name": definition.task},
                    )
            parked.append((ms, task_id))
            self._pending[task_id] = (definition.name, ms)
            if self._next_pending_ms is None or ms < self._next_pending_ms:
                self._next_pending_ms = ms
        if not parked:
            return 0
        # Past what the dates and the limit left out too, unless parking stopped early.
        new_pointer = todo.pointer_ms if len(parked) == len(todo_park) else parked[-1][0]
        if moved is not None:
            moved.add(definition.name)
        status = self.periodic.advance(
            definition.name,
            version,
            new_pointer,
            parked,
            snap.now_ms,
            missed=todo.skipped,
            missed_ids=self._missed_ids(definition, version, todo.missed),
        )
        if status != "done":
            # Only on a Redis Cluster store (elsewhere park_once refused them
            # in the script that checks the version). Paused since the
            # snapshot: take it all back. Changed or removed: take back what
            # is ahead; what was due already runs once (the new version
            # starts from the change there).
            taken_back = [t for ms, t in parked if status == "paused" or ms > snap.now_ms]
            self.periodic.withdraw(taken_back)
            for task_id in taken_back:
                self._pending.pop(task_id, None)
            return 0
        return first

    def _wake_ms(self, name: str, occurrence_ms: int) -> int:
        """When to look at a schedule again whose next occurrence is at *occurrence_ms*.

        Between :attr:`park_lead_ms` and half of it before, by a hash of the
        name: the same in every companion, and schedules that tick at one
        instant are parked over half an hour, not in one pass.
        """
        spread = zlib.crc32(name.encode()) % max(1, self.park_lead_ms // 2)
        return occurrence_ms - self.park_lead_ms + spread

    @staticmethod
    def _missed_ids(
        definition: Definition, version: int, missed: Sequence[int]
    ) -> list[tuple[int, str]]:
        """(ms, id) of the missed occurrences a plan left out, within the dates."""
        return [
            (ms, occurrence_id(definition.name, version, ms))
            for ms in missed
            if definition.in_window(ms)
        ]

    def _schedule(self, definition: Definition) -> BaseSchedule:
        """Celery's schedule object for *definition*, shared by every definition of its spec.

        A crontab object takes 3 to 5 KB: one per schedule was 300 to 500 MB
        at 100,000 crontab rows, and one more per version, never dropped,
        with each edit. Schedules are read-only to the planner, and most
        rows share a few specs (every "daily at 09:00" is one object); the
        cache keeps the :data:`SCHEDULES_KEPT` used last.
        """
        key = definition.schedule_key()
        sched = self._schedules.get(key)
        if sched is None:
            sched = self._schedules.put(key, definition.celery_schedule(self.app))
        return sched

    def requests_for(
        self, definition: Definition, task_id: str, occurrence_ms: int, *, due_ms: int
    ) -> list[ParkRequest]:
        """The messages of one occurrence, parked due at *due_ms* (see ``periodic backfill``)."""
        return self._requests(definition, task_id, occurrence_ms, due_ms=due_ms)

    def _requests(
        self,
        definition: Definition,
        task_id: str,
        occurrence_ms: int,
        *,
        due_ms: int | None = None,
    ) -> list[ParkRequest]:
        """Build the message celery beat would send for this occurrence, parked at its time.

        Its time is the occurrence's plus the schedule's jitter offset
        (:meth:`Definition.offset_ms`, the same in every companion), unless
        *due_ms* says otherwise (a backfill runs it now).
        """
        if due_ms is None:
            due_ms = occurrence_ms + definition.offset_ms(occurrence_ms)
        options: dict[str, Any] = dict(definition.options)
        overlap = overlap_headers(definition)
        if overlap:
            # The worker applies the policy (celery_zdelay.worker.apply_overlap_policy).
            options["headers"] = {**(options.get("headers") or {}), **overlap}
        expires = options.get("expires")
        if isinstance(expires, (int, float)) and not isinstance(expires, bool):
            # Seconds from when beat would send it: when it is due, not now.
            options["expires"] = datetime.fromtimestamp(due_ms / 1000, tz=timezone.utc) + timedelta(
                seconds=expires
            )
        task = self.app.tasks.get(definition.task)
        args, kwargs = list(definition.args), dict(definition.kwargs)

        def send(producer: Any) -> Any:
            if task is not None:
                return task.apply_async(args, kwargs, producer=producer, task_id=task_id, **options)
            return self.app.send_task(
                definition.task, args, kwargs, producer=producer, task_id=task_id, **options
            )

        _, messages = capture(self.app, send)
        return park_requests(self.app, messages, [Due("a", due_ms)] * len(messages))


#: Most schedule names one "Stored ..." log line lists per kind of change.
NAMES_LOGGED = 20


def _some_names(names: list[str]) -> str:
    """*names* for a log line: at most :data:`NAMES_LOGGED`, then how many more.

    A first start over 100,000 django-celery-beat rows would otherwise log
    one line of every name (about 1.5 MB).
    """
    if not names:
        return "none"
    shown = ", ".join(names[:NAMES_LOGGED])
    more = len(names) - NAMES_LOGGED
    return shown if more <= 0 else f"{shown} and {more} more"
