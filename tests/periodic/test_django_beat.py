"""django-celery-beat's rows as the schedule source, on SQLite and PostgreSQL.

Given a Django project whose periodic tasks are django-celery-beat rows, and
companions told to use its ``DatabaseScheduler`` (Celery's own
``beat_scheduler``, or ``zdelay --beat -S django``), then the enabled rows
run, each tick once across two companions; a row that cannot be served is
reported and skipped; ``last_run_at`` and ``total_run_count`` stay true; and
an edit or a disable made in the database takes effect within a bound.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pytest

from tests.conftest import AppFactory
from tests.helpers import CeleryProcess, Runs, wait_for
from tests.support.django_beat import (
    EDIT_BOUND_S,
    PERIOD_S,
    SETTINGS,
    add_interval_row,
    companion,
    django_run,
    new_migrated_database,
    occurrence_s,
    psql,
    row_of,
    runs_with,
)

pytestmark = pytest.mark.timeout(180)


def test_two_companions_serve_the_rows_each_tick_once_and_keep_the_admin_true(
    make_test_app: AppFactory,
    database: str,
    processes: list[CeleryProcess],
    worker: Callable[..., CeleryProcess],
    runs: Runs,
) -> None:
    # Given rows: one every second, one naming an unknown task, one disabled
    add_interval_row(database, "Every second", 1, ["db"], task="tests.record")
    add_interval_row(database, "Unknown task", 1, ["unknown"], task="tests.no_such_task")
    add_interval_row(database, "Disabled", 1, ["disabled"], task="tests.record", enabled=False)
    app = make_test_app(
        conf={
            "zdelay_beat": True,
            "beat_scheduler": "django_celery_beat.schedulers:DatabaseScheduler",
        }
    )
    worker(app)
    # When two companions serve them (one through Celery's beat_scheduler,
    # one told with -S django, as celery beat -S django)
    first = companion(app, processes, database)
    companion(app, processes, database, "--beat", "-S", "django")

    # Then the enabled row runs every second, each occurrence once
    wait_for(lambda: len(runs_with(runs, "db")) >= 5, timeout=60, message="5 runs of the row")
    ran = runs_with(runs, "db")
    assert runs.duplicates() == {}
    assert len({r["id"] for r in ran}) == len(ran)
    # and the others never run; the bad row is reported by name
    assert runs_with(runs, "unknown") == []
    assert runs_with(runs, "disabled") == []
    first.wait_for_log("'Unknown task' is not served")

    # And django-celery-beat's admin columns follow the runs
    def admin_true() -> bool:
        row = row_of(database, "Every second")
        return row["total_run_count"] >= 5 and row["last_run_at"] is not None

    wait_for(admin_true, timeout=30, interval=0.5, message="last_run_at and total_run_count")
    row = row_of(database, "Every second")
    assert row["total_run_count"] <= len(runs_with(runs, "db"))
    assert row["last_run_at"] <= time.time()


def test_an_edit_or_a_disable_in_the_database_takes_effect_within_the_bound(
    make_test_app: AppFactory,
    database: str,
    processes: list[CeleryProcess],
    worker: Callable[..., CeleryProcess],
    runs: Runs,
) -> None:
    add_interval_row(database, "ticker", 1, ["before"], task="tests.record")
    app = make_test_app(conf={"zdelay_beat": True})
    worker(app)
    companion(app, processes, database, "--beat", "-S", "django")
    wait_for(lambda: runs_with(runs, "before"), timeout=60, message="a run of the row")

    # When its arguments are edited (as the admin saves a row)
    edited = django_run(
        database,
        """
        import time
        from django_celery_beat.models import PeriodicTask
        row = PeriodicTask.objects.get(name="ticker")
        row.args = json.dumps(["after"])
        row.save()
        print(json.dumps(time.time()))
        """,
    )
    wait_for(lambda: runs_with(runs, "after"), timeout=EDIT_BOUND_S + 10, message="the edit")
    took = runs_with(runs, "after")[0]["wall"] - edited
    print(f"edited row: first run with the new args {took:.2f} s after the save")
    assert took < EDIT_BOUND_S

    # When it is disabled, its runs stop within the bound
    disabled_at = django_run(
        database,
        """
        import time
        from django_celery_beat.models import PeriodicTask
        row = PeriodicTask.objects.get(name="ticker")
        row.enabled = False
        row.save()
        print(json.dumps(time.time()))
        """,
    )
    time_limit = time.monotonic() + EDIT_BOUND_S + 3
    wait_for(lambda: time.monotonic() > time_limit, timeout=EDIT_BOUND_S + 10, interval=0.5)
    after = [r["wall"] - disabled_at for r in runs_with(runs, "after") if r["wall"] > disabled_at]
    print(f"disabled row: runs after the save at {[round(late, 2) for late in after]} s")
    assert all(late < EDIT_BOUND_S for late in after)


def test_the_switch_from_celery_beat_goes_on_from_last_run_at(
    make_test_app: AppFactory,
    database: str,
    processes: list[CeleryProcess],
    worker: Callable[..., CeleryProcess],
    runs: Runs,
) -> None:
    # Given a row that celery beat -S django last sent 2 s ago, every 6 s,
    # and a one_off row that never ran
    last_run = time.time() - 2
    add_interval_row(database, "switched", 6, ["switched"], task="tests.record")
    add_interval_row(database, "once only", 1, ["once"], task="tests.record", one_off=True)
    django_run(
        database,
        f"""
        from datetime import datetime, timezone
        from django_celery_beat.models import PeriodicTask
        PeriodicTask.objects.filter(name="switched").update(
            last_run_at=datetime.fromtimestamp({last_run!r}, timezone.utc)
        )
        """,
    )
    app = make_test_app(conf={"zdelay_beat": True})
    worker(app)
    # When the companions take over
    companion(app, processes, database, "--beat", "-S", "django")
    wait_for(lambda: runs_with(runs, "switched"), timeout=60, message="the row's first tick")

    # Then its first tick is beat's last run plus one period: none lost, none doubled
    (first,) = runs_with(runs, "switched")[:1]
    assert abs(occurrence_s(first["id"]) - (last_run + 6)) < 0.01
    # And the one_off row runs once, then is disabled, as django-celery-beat does
    wait_for(lambda: runs_with(runs, "once"), timeout=60, message="the one-off run")
    wait_for(
        lambda: (
            not django_run(
                database,
                """
            from django_celery_beat.models import PeriodicTask
            print(json.dumps(PeriodicTask.objects.get(name="once only").enabled))
            """,
            )
        ),
        timeout=30,
        interval=0.5,
        message="the one_off row disabled",
    )
    settle = time.monotonic() + 3
    wait_for(lambda: time.monotonic() > settle, timeout=10, interval=0.5)
    assert len(runs_with(runs, "once")) == 1


def test_clocked_rows_run_once_at_their_time_and_bad_rows_are_skipped(
    make_test_app: AppFactory,
    database: str,
    processes: list[CeleryProcess],
    worker: Callable[..., CeleryProcess],
    runs: Runs,
) -> None:
    # Given a clocked row due in 10 s, one whose moment passed while nothing
    # served it, an interval row, and rows with an invalid crontab and with
    # a time zone that does not exist (written past the admin's checks)
    at = round(time.time()) + 10
    add_interval_row(database, "good", 1, ["good"], task="tests.record")
    django_run(
        database,
        f"""
        from datetime import datetime, timezone
        from django.db import connection
        from django_celery_beat.models import ClockedSchedule, CrontabSchedule, PeriodicTask
        for name, moment in (("at ten", {at!r}), ("passed", {at - 310!r})):
            clocked = ClockedSchedule.objects.create(
                clocked_time=datetime.fromtimestamp(moment, timezone.utc)
            )
            PeriodicTask.objects.create(
                name=name, task="tests.record", clocked=clocked, one_off=True,
                args=json.dumps([name]),
            )
        bad_cron = CrontabSchedule.objects.create(minute="99")
        PeriodicTask.objects.create(
            name="bad cron", task="tests.record", crontab=bad_cron, args='["bad cron"]'
        )
        bad_zone = CrontabSchedule.objects.create(minute="*", hour="*")
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE django_celery_beat_crontabschedule SET timezone = %s WHERE id = %s",
                ["Mars/Olympus", bad_zone.pk],
            )
        PeriodicTask.objects.create(
            name="bad zone", task="tests.record", crontab=bad_zone, args='["bad zone"]'
        )
        """,
    )
    app = make_test_app(conf={"zdelay_beat": True})
    worker(app)
    # When a companion serves the rows
    served = companion(app, processes, database, "--beat", "-S", "django")

    # Then the bad rows are reported by name and block no other row
    served.wait_for_log("'bad cron' is not served: django-celery-beat row 'bad cron': invalid")
    served.wait_for_log("'bad zone' is not served: django-celery-beat row 'bad zone': its crontab")
    wait_for(lambda: runs_with(runs, "good"), timeout=60, message="a run of the interval row")
    # and the passed moment runs once, at once
    wait_for(lambda: runs_with(runs, "passed"), timeout=60, message="the passed clocked row")
    # and the clocked row runs once, at its moment
    wait_for(lambda: runs_with(runs, "at ten"), timeout=60, message="the clocked row")
    (clocked,) = runs_with(runs, "at ten")
    assert occurrence_s(clocked["id"]) == at
    assert clocked["wall"] >= at
    # and each clocked row is disabled after its run, as django-celery-beat does
    for name in ("at ten", "passed"):
        wait_for(
            lambda name=name: (
                not django_run(
                    database,
                    f"""
                from django_celery_beat.models import PeriodicTask
                print(json.dumps(PeriodicTask.objects.get(name={name!r}).enabled))
                """,
                )
            ),
            timeout=30,
            interval=0.5,
            message=f"{name} disabled",
        )
    settle = time.monotonic() + 3
    wait_for(lambda: time.monotonic() > settle, timeout=10, interval=0.5)
    assert len(runs_with(runs, "at ten")) == 1
    assert len(runs_with(runs, "passed")) == 1
    assert runs_with(runs, "bad cron") == runs_with(runs, "bad zone") == []
    assert runs.duplicates() == {}


def test_an_added_or_deleted_row_takes_effect_within_the_bound(
    make_test_app: AppFactory,
    database: str,
    processes: list[CeleryProcess],
    worker: Callable[..., CeleryProcess],
    runs: Runs,
) -> None:
    # Given a companion serving one row
    add_interval_row(database, "first", 1, ["first"], task="tests.record")
    app = make_test_app(conf={"zdelay_beat": True})
    worker(app)
    companion(app, processes, database, "--beat", "-S", "django")
    wait_for(lambda: runs_with(runs, "first"), timeout=60, message="a run of the first row")

    # When a row is added (as the admin adds one), it runs within the bound
    added = add_interval_row(database, "added", 1, ["added"], task="tests.record")
    wait_for(lambda: runs_with(runs, "added"), timeout=EDIT_BOUND_S + 10, message="the new row")
    took = runs_with(runs, "added")[0]["wall"] - added
    print(f"added row: first run {took:.2f} s after the insert")
    assert took < EDIT_BOUND_S

    # When the first row is deleted, its runs stop within the bound, and the other goes on
    deleted = django_run(
        database,
        """
        import time
        from django_celery_beat.models import PeriodicTask
        PeriodicTask.objects.get(name="first").delete()
        print(json.dumps(time.time()))
        """,
    )
    time_limit = time.monotonic() + EDIT_BOUND_S + 3
    wait_for(lambda: time.monotonic() > time_limit, timeout=EDIT_BOUND_S + 10, interval=0.5)
    after = [r["wall"] - deleted for r in runs_with(runs, "first") if r["wall"] > deleted]
    print(f"deleted row: runs after the delete at {[round(late, 2) for late in after]} s")
    assert all(late < EDIT_BOUND_S for late in after)
    assert [r for r in runs_with(runs, "added") if r["wall"] > deleted + EDIT_BOUND_S]
    assert runs.duplicates() == {}


# (One database: the switch through last_run_at runs on both in
# test_the_switch_from_celery_beat_goes_on_from_last_run_at; this 90 s story
# adds a real beat, whose writes go through the same Django ORM.)
@pytest.mark.parametrize("database", ["postgres"], indirect=True)
@pytest.mark.timeout(300)
def test_a_real_celery_beat_then_the_companion_lose_and_double_no_tick(
    make_test_app: AppFactory,
    database: str,
    processes: list[CeleryProcess],
    worker: Callable[..., CeleryProcess],
    runs: Runs,
) -> None:
    # Given a row served by celery beat -S django itself
    add_interval_row(database, "switching", PERIOD_S, ["switching"], task="tests.record")
    app = make_test_app()
    worker(app)
    beat = CeleryProcess(
        app,
        "beat",
        "-S",
        "django",
        "-l",
        "INFO",
        env={"DJANGO_SETTINGS_MODULE": SETTINGS, "ZDELAY_TEST_BEAT_DB": database},
    )
    processes.append(beat)
    beat.start()
    # (it runs a new row at once, then every period)
    wait_for(lambda: runs_with(runs, "switching"), timeout=60, message="a beat run")

    # When beat is stopped (it writes last_run_at as it closes) and a
    # companion takes over, following docs/beat.rst's steps
    assert beat.terminate(resend_after=10) == 0
    stopped = time.monotonic()
    last_run = row_of(database, "switching")["last_run_at"]
    companion(app, processes, database, "--beat", "-S", "django")
    print(f"the switch: companion started {time.monotonic() - stopped:.1f} s after beat stopped")
    wait_for(
        lambda: [r for r in runs_with(runs, "switching") if r["id"].startswith("periodic:")],
        timeout=PERIOD_S + 60,
        message="the companion's first run",
    )

    # Then the companion's first tick is beat's last run plus one period
    ran = sorted(runs_with(runs, "switching"), key=lambda r: r["wall"])
    from_beat = [r for r in ran if not r["id"].startswith("periodic:")]
    from_companion = [r for r in ran if r["id"].startswith("periodic:")]
    assert len(from_beat) == 1
    assert abs(occurrence_s(from_companion[0]["id"]) - (last_run + PERIOD_S)) < 0.01
    # and it runs one period after beat's: none lost, none doubled
    assert from_beat[-1]["wall"] < from_companion[0]["wall"]
    # (a doubled tick leaves a gap near 0, a lost one near two periods;
    # a third of a period allows for a loaded worker's lateness)
    gaps = [later["wall"] - earlier["wall"] for earlier, later in itertools.pairwise(ran)]
    assert all(abs(gap - PERIOD_S) < PERIOD_S / 3 for gap in gaps), gaps
    assert runs.duplicates() == {}


# (One database: the row's fields reach the message the same way from either.)
@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
def test_a_rows_routing_priority_headers_and_expiry_reach_the_message(
    make_test_app: AppFactory,
    database: str,
    processes: list[CeleryProcess],
    worker: Callable[..., CeleryProcess],
    runs: Runs,
) -> None:
    # Given a row routed by exchange and routing key, with a priority,
    # headers and expire_seconds, as the admin's "Execution Options" set them
    add_interval_row(
        database,
        "routed",
        1,
        ["routed"],
        task="tests.record",
        exchange="reports",
        routing_key="reports.daily",
        priority=7,
        headers=json.dumps({"x_from": "the admin"}),
        expire_seconds=300,
    )
    app = make_test_app(
        conf={"zdelay_beat": True},
        queues=[
            {"name": "celery"},
            {"name": "reports", "exchange": "reports", "routing_key": "reports.daily"},
        ],
    )
    # When a companion serves it, and a worker consumes only the bound queue
    worker(app, "reports")
    companion(app, processes, database, "--beat", "-S", "django")

    # Then its runs arrive through that exchange and key, with each option
    wait_for(lambda: runs_with(runs, "routed"), timeout=60, message="a run of the routed row")
    run = runs_with(runs, "routed")[0]
    assert run["routing_key"] == "reports.daily"
    assert run["priority"] == 7
    assert run["headers"]["x_from"] == "the admin"
    expires = datetime.fromisoformat(run["expires"]).timestamp()
    assert abs(expires - (occurrence_s(run["id"]) + 300)) < 1


def test_a_database_outage_stops_no_tick_and_edits_apply_once_it_answers(
    make_test_app: AppFactory,
    processes: list[CeleryProcess],
    worker: Callable[..., CeleryProcess],
    runs: Runs,
    tmp_path: Path,
) -> None:
    # Given a row served from PostgreSQL (the outage: the database refuses
    # connections and the open ones are cut, as a restart or failover does)
    database = new_migrated_database("postgres", tmp_path)
    name = database.partition(":")[2]
    try:
        add_interval_row(database, "ticker", 1, ["before"], task="tests.record")
        app = make_test_app(conf={"zdelay_beat": True})
        worker(app)
        serving = companion(app, processes, database, "--beat", "-S", "django")
        wait_for(lambda: runs_with(runs, "before"), timeout=60, message="a run of the row")

        # When the database goes away for longer than the 5 s parked ahead
        psql(f"ALTER DATABASE {name} ALLOW_CONNECTIONS false")
        psql(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'")
        serving.wait_for_log("periodic tasks go on as last read from the database")
        down_at = time.time()
        # Then the row goes on ticking, each occurrence once
        wait_for(
            lambda: len([r for r in runs_with(runs, "before") if r["wall"] > down_at + 6]) >= 3,
            timeout=60,
            message="3 runs more than 6 s into the outage",
        )
        last_in_outage = max(r["wall"] for r in runs_with(runs, "before"))

        # And once it answers, an edit applies and last_run_at catches up
        psql(f"ALTER DATABASE {name} ALLOW_CONNECTIONS true")
        serving.wait_for_log("The django-celery-beat database answers again")
        django_run(
            database,
            """
            from django_celery_beat.models import PeriodicTask
            row = PeriodicTask.objects.get(name="ticker")
            row.args = json.dumps(["after"])
            row.save()
            """,
        )
        wait_for(lambda: runs_with(runs, "after"), timeout=EDIT_BOUND_S + 10, message="the edit")
        wait_for(
            lambda: (row_of(database, "ticker")["last_run_at"] or 0) >= last_in_outage - 2,
            timeout=30,
            interval=0.5,
            message="last_run_at written after the outage",
        )
        assert runs.duplicates() == {}
    finally:
        psql(f"ALTER DATABASE {name} ALLOW_CONNECTIONS true")
        psql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_rows_that_fail_to_load_are_read_again_at_the_next_check(tmp_path: Path) -> None:
    # A change seen, then the read of the rows failing (the database went
    # away in between), must not count as read: the next check reads again.
    database = new_migrated_database("sqlite", tmp_path)
    add_interval_row(database, "ticker", 1, ["x"], task="celery.backend_cleanup")
    checks = django_run(
        database,
        """
        from celery import Celery
        from django.db import connection
        from django_celery_beat.models import PeriodicTasks
        from celery_zdelay.periodic.django_beat import DjangoBeatSource, SourceUnavailableError
        source = DjangoBeatSource(Celery("beat_rows", set_as_current=False))
        source.changed()
        source.definitions()
        PeriodicTasks.update_changed()  # as an edit in the admin does
        seen = [source.changed()]
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE django_celery_beat_periodictask RENAME TO hidden")
        try:
            source.definitions()
            failed = None
        except SourceUnavailableError as exc:
            failed = str(exc)
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE hidden RENAME TO django_celery_beat_periodictask")
        seen.append(source.changed())
        names = [d.name for d in source.definitions()[0]]
        seen.append(source.changed())
        print(json.dumps({"seen": seen, "failed": failed, "names": names}))
        """,
    )
    assert checks["failed"].startswith("Reading the django-celery-beat rows failed")
    assert checks["seen"] == [True, True, False]
    assert checks["names"] == ["ticker"]
