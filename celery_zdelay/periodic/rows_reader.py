"""Every call to django-celery-beat's database, in one thread of the companion's own.

The planner's passes park each schedule's next occurrences a few seconds
ahead. A database that hangs rather than refuses (a host that drops
packets, a failover, a table locked by a migration) keeps a call waiting
for minutes: made in a pass, it would hold every schedule's planning, and
their ticks would pass unparked. So a pass never calls the database: it
hands the reader the runs to write back to the rows (``last_run_at``),
asks it to look at the change marker, and takes what it read when it has
read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .definition import Definition
from .django_beat import DjangoBeatSource, SourceUnavailableError

__all__ = ["Rows", "RowsReader", "read_rows"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rows:
    """One read of the django-celery-beat rows, with what the source knew as it read them."""

    definitions: list[Definition]
    errors: dict[str, str]
    made: int | None
    pinned: dict[str, str]
    last_runs: dict[str, int]


def read_rows(source: DjangoBeatSource) -> Rows:
    """Read every enabled row of *source*, with what goes with them."""
    definitions, errors = source.definitions()
    return Rows(definitions, errors, source.made(), source.pinned(), source.last_runs())


class RowsReader:
    """The thread that asks the rows' database, for the planner that never waits on it.

    Each round, when asked (:meth:`check`): the runs noted since the last
    one are written, then the change marker is read, then, when it moved,
    every row; the rows wait in :meth:`take` for the next pass to store.
    *on_fail* is called with the error of a round the database refused,
    *on_answer* after a round it answered in full.
    """

    def __init__(
        self,
        source: DjangoBeatSource,
        *,
        name: str,
        on_fail: Callable[[SourceUnavailableError], None],
        on_answer: Callable[[], None],
    ) -> None:
        self._source = source
        self._on_fail = on_fail
        self._on_answer = on_answer
        #: Guards what the passes and the thread hand each other; never held
        #: over a database call.
        self._lock = threading.Lock()
        self._runs: dict[str, int] = {}
        self._rows: Rows | None = None
        self._again = False
        self._rounds = 0
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._round_done = threading.Condition(self._lock)
        #: When the round under way started (monotonic), None between rounds.
        self._busy_since: float | None = None
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def note_runs(self, runs: dict[str, int]) -> None:
        """Have the next round write these runs (name -> occurrence ms), the newest of each kept."""
        with self._lock:
            for name, ms in runs.items():
                self._runs[name] = max(ms, self._runs.get(name, ms))

    def check(self, *, again: bool = False) -> None:
        """Start a round now, or once the one under way ends.

        With *again*, every row is read and built again even though the
        marker did not move (a Redis that lost what was stored, a store that
        failed: see :meth:`DjangoBeatSource.read_again`).
        """
        with self._lock:
            self._again = self._again or again
        self._wake.set()

    def take(self) -> Rows | None:
        """The rows read since the last call, or None."""
        with self._lock:
            rows, self._rows = self._rows, None
        return rows

    def wait_for_round(self, timeout: float) -> bool:
        """Wait until a round started from now on has ended; whether one did within *timeout*."""
        with self._lock:
            target = self._rounds + (2 if self._busy_since is not None else 1)
            return self._round_done.wait_for(lambda: self._rounds >= target, timeout)

    def waiting_for(self) -> float:
        """How long the round under way has waited, in seconds (0 between rounds)."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    def stop(self) -> None:
        """End the thread after the round under way (it closes its database connections)."""
        self._stopping.set()
        self._wake.set()

    def _serve(self) -> None:
        try:
            while True:
                self._wake.wait()
                if self._stopping.is_set():
                    return
                self._wake.clear()
                self._round()
        finally:
            self._source.close()

    def _round(self) -> None:
        with self._lock:
            runs, self._runs = self._runs, {}
            again, self._again = self._again, False
            self._busy_since = time.monotonic()
        try:
            if again:
                self._source.read_again()
            if runs:
                # Runs first: rows read after them know they ran.
                try:
                    self._source.note_runs(runs)
                finally:
                    # What was not written (the database failed midway)
                    # waits for the next round, newest run kept.
                    self.note_runs(runs)
            if self._source.changed():
                rows = read_rows(self._source)
                with self._lock:
                    self._rows = rows
        except SourceUnavailableError as exc:
            # changed() says yes again at the next round: read again then.
            self._on_fail(exc)
        except Exception:
            logger.exception("Reading the django-celery-beat rows failed")
        else:
            self._on_answer()
        finally:
            with self._lock:
                self._busy_since = None
                self._rounds += 1
                self._round_done.notify_all()
