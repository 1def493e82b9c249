"""The reader of django-celery-beat's rows: runs written once each, newest first, failures kept.

:class:`RowsReader` makes every call to the rows' database for a
companion's planner (see ``tests/periodic/test_rows_read_aside.py`` for the
planner around it). Here it is driven alone, against a stand-in database
(``tests/support/rows_stand_in.py``) that fails when told: the runs a
round could not write are written by the next, the newest run of each row
kept and none written twice; rows are read only when their marker moved,
or when asked to read them again; an error is reported once per round, and
an answer after it.
"""

from __future__ import annotations

from typing import Any

import pytest

from celery_zdelay.periodic.rows_reader import RowsReader
from tests.helpers import wait_for
from tests.support.rows_stand_in import StandInRows

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def reader_of() -> Any:
    made: list[RowsReader] = []

    def make(database: StandInRows) -> tuple[RowsReader, list[str]]:
        events: list[str] = []
        reader = RowsReader(
            database,  # type: ignore[arg-type]
            name="zdelay-rows-test",
            on_fail=lambda exc: events.append(f"fail: {exc}"),
            on_answer=lambda: events.append("answer"),
        )
        made.append(reader)
        return reader, events

    yield make
    for reader in made:
        reader.stop()


def _round(reader: RowsReader) -> None:
    reader.check()
    assert reader.wait_for_round(10), "no round ended"


def test_runs_a_round_could_not_write_are_written_by_the_next_newest_kept_none_twice(
    reader_of: Any,
) -> None:
    # Given a database that fails after writing one run of three
    database = StandInRows({})
    reader, events = reader_of(database)
    _round(reader)  # the first read
    database.fail_runs_after = 1
    reader.note_runs({"a": 10, "b": 20, "c": 30})

    # When a round fails midway, and a newer run of b and an older one of c
    # are noted before the next
    _round(reader)
    assert database.written == [("a", 10)]
    assert events[-1] == "fail: Writing last_run_at failed: gone"
    reader.note_runs({"b": 25, "c": 5})
    _round(reader)

    # Then the next round writes what was left, newest of each, and a once
    # (mutants: what was left dropped; the older run kept)
    assert sorted(database.written) == [("a", 10), ("b", 25), ("c", 30)]
    assert events[-1] == "answer"


def test_rows_are_read_when_the_marker_moved_or_when_asked_again_and_taken_once(
    reader_of: Any,
) -> None:
    database = StandInRows({})
    reader, _ = reader_of(database)

    # The first round reads (the marker was never read)
    _round(reader)
    assert database.reads == 1
    assert reader.take() is not None
    assert reader.take() is None

    # An unmoved marker reads nothing
    _round(reader)
    assert database.reads == 1
    assert reader.take() is None

    # A moved one reads
    database.marker = 2
    _round(reader)
    assert database.reads == 2
    assert reader.take() is not None

    # And asked again, the rows are read again though unchanged (mutant:
    # again ignored: a Redis that lost the rows waits for the next edit)
    reader.check(again=True)
    assert reader.wait_for_round(10)
    assert (database.read_again_calls, database.reads) == (1, 3)
    assert reader.take() is not None


def test_a_stopped_reader_closes_its_database_connections(reader_of: Any) -> None:
    database = StandInRows({})
    reader, _ = reader_of(database)
    _round(reader)
    reader.stop()
    wait_for(lambda: database.closed_in == ["zdelay-rows-test"], timeout=10)
