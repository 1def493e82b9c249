"""Rows read again after an edit: only the rows that changed are built again, same result.

Issue 34: at 100,000 django-celery-beat rows, an admin edit of one row took
more than 30 s to be served, most of it building a definition for every
row again. A companion now keeps each row's definition with a fingerprint
of what it was built from (every column but those it writes itself, and
its schedule's) and builds again only the rows whose fingerprint changed.

Given rows on SQLite and PostgreSQL, one source kept across edits (as a
companion keeps it), then after each edit made as django-celery-beat and
its admin make it (a save, the enable/disable action's ``QuerySet.update``
and ``update_changed()``, a shared interval or crontab saved, a delete, an
add, a rename onto an older row's schedule name, a row bad then good, a
clocked row) it gives what a fresh source's read of every row gives:
definitions, errors, last runs, pinned moments, the rows behind the names;
and it builds only the rows that changed. Random edit sequences
(Hypothesis) hold the same promise.
"""

from __future__ import annotations

import json
import random
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.beat_rows_reading import BULK_EDITS
from tests.support.django_beat import django_run, migrated_database

pytestmark = pytest.mark.timeout(120)

#: What each scenario's code starts with (run in a Django process on the database).
_PREAMBLE = """
from datetime import datetime, timedelta, timezone
from django_celery_beat.models import (
    ClockedSchedule, CrontabSchedule, IntervalSchedule, PeriodicTask, PeriodicTasks,
)
from tests.support.beat_rows_reading import (
    BULK_EDITS, CLOCKED_AT, TASK, Reading, clear, note_run, set_zone, toggle,
)
clear()
every = IntervalSchedule.objects.create(every=60, period="seconds")
"""


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def rows_database(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """One migrated database per kind for this module: each scenario clears it first."""
    yield from migrated_database(request.param, tmp_path_factory.mktemp("rows"))


def _steps(database: str, code: str) -> dict[str, dict[str, Any]]:
    """Run a scenario; its reads by step name, each kept read equal to the fresh one."""
    ran: list[dict[str, Any]] = django_run(
        database,
        _PREAMBLE + textwrap.dedent(code) + "\nprint(json.dumps(reading.steps))",
    )
    for step in ran:
        assert step["kept"] == step["fresh"], step["step"]
    return {step["step"]: step for step in ran}


def _bodies(step: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: json.loads(body) for name, _, body in step["fresh"]["definitions"]}


def test_a_saved_row_is_built_again_alone_and_a_run_written_back_builds_none(
    rows_database: str,
) -> None:
    steps = _steps(
        rows_database,
        """
        for i in range(30):
            PeriodicTask.objects.create(name=f"row {i}", task=TASK, interval=every)
        reading = Reading()
        reading.check("start")
        row = PeriodicTask.objects.get(name="row 7")
        row.args = json.dumps(["edited"])
        row.save()
        reading.check("saved")
        for i, (column, value) in enumerate(BULK_EDITS.items()):
            PeriodicTask.objects.filter(name=f"row {10 + i}").update(**{column: value})
            PeriodicTasks.update_changed()
            reading.check(f"updated {column}")
        note_run("row 3", datetime(2026, 1, 1, tzinfo=timezone.utc))
        reading.check("ran")
        """,
    )
    assert steps["start"]["built"] == 30
    # When one row is saved, then it alone is built again, with its new args
    assert steps["saved"]["built"] == 1
    assert _bodies(steps["saved"])["row_7"]["args"] == ["edited"]
    # When one column of a row is updated in bulk (a script, a data
    # migration: its date_changed unmoved), then that row alone is built
    # again, whichever column it is
    for column in BULK_EDITS:
        assert steps[f"updated {column}"]["built"] == 1, column
    updated = _bodies(steps["updated start_time"])
    assert updated["row_10"]["args"] == ["bulk"]
    assert updated["row_13"]["options"]["queue"] == "bulk"
    # When a run is written back (no save, the marker unmoved), then none is,
    # and its last run is read all the same
    assert steps["ran"]["built"] == 0
    assert steps["ran"]["fresh"]["last_runs"] == {"row_3": 1767225600000}


def test_rows_disabled_and_enabled_by_the_admin_action_come_and_go(rows_database: str) -> None:
    steps = _steps(
        rows_database,
        """
        for name in ("kept", "toggled"):
            PeriodicTask.objects.create(name=name, task=TASK, interval=every)
        reading = Reading()
        reading.check("start")
        toggle("toggled", enabled=False)
        reading.check("disabled")
        toggle("toggled", enabled=True)
        reading.check("enabled")
        """,
    )
    assert set(_bodies(steps["disabled"])) == {"kept"}
    assert set(_bodies(steps["enabled"])) == {"kept", "toggled"}
    assert steps["enabled"]["built"] == 1


def test_an_interval_or_crontab_shared_by_rows_edited_builds_those_rows_again(
    rows_database: str,
) -> None:
    steps = _steps(
        rows_database,
        """
        other = IntervalSchedule.objects.create(every=1, period="days")
        cron = CrontabSchedule.objects.create(minute="5", hour="*")
        for i in range(10):
            PeriodicTask.objects.create(name=f"on every {i}", task=TASK, interval=every)
        for i in range(3):
            PeriodicTask.objects.create(name=f"on other {i}", task=TASK, interval=other)
        for i in range(5):
            PeriodicTask.objects.create(name=f"on cron {i}", task=TASK, crontab=cron)
        reading = Reading()
        reading.check("start")
        every.every = 30
        every.save()
        reading.check("interval")
        cron.minute = "*/10"
        cron.save()
        reading.check("crontab")
        set_zone(cron.pk, "Mars/Olympus")
        reading.check("bad zone")
        set_zone(cron.pk, "Europe/Paris")
        reading.check("zone")
        """,
    )
    assert steps["interval"]["built"] == 10
    assert _bodies(steps["interval"])["on_every_0"]["schedule"]["every"] == 30
    assert steps["crontab"]["built"] == 5
    assert _bodies(steps["crontab"])["on_cron_0"]["schedule"]["crontab"]["minute"] == "*/10"
    errors = steps["bad zone"]["fresh"]["errors"]
    assert sorted(errors) == [f"on cron {i}" for i in range(5)]
    assert all("time zone does not exist" in why for why in errors.values())
    assert _bodies(steps["zone"])["on_cron_0"]["schedule"]["tz"] == "Europe/Paris"


def test_a_deleted_row_goes_and_an_added_row_comes(rows_database: str) -> None:
    steps = _steps(
        rows_database,
        """
        for name in ("first", "second"):
            PeriodicTask.objects.create(name=name, task=TASK, interval=every)
        reading = Reading()
        reading.check("start")
        PeriodicTask.objects.get(name="first").delete()
        reading.check("deleted")
        PeriodicTask.objects.create(name="third", task=TASK, interval=every)
        reading.check("added")
        """,
    )
    assert set(_bodies(steps["deleted"])) == {"second"}
    assert steps["deleted"]["built"] == 0
    assert set(_bodies(steps["added"])) == {"second", "third"}
    assert steps["added"]["built"] == 1


def test_a_row_renamed_onto_an_older_rows_schedule_name_does_not_take_it(
    rows_database: str,
) -> None:
    steps = _steps(
        rows_database,
        """
        PeriodicTask.objects.create(name="send report", task=TASK, interval=every)
        newer = PeriodicTask.objects.create(name="newer", task=TASK, interval=every, args='["n"]')
        reading = Reading()
        reading.check("start")
        newer.name = "send_report"
        newer.save()
        reading.check("renamed")
        older = PeriodicTask.objects.get(name="send report")
        older.name = "elsewhere"
        older.save()
        reading.check("older renamed")
        """,
    )
    renamed = steps["renamed"]["fresh"]
    assert list(_bodies(steps["renamed"])) == ["send_report"]
    assert _bodies(steps["renamed"])["send_report"]["args"] == []
    assert "as the older row 'send report'" in renamed["errors"]["send_report"]
    # When the older row leaves the name, then the newer has it
    assert _bodies(steps["older renamed"])["send_report"]["args"] == ["n"]


def test_a_row_made_bad_then_good_again_and_a_task_registered_since(rows_database: str) -> None:
    steps = _steps(
        rows_database,
        """
        row = PeriodicTask.objects.create(name="fragile", task=TASK, interval=every)
        PeriodicTask.objects.create(name="late task", task="tests.late", interval=every)
        reading = Reading()
        reading.check("start")
        row.args = "[oops"
        row.save()
        reading.check("bad")
        row.args = '["fine"]'
        row.save()
        reading.check("good")
        def late():
            pass
        reading.app.task(name="tests.late")(late)
        reading.check("registered")
        """,
    )
    assert "late task" in steps["start"]["fresh"]["errors"]
    assert "args is not valid JSON" in steps["bad"]["fresh"]["errors"]["fragile"]
    assert steps["bad"]["built"] == 1
    assert list(steps["good"]["fresh"]["errors"]) == ["late task"]
    assert _bodies(steps["good"])["fragile"]["args"] == ["fine"]
    # When a task is registered since, then every row is built again: any may name it
    assert steps["registered"]["fresh"]["errors"] == {}
    assert steps["registered"]["built"] == 2


def test_a_clocked_row_is_pinned_until_it_ran_at_its_moment(rows_database: str) -> None:
    steps = _steps(
        rows_database,
        """
        clock = ClockedSchedule.objects.create(clocked_time=CLOCKED_AT)
        PeriodicTask.objects.create(name="once", task=TASK, clocked=clock, one_off=True)
        reading = Reading()
        reading.check("start")
        clock.clocked_time = CLOCKED_AT - timedelta(days=1)
        clock.save()
        reading.check("moved")
        note_run("once", CLOCKED_AT)
        reading.check("ran")
        """,
    )
    at_ms = 1893456000000  # CLOCKED_AT
    assert steps["start"]["fresh"]["pinned"] == {"once": f"={at_ms - 1}"}
    assert steps["start"]["fresh"]["one_off"] == ["once"]
    assert steps["moved"]["fresh"]["pinned"] == {"once": f"={at_ms - 86_400_000 - 1}"}
    assert _bodies(steps["moved"])["once"]["schedule"] == {"at": at_ms - 86_400_000}
    assert steps["moved"]["built"] == 1
    # When it ran at or after its moment (written back, not saved), then it is not pinned
    assert steps["ran"]["fresh"]["pinned"] == {}
    assert steps["ran"]["built"] == 0


def test_read_again_builds_every_row_again(rows_database: str) -> None:
    steps = _steps(
        rows_database,
        """
        for i in range(4):
            PeriodicTask.objects.create(name=f"row {i}", task=TASK, interval=every)
        reading = Reading()
        reading.check("start")
        reading.check("unchanged")
        reading.source.read_again()
        reading.check("again")
        """,
    )
    assert steps["unchanged"]["built"] == 0
    assert steps["again"]["built"] == 4


@pytest.mark.timeout(300)
def test_random_edit_sequences_read_again_as_a_fresh_read_does(rows_database: str) -> None:
    seed = random.randrange(2**32)
    checked = django_run(
        rows_database,
        f"""
        from tests.support.beat_rows_reading import explore
        print(json.dumps(explore(examples=30, seed={seed})))
        """,
        timeout=240,
    )
    print(f"seed {seed}: {checked}")
    # Each of the 30 sequences edits at least once (a seed made exactly 100
    # edits in all once, against a floor of "more than 100" then)
    assert checked["edits"] >= 30, checked
