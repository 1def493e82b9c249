"""Rows that changed are read beside the planner's passes, not inside one.

At 100,000 django-celery-beat rows, an edit made each companion read every
row again inside a planner pass: more than ten seconds in which no schedule
was planned, so the rows ticking every 5 s ran out of occurrences parked
ahead and lost ticks to ``zdelay_missed`` (``benchmarks/beat_rows.py``: two
ticks of each such row passed while no companion served it). The read now
runs in a thread of its own and the next pass stores what it read.

Every other call to the database (the change marker, ``last_run_at``)
is made by that thread too, so a database that hangs holds no pass.

The database is a stand-in here (``tests/support/rows_stand_in.py``),
one whose read of the rows takes as long as a large table's, or that
hangs: what is tested is the planner around it, against a real Redis.
The real rows, read aside, are served by the django-celery-beat tests
(``test_django_beat*.py``) through real companions.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from celery import Celery

from celery_zdelay.errors import StoreRefusedError
from celery_zdelay.periodic import server as server_module
from tests.helpers import wait_for
from tests.support.periodic import parked_ids, server_for, tend, ticked_ids
from tests.support.rows_stand_in import StandInRows

pytestmark = pytest.mark.timeout(60)

#: How long the stand-in's read of the rows takes once they changed.
SLOW_READ_S = 3.0


def _served(app: Celery) -> tuple[Any, StandInRows]:
    rows = StandInRows({"fast": {"task": "tests.record", "schedule": 1.0}})
    server = server_for(app, {})
    server._source = rows  # type: ignore[assignment]
    assert server.reconcile() == "done"
    return server, rows


def _added_after_a_check(server: Any) -> bool:
    """Make a pass with the configuration check due; whether the added row is stored now."""
    server._last_check = 0.0
    tend(server)
    return "added" in server.periodic.snapshot().definitions


def test_an_edit_read_slowly_holds_no_pass_and_is_stored_when_read(app: Celery) -> None:
    # Given a companion serving rows, its first pass made
    server, rows = _served(app)
    tend(server)

    # When a row is added and the rows now take 3 s to read, and passes go on
    rows.entries["added"] = {"task": "tests.record", "schedule": 2.0}
    rows.marker, rows.read_s = 2, SLOW_READ_S
    server._last_check = 0.0  # the check is due
    longest = 0.0
    started = time.monotonic()
    while "added" not in server.periodic.snapshot().definitions:
        assert time.monotonic() - started < 20, "the rows read aside were never stored"
        began = time.monotonic()
        tend(server)
        longest = max(longest, time.monotonic() - began)
        time.sleep(0.05)

    # Then no pass waited for the read (mutant: the check reads in the pass,
    # as before: the longest pass is the 3 s read), and the rows were stored
    # once read, by the reader's thread
    assert longest < SLOW_READ_S / 3, longest
    assert time.monotonic() - started >= SLOW_READ_S
    assert rows.reads == 2
    assert rows.read_in[-1] == "zdelay-rows-c"

    # And when the companion stops, the reader closes its database connections
    server.stop()
    wait_for(lambda: rows.closed_in == ["zdelay-rows-c"], timeout=10)


@pytest.mark.timing
def test_the_change_marker_is_read_every_second_so_an_edit_waits_at_most_that(
    app: Celery,
) -> None:
    # Given a companion serving rows, its passes going on at their own pace
    server, rows = _served(app)
    tend(server)

    def passes_until(done: Any, timeout: float) -> float:
        started = time.monotonic()
        while not done():
            assert time.monotonic() - started < timeout, "never"
            server.tend()
            time.sleep(0.02)
        return time.monotonic() - started

    # When a row is added just after a check of the marker
    seen = rows.checks
    passes_until(lambda: rows.checks > seen, timeout=10)
    rows.entries["added"] = {"task": "tests.record", "schedule": 2.0}
    rows.marker = 2

    # Then it is stored at the next check, a second later (mutants: the
    # marker read as beat_schedule is compared, every 5 s; the constant 5)
    waited = passes_until(lambda: "added" in server.periodic.snapshot().definitions, timeout=10)
    assert 0.7 <= waited < 2.5, waited


def test_a_read_that_fails_is_tried_again_at_the_next_check(app: Celery) -> None:
    # Given a companion serving rows, and an edit whose first read fails
    server, rows = _served(app)
    rows.entries["added"] = {"task": "tests.record", "schedule": 2.0}
    rows.marker, rows.fail_next = 2, True

    # When the checks go on, then the edit is read again and stored, and
    # the source counts as answering again
    wait_for(lambda: _added_after_a_check(server), timeout=20)
    assert rows.reads == 2
    assert server._source_down is False


def test_rows_redis_refused_to_store_are_read_and_stored_again(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given a companion serving rows, and an edit Redis refuses to store
    # (a key of the configuration's written by something else)
    server, rows = _served(app)
    superseded = server.periodic.keys.superseded
    redis_client.set(superseded, "not a set")
    rows.entries["added"] = {"task": "tests.record", "schedule": 2.0}
    rows.marker = 2

    def check() -> bool:
        server._last_check = 0.0
        try:
            tend(server)
        except StoreRefusedError:
            return True
        return False

    wait_for(check, timeout=20)

    # When the key is put right and the checks go on
    redis_client.delete(superseded)

    # Then the edit is read again and stored (mutant: read_again() left out
    # of reconcile: the source says "unchanged" until the next edit)
    wait_for(lambda: _added_after_a_check(server), timeout=20)
    assert rows.reads == 3


def test_a_database_that_hangs_holds_no_pass_and_is_logged_until_it_answers(
    app: Celery,
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a companion serving a row that ticks every second, with a run
    # of it to write back to the row
    monkeypatch.setattr(server_module, "ROWS_SILENT_SECONDS", 1.0)
    server, rows = _served(app)
    tend(server)
    server._rows_ran["fast"] = 1234

    # When the database stops answering (every call waits) while passes go
    # on, each with the check of the marker due
    rows.answering.clear()
    ticked = set(ticked_ids(redis_client, "fast"))
    longest, started = 0.0, time.monotonic()
    while time.monotonic() - started < 4.0:
        server._last_check = 0.0
        began = time.monotonic()
        tend(server)
        longest = max(longest, time.monotonic() - began)
        time.sleep(0.05)

    # Then no pass waited on it (mutants: the marker read, or last_run_at
    # written, in the pass, as before: the first pass waits for good), the
    # row's ticks went on being parked, and the wait was logged once
    assert longest < 0.5, longest
    assert len(set(ticked_ids(redis_client, "fast")) - ticked) >= 3
    waiting = [r for r in caplog.records if "has kept the companion waiting" in r.getMessage()]
    assert len(waiting) == 1, waiting
    assert rows.written == []

    # When it answers again, then the run is written to the row, and that
    # is logged too
    rows.answering.set()
    wait_for(lambda: rows.written == [("fast", 1234)], timeout=10)
    wait_for(lambda: "database answers again" in caplog.text, timeout=10)
    server.stop()


def test_a_companion_starting_while_the_database_hangs_serves_what_redis_holds(
    app: Celery, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given rows stored by a companion, and the database hanging
    monkeypatch.setattr(server_module, "FIRST_READ_SECONDS", 0.5)
    _, rows = _served(app)
    rows.answering.clear()

    # When another companion starts
    starting = server_for(app, {}, name="d")
    starting._source = rows  # type: ignore[assignment]
    began = time.monotonic()
    starting.begin()

    # Then its start waits for the first read only that long (mutant: the
    # rows read in begin(), as before: it waits for good), and its passes
    # park the row's ticks as Redis holds them
    assert time.monotonic() - began < 2.0
    wait_for(lambda: tend(starting) >= 0 and bool(parked_ids(redis_client, "fast")), timeout=10)
    rows.answering.set()
    starting.stop()


def test_the_apps_modules_are_imported_before_the_reader_first_asks_the_database(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Celery's Django fixup sets Django up as the app's modules are
    # imported: in a project that leaves django.setup() to it, a read of
    # the rows before that fails "Apps aren't loaded yet" (found by
    # benchmarks/beat_rows.py, whose app does so; the test app sets Django
    # up itself)
    calls: list[str] = []
    monkeypatch.setattr(app.loader, "import_default_modules", lambda: calls.append("import"))

    class Ordered(StandInRows):
        def changed(self) -> bool:
            calls.append("changed")
            return super().changed()

    starting = server_for(app, {})
    starting._source = Ordered({"fast": {"task": "tests.record", "schedule": 1.0}})  # type: ignore[assignment]

    # When a companion starts serving rows
    starting.begin()

    # Then the app's modules were imported first, once (mutant: the import
    # left to the first store of the rows, after the reader's first call)
    assert calls[:2] == ["import", "changed"], calls
    assert calls.count("import") == 1
    starting.stop()
