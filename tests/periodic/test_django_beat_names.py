"""django-celery-beat rows under their own names and source, served by real companions.

Issue 35, on PostgreSQL, a real worker and real companions (``--beat -S
django``). Given rows named in the admin ("Every second"), then the
companion logs, lists and reports them as django-celery-beat rows under
those names; ``periodic pause "Every second"`` pauses the row's schedule
(and ``resume Every_second``, its schedule name, resumes it); of two rows
whose names differ only by ``_`` for spaces the older keeps the schedule
whatever order PostgreSQL returns them in, and the newer is reported by
its name. Given companions of the release before, which stored the rows as
``config`` under ``Every_second``, then an upgrade (the new release beside
them, then alone) relabels the rows without an edit and without a new
version: each tick of a 1-second row runs once, none is missing.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_zdelay import periodic
from tests.conftest import AppFactory
from tests.helpers import CeleryProcess, Runs, wait_for
from tests.support.cli import run
from tests.support.django_beat import (
    EDIT_BOUND_S,
    SETTINGS,
    add_interval_row,
    companion,
    django_run,
    migrated_database,
    runs_with,
)
from tests.support.periodic import occurrence_ms

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def postgres(tmp_path: Path) -> Iterator[str]:
    yield from migrated_database("postgres", tmp_path)


class PreviousRelease(CeleryProcess):
    """A companion reading the rows as the release before issue 35 did."""

    app_module = "tests.beat_project.previous_release"


def _previous_release(app: Celery, processes: list[CeleryProcess], database: str) -> CeleryProcess:
    process = PreviousRelease(
        app,
        "zdelay",
        "-l",
        "DEBUG",
        "--beat",
        "-S",
        "django",
        env={"DJANGO_SETTINGS_MODULE": SETTINGS, "ZDELAY_TEST_BEAT_DB": database},
    )
    processes.append(process)
    process.start()
    process.wait_for_log(" started: ")
    return process


def _listed(app: Celery) -> dict[str, Any]:
    listed: dict[str, Any] = json.loads(run(app, "periodic", "list", "--json").stdout)
    return listed


def _shown(app: Celery) -> list[tuple[str, str, str]]:
    return [(s["name"], s["display_name"], s["source"]) for s in _listed(app)["schedules"]]


def _settle(seconds: float) -> None:
    until = time.monotonic() + seconds
    wait_for(lambda: time.monotonic() > until, timeout=seconds + 10, interval=0.25)


def test_rows_are_logged_listed_and_steered_under_their_admin_names(
    make_test_app: AppFactory,
    postgres: str,
    processes: list[CeleryProcess],
    worker: Callable[..., CeleryProcess],
    runs: Runs,
) -> None:
    # Given a row every second, a newer one whose name differs only by '_'
    # for spaces, and a row with an invalid crontab
    add_interval_row(postgres, "Every second", 1, ["older"], task="tests.record")
    add_interval_row(postgres, "Every_second", 1, ["newer"], task="tests.record")
    django_run(
        postgres,
        """
        from django_celery_beat.models import CrontabSchedule, PeriodicTask
        bad = CrontabSchedule.objects.create(minute="99")
        PeriodicTask.objects.create(name="bad cron", task="tests.record", crontab=bad)
        """,
    )
    app = make_test_app(conf={"zdelay_beat": True})
    worker(app)
    served = companion(app, processes, postgres, "--beat", "-S", "django")
    wait_for(lambda: runs_with(runs, "older"), timeout=60, message="a run of the older row")

    # Then the companion logs them as rows, under their names
    served.wait_for_log("Stored django-celery-beat rows ")
    stored = next(li for li in served.log().splitlines() if "Stored django-celery-beat rows" in li)
    assert "(1 rows); new: Every second;" in stored
    served.wait_for_log(
        "Periodic task 'Every_second' is not served: django-celery-beat row 'Every_second' "
        "has the same schedule name, 'Every_second' (spaces as '_'), as the older row "
        "'Every second', which has it"
    )
    served.wait_for_log("Periodic task 'bad cron' is not served: django-celery-beat row 'bad cron'")
    # and periodic list shows them so
    assert _shown(app) == [("Every_second", "Every second", "django-celery-beat")]
    assert {u["name"] for u in _listed(app)["unserved"]} == {"Every_second", "bad cron"}

    # When the row is paused by its admin name
    paused = run(app, "periodic", "pause", "Every second")
    assert (paused.exit_code, paused.stdout) == (0, "paused Every second\n")
    stopped = time.time()

    # Then it runs no more (one released at that instant may still run)
    _settle(4)
    late = [r["wall"] - stopped for r in runs_with(runs, "older") if r["wall"] > stopped + 1]
    assert late == []

    # When it is resumed by its schedule name, it runs again
    resumed = run(app, "periodic", "resume", "Every_second")
    assert (resumed.exit_code, resumed.stdout) == (0, "resumed Every_second\n")
    again = time.time()
    wait_for(
        lambda: [r for r in runs_with(runs, "older") if r["wall"] > again],
        timeout=30,
        message="a run after the resume",
    )

    # When the older row is edited (PostgreSQL then returns it after the newer one)
    edited = django_run(
        postgres,
        """
        import time
        from django_celery_beat.models import PeriodicTask
        row = PeriodicTask.objects.get(name="Every second")
        row.args = json.dumps(["edited"])
        row.save()
        print(json.dumps(time.time()))
        """,
    )

    # Then it keeps the schedule: its edit runs, the newer row never does
    wait_for(lambda: runs_with(runs, "edited"), timeout=EDIT_BOUND_S + 10, message="the edit")
    _settle(3)
    assert runs_with(runs, "newer") == []
    assert _shown(app) == [("Every_second", "Every second", "django-celery-beat")]
    print(f"edited row: first run {runs_with(runs, 'edited')[0]['wall'] - edited:.2f} s after")
    assert runs.duplicates() == {}


def test_an_upgrade_from_rows_stored_as_config_neither_doubles_nor_loses_a_tick(
    make_test_app: AppFactory,
    postgres: str,
    processes: list[CeleryProcess],
    worker: Callable[..., CeleryProcess],
    runs: Runs,
) -> None:
    # Given a row every second served by two companions of the release
    # before, which store it as "config" under its schedule name only
    add_interval_row(postgres, "Every second", 1, ["tick"], task="tests.record")
    app = make_test_app(conf={"zdelay_beat": True})
    worker(app)
    before = [_previous_release(app, processes, postgres) for _ in range(2)]
    wait_for(lambda: len(runs_with(runs, "tick")) >= 3, timeout=60, message="3 ticks before")
    assert _shown(app) == [("Every_second", "Every_second", "config")]

    # When a companion of this release starts beside them
    after = companion(app, processes, postgres, "--beat", "-S", "django")

    # Then it stores the rows under their admin names and own source, without
    # an edit (a later reading of the same rows) and as a relabelling: same version
    wait_for(
        lambda: _shown(app) == [("Every_second", "Every second", "django-celery-beat")],
        timeout=30,
        interval=0.5,
        message="the row relabelled",
    )
    after.wait_for_log("relabelled: Every second")
    (info,) = periodic.schedules(app)[1]
    assert info.version == 1

    # When one of the release before restarts meanwhile, it does not store its reading back
    before[0].terminate()
    restarted = _previous_release(app, processes, postgres)
    restarted.wait_for_log("are older than those stored in Redis")
    assert _shown(app) == [("Every_second", "Every second", "django-celery-beat")]

    # When the release before is gone
    upgraded = len(runs_with(runs, "tick"))
    for process in (before[1], restarted):
        process.terminate()
    wait_for(
        lambda: len(runs_with(runs, "tick")) >= upgraded + 4, timeout=60, message="4 ticks after"
    )

    # Then each tick ran once and none is missing: one version, one second apart
    ticks = sorted(occurrence_ms(r["id"]) for r in runs_with(runs, "tick"))
    gaps = {b - a for a, b in itertools.pairwise(ticks)}
    print(f"upgrade: {len(ticks)} ticks, gaps between them {sorted(gaps)} ms")
    assert gaps == {1000}
    assert {r["id"].split(":")[2] for r in runs_with(runs, "tick")} == {"v1"}
    assert runs.duplicates() == {}
