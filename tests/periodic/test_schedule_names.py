"""A schedule is named by its name or by the name people know it by, everywhere a name is taken.

Issue 35. Given a django-celery-beat row stored as django-celery-beat's
companions store it (schedule ``Every_second``, shown as "Every second",
source ``django-celery-beat``), a ``beat_schedule`` entry and one added at
run time, on a private Redis, no companion: then ``periodic list`` (text
and JSON) shows the row under its admin name and its own source with the
schedule name beside it; the Python API and every ``zdelay periodic``
command that takes a name (pause, resume, run, remove, backfill) take the
admin name, spaces as typed or pasted, and the schedule name, and refuse a
name that is neither (exit code 3). The rows themselves, read by real
companions from PostgreSQL, are in ``test_django_beat_names.py``.
"""

from __future__ import annotations

import json

import pytest
from celery import Celery

from celery_zdelay import periodic
from celery_zdelay.parking import store_for
from celery_zdelay.periodic.definition import SOURCE_API, SOURCE_DJANGO_BEAT, from_beat_entry
from celery_zdelay.periodic.store import PeriodicStore
from tests.support.cli import run

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def stored(app: Celery) -> PeriodicStore:
    """A row, a beat_schedule entry named as the row's schedule would be, one added."""
    periodic_store = PeriodicStore(store_for(app))
    row = from_beat_entry(
        "Every_second",
        {"task": "tests.record", "schedule": 1.0, "args": ["row"]},
        source=SOURCE_DJANGO_BEAT,
        display_name="Every second",
    )
    entry = from_beat_entry("Nightly_report", {"task": "tests.record", "schedule": 86_400.0})
    periodic_store.store_config([row, entry], "h1", writer="c", force=False, made=100, reading=2)
    added = from_beat_entry(
        "heartbeat-ping", {"task": "tests.record", "schedule": 60.0}, source=SOURCE_API
    )
    periodic_store.put(added, writer="api")
    return periodic_store


def test_list_shows_a_row_under_its_admin_name_and_its_own_source(
    app: Celery, stored: PeriodicStore
) -> None:
    listed = json.loads(run(app, "periodic", "list", "--json").stdout)["schedules"]
    assert [(s["name"], s["display_name"], s["source"]) for s in listed] == [
        ("Every_second", "Every second", "django-celery-beat"),
        ("Nightly_report", "Nightly_report", "config"),
        ("heartbeat-ping", "heartbeat-ping", "api"),
    ]
    text = run(app, "periodic", "list").stdout
    assert (
        "Every second  tests.record  every 1s  [active, django-celery-beat, v1, "
        "stored as Every_second]"
    ) in text
    assert "Nightly_report  tests.record  every 86400s  [active, config, v1]" in text
    assert "stored as Nightly_report" not in text


@pytest.mark.parametrize(
    ("given", "found"),
    [
        ("Every second", "Every_second"),
        ("Every_second", "Every_second"),
        ("  Every   second ", "Every_second"),  # spaces as typed or pasted
        ("Every\tsecond", "Every_second"),
        ("every second", None),  # names are exact
        ("Every_ second", None),  # the admin name is not "Every_ second"
        ("Nightly report", None),  # an entry has no other name than its own
        ("heartbeat-ping", "heartbeat-ping"),
        ("", None),
    ],
)
def test_a_name_designates_the_schedule_of_that_name_or_of_that_admin_name(
    app: Celery, stored: PeriodicStore, given: str, found: str | None
) -> None:
    assert periodic.stored_name(given, app=app) == found


def test_the_api_pauses_resumes_runs_and_removes_a_row_by_its_admin_name(
    app: Celery, stored: PeriodicStore
) -> None:
    assert periodic.pause("Every second", app=app)
    assert stored.snapshot().paused == {"Every_second"}
    assert periodic.resume("Every second", app=app)
    assert stored.snapshot().paused == set()
    assert periodic.pause("Every_second", app=app)
    assert periodic.resume("Every_second", app=app)
    task_id = periodic.run_now("Every second", app=app)
    assert task_id.startswith("periodic:Every_second:run:")
    assert periodic.backfill("Every second", app=app, since="2026-01-01T00:00:00Z") == []
    assert not periodic.pause("Every Second", app=app)
    assert not periodic.remove("Every Second", app=app)
    assert periodic.remove("Every second", app=app)
    assert sorted(stored.snapshot().definitions) == ["Nightly_report", "heartbeat-ping"]


def test_every_command_that_takes_a_name_takes_the_admin_name(
    app: Celery, stored: PeriodicStore
) -> None:
    paused = run(app, "periodic", "pause", "Every second")
    assert (paused.exit_code, paused.stdout) == (0, "paused Every second\n")
    assert stored.snapshot().paused == {"Every_second"}
    resumed = run(app, "periodic", "resume", "Every second")
    assert (resumed.exit_code, resumed.stdout) == (0, "resumed Every second\n")
    sent = run(app, "periodic", "run", "Every second")
    assert sent.exit_code == 0
    assert sent.stdout.startswith("sent periodic:Every_second:run:")
    backfilled = run(app, "periodic", "backfill", "Every second", "--since", "2026-01-01T00:00:00Z")
    assert backfilled.exit_code == 0, backfilled.stdout
    assert "backfilled 0 missed occurrences of Every second" in backfilled.stdout
    for command in ("pause", "resume", "run", "remove"):
        refused = run(app, "periodic", command, "Every Second")
        assert refused.exit_code == 3, (command, refused.stdout)
        assert "No periodic schedule is named 'Every Second'" in refused.stderr
    removed = run(app, "periodic", "remove", "Every second")
    assert (removed.exit_code, removed.stdout) == (0, "removed Every second\n")
    assert "Every_second" not in stored.snapshot().definitions
