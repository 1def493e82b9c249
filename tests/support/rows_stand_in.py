"""A stand-in for django-celery-beat's database, for the tests of the planner's reader of it.

What is tested with it is the companion's side (the reader's thread, the
planner around it, against a real Redis); the real rows are served by the
django-celery-beat tests (``tests/periodic/test_django_beat*.py``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from celery_zdelay.periodic.definition import SOURCE_DJANGO_BEAT, Definition, from_beat_entry
from celery_zdelay.periodic.django_beat import SourceUnavailableError

#: Longest a call to the stand-in waits while it does not answer.
HANG_S = 30.0


class StandInRows:
    """A django-celery-beat source whose rows are *entries*.

    Told to, it reads slowly (*read_s*), fails its next read (*fail_next*),
    fails a write of runs after *fail_runs_after* runs written in all, or
    keeps every call waiting (:attr:`answering` cleared), as a database that
    drops packets does.
    """

    def __init__(self, entries: dict[str, Any]) -> None:
        self.entries = dict(entries)
        self.marker = 1
        self.read_marker = 0
        self.read_s = 0.0
        self.fail_next = False
        self.fail_runs_after: int | None = None
        self.reads = 0
        self.checks = 0
        self.read_again_calls = 0
        self.read_in: list[str] = []
        self.closed_in: list[str] = []
        #: Every run written, in order: (name, occurrence ms).
        self.written: list[tuple[str, int]] = []
        #: Cleared: every call waits.
        self.answering = threading.Event()
        self.answering.set()

    def _wait_for_the_database(self) -> None:
        assert self.answering.wait(HANG_S), "the stand-in database hung for good"

    def changed(self) -> bool:
        self._wait_for_the_database()
        self.checks += 1
        return self.marker != self.read_marker

    def definitions(self) -> tuple[list[Definition], dict[str, str]]:
        time.sleep(self.read_s)
        if self.fail_next:
            self.fail_next = False
            raise SourceUnavailableError("Reading the django-celery-beat rows failed: gone")
        self.reads += 1
        self.read_in.append(threading.current_thread().name)
        self.read_marker = self.marker
        return [
            from_beat_entry(name, entry, source=SOURCE_DJANGO_BEAT)
            for name, entry in self.entries.items()
        ], {}

    def made(self) -> int:
        return self.read_marker

    def pinned(self) -> dict[str, str]:
        return {}

    def last_runs(self) -> dict[str, int]:
        return {}

    def read_again(self) -> None:
        self.read_again_calls += 1
        self.read_marker = 0

    def note_runs(self, runs: dict[str, int]) -> None:
        """Write each run and remove it from *runs*, as the real source does."""
        self._wait_for_the_database()
        for name, ms in list(runs.items()):
            if self.fail_runs_after is not None and len(self.written) >= self.fail_runs_after:
                self.fail_runs_after = None
                raise SourceUnavailableError("Writing last_run_at failed: gone")
            self.written.append((name, ms))
            del runs[name]

    def close(self) -> None:
        self.closed_in.append(threading.current_thread().name)
