"""django-celery-beat rows done right: bad rows, clocked edits, the overlap policy of a row.

Issue 26 leftovers. Given companions serving django-celery-beat's rows
(``zdelay --beat -S django``) on SQLite and PostgreSQL, then a row that
cannot be served is logged once, shown in ``periodic list`` with why, fails
``status --check`` and blocks no other row; a clocked row edited to a
moment already past runs once, at once, as django-celery-beat runs it; and
a row's ``headers`` JSON carries ``zdelay_overlap``, applied by real
workers to a task that runs long.
"""

from __future__ import annotations

import json
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery

from celery_zdelay import periodic
from celery_zdelay.periodic.api import ScheduleInfo
from tests.conftest import AppFactory
from tests.helpers import CeleryProcess, Runs, wait_for
from tests.support.cli import run
from tests.support.django_beat import (
    EDIT_BOUND_S,
    add_interval_row,
    companion,
    django_run,
    migrated_database,
    occurrence_s,
    runs_with,
)
from tests.support.periodic import (
    finished_runs,
    overlapping_runs,
    run_spans,
    tick_counts,
    ticks_of,
)

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def sqlite_database(tmp_path: Path) -> Iterator[str]:
    """One on SQLite: the policy is the workers', whatever the database."""
    yield from migrated_database("sqlite", tmp_path)


#: Rows that cannot be served, name -> (the words of why, Django code creating it).
BAD_ROWS = {
    "unknown task": (
        "tests.no_such_task",
        """PeriodicTask.objects.create(name="unknown task", task="tests.no_such_task",
               interval=every)""",
    ),
    "bad kwargs": (
        "kwargs is not valid JSON",
        """PeriodicTask.objects.create(name="bad kwargs", task="tests.record", interval=every,
               kwargs="{oops")""",
    ),
    "interval zero": (
        "is not positive",
        """PeriodicTask.objects.create(name="interval zero", task="tests.record",
               interval=IntervalSchedule.objects.create(every=0, period="seconds"))""",
    ),
    "bad cron": (
        "invalid crontab",
        """PeriodicTask.objects.create(name="bad cron", task="tests.record",
               crontab=CrontabSchedule.objects.create(minute="99"))""",
    ),
    "bad overlap": (
        "zdelay_overlap must be one of",
        """PeriodicTask.objects.create(name="bad overlap", task="tests.record", interval=every,
               headers=json.dumps({"zdelay_overlap": "sometimes"}))""",
    ),
    "bad zone": (
        "time zone does not exist",
        """PeriodicTask.objects.create(name="bad zone", task="tests.record", crontab=zone)""",
    ),
}


def _add_bad_rows(database: str) -> None:
    setup = textwrap.dedent(
        """
        from django.db import connection
        from django_celery_beat.models import (
            CrontabSchedule, IntervalSchedule, PeriodicTask,
        )
        every, _ = IntervalSchedule.objects.get_or_create(every=1, period="seconds")
        zone = CrontabSchedule.objects.create(minute="*", hour="*")
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE django_celery_beat_crontabschedule SET timezone = %s WHERE id = %s",
                ["Mars/Olympus", zone.pk],
            )
        """
    )
    # Each create is a call spread over lines: its own lines, unindented.
    creates = [
        " ".join(line.strip() for line in code.splitlines()) for _, code in BAD_ROWS.values()
    ]
    django_run(database, setup + "\n".join(creates))


def _not_served(app: Celery) -> dict[str, str]:
    listed = json.loads(run(app, "periodic", "list", "--json").stdout)
    return {item["name"]: item["reason"] for item in listed["unserved"]}


def test_bad_rows_are_logged_once_listed_fail_the_check_and_block_no_other_row(
    make_test_app: AppFactory,
    database: str,
    processes: list[CeleryProcess],
    worker: Callable[..., CeleryProcess],
    runs: Runs,
) -> None:
    # Given a good row, and rows that cannot be served (past the admin's checks)
    add_interval_row(database, "good", 1, ["good"], task="tests.record")
    _add_bad_rows(database)
    app = make_test_app(conf={"zdelay_beat": True})
    worker(app)
    # When two companions serve them
    served = [companion(app, processes, database, "--beat", "-S", "django") for _ in range(2)]

    # Then the good row runs, each tick once
    wait_for(lambda: len(runs_with(runs, "good")) >= 3, timeout=60, message="runs of the good row")
    # and each bad row is listed with why, under its name in the admin
    wait_for(lambda: len(_not_served(app)) == len(BAD_ROWS), timeout=30, message="6 unserved")
    unserved = _not_served(app)
    for row, (why, _) in BAD_ROWS.items():
        assert why in unserved[row], (row, unserved[row])
    text = run(app, "periodic", "list").stdout
    assert "bad cron  [not served]" in text
    # and status --check fails, a line naming each row and why
    check = run(app, "status", "--check")
    assert check.exit_code != 0
    for row, (why, _) in BAD_ROWS.items():
        line = next(li for li in check.stdout.splitlines() if repr(row) in li)
        assert why in line, line
    # and each is logged once per companion, not on every pass (the change
    # marker is checked every second: six more of them)
    settle = time.monotonic() + 6
    wait_for(lambda: time.monotonic() > settle, timeout=30, interval=0.5)
    for process in served:
        assert process.log().count("'bad kwargs' is not served") == 1
    assert not any(runs_with(runs, row) for row in BAD_ROWS)
    assert runs.duplicates() == {}

    # When the bad rows are deleted, the check no longer names them
    django_run(
        database,
        """
        from django_celery_beat.models import PeriodicTask
        for row in PeriodicTask.objects.exclude(name="good"):
            row.delete()
        """,
    )
    wait_for(lambda: not _not_served(app), timeout=EDIT_BOUND_S + 10, message="none unserved")
    assert run(app, "status", "--check").exit_code == 0

    # When the good row is edited into a bad one, it is withdrawn: its runs stop
    edited = django_run(
        database,
        """
        import time
        from django_celery_beat.models import PeriodicTask
        row = PeriodicTask.objects.get(name="good")
        row.args = "[oops"
        row.save()
        print(json.dumps(time.time()))
        """,
    )
    wait_for(lambda: "good" in _not_served(app), timeout=EDIT_BOUND_S + 10, message="good unserved")
    stop = time.monotonic() + EDIT_BOUND_S + 3
    wait_for(lambda: time.monotonic() > stop, timeout=EDIT_BOUND_S + 10, interval=0.5)
    late = [r["wall"] - edited for r in runs_with(runs, "good") if r["wall"] > edited]
    assert all(seconds < EDIT_BOUND_S for seconds in late), late
    assert not any(i.name == "good" for i in _schedules(app))


def _schedules(app: Celery) -> list[ScheduleInfo]:
    return periodic.schedules(app)[1]


def _enabled(database: str, name: str) -> bool:
    enabled: bool = django_run(
        database,
        f"""
        from django_celery_beat.models import PeriodicTask
        print(json.dumps(PeriodicTask.objects.get(name={name!r}).enabled))
        """,
    )
    return enabled


def test_a_clocked_row_edited_to_a_past_moment_runs_once_at_once(
    make_test_app: AppFactory,
    database: str,
    processes: list[CeleryProcess],
    worker: Callable[..., CeleryProcess],
    runs: Runs,
) -> None:
    # Given a clocked row due in an hour, served by two companions
    django_run(
        database,
        """
        import time
        from datetime import datetime, timezone
        from django_celery_beat.models import ClockedSchedule, PeriodicTask
        clocked = ClockedSchedule.objects.create(
            clocked_time=datetime.fromtimestamp(time.time() + 3600, timezone.utc)
        )
        PeriodicTask.objects.create(
            name="moved", task="tests.record", clocked=clocked, one_off=True, args='["moved"]'
        )
        """,
    )
    app = make_test_app(conf={"zdelay_beat": True})
    worker(app)
    for _ in range(2):
        companion(app, processes, database, "--beat", "-S", "django")
    wait_for(lambda: any(i.name == "moved" for i in _schedules(app)), timeout=30)

    # When the admin moves its moment to a minute ago
    moment = round(time.time()) - 60
    edited = django_run(
        database,
        f"""
        import time
        from datetime import datetime, timezone
        from django_celery_beat.models import PeriodicTask
        clocked = PeriodicTask.objects.get(name="moved").clocked
        clocked.clocked_time = datetime.fromtimestamp({moment!r}, timezone.utc)
        clocked.save()
        print(json.dumps(time.time()))
        """,
    )

    # Then it runs once, within the edit bound, as the occurrence of that moment
    wait_for(lambda: runs_with(runs, "moved"), timeout=EDIT_BOUND_S + 10, message="the run")
    (ran,) = runs_with(runs, "moved")
    print(f"clocked row moved to the past: ran {ran['wall'] - edited:.2f} s after the save")
    assert ran["wall"] - edited < EDIT_BOUND_S
    assert occurrence_s(ran["id"]) == moment
    # and is disabled after it, as django-celery-beat disables a one_off row
    wait_for(
        lambda: not _enabled(database, "moved"),
        timeout=30,
        interval=0.5,
        message="the one_off row disabled",
    )

    # When another row is added (every companion reads the rows again), it does not run again
    add_interval_row(database, "other", 1, ["other"], task="tests.record")
    wait_for(lambda: runs_with(runs, "other"), timeout=EDIT_BOUND_S + 10, message="other")
    settle = time.monotonic() + 3
    wait_for(lambda: time.monotonic() > settle, timeout=10, interval=0.5)
    assert len(runs_with(runs, "moved")) == 1
    assert runs.duplicates() == {}


@pytest.mark.parametrize("policy", ["skip", "buffer_one"])
def test_a_rows_headers_carry_its_overlap_policy_to_real_workers(
    make_test_app: AppFactory,
    sqlite_database: str,
    processes: list[CeleryProcess],
    worker: Callable[..., CeleryProcess],
    runs: Runs,
    policy: str,
) -> None:
    # Given a 1-second row whose task runs 3 s, with its policy in its headers
    # (the admin's "Execution Options": a JSON field kept across edits)
    add_interval_row(
        sqlite_database,
        "slow row",
        1,
        [3.0],
        task="tests.slow_late",
        headers=json.dumps(
            {"zdelay_overlap": policy, "zdelay_overlap_timeout": 60, "x_from": "admin"}
        ),
    )
    app = make_test_app(conf={"zdelay_beat": True})
    for _ in range(3):
        worker(app)
    # When a companion serves it
    companion(app, processes, sqlite_database, "--beat", "-S", "django")
    wait_for(lambda: finished_runs(runs, "slow_row") >= 3, timeout=120, message="3 runs")

    # Then runs never overlapped, ticks released meanwhile were skipped and counted
    spans = run_spans(runs, "slow_row")
    assert overlapping_runs(spans) == []
    assert tick_counts(app, "slow_row")["skipped_overlap"] >= 1
    (info,) = [i for i in _schedules(app) if i.name == "slow_row"]
    assert info.overlap == policy
    # and the row's other headers still reach the message, the policy's keys do not
    headers = next(r for r in runs.all() if r["id"].startswith("periodic:slow_row:"))["headers"]
    assert headers["x_from"] == "admin"
    assert "zdelay_overlap_timeout" not in headers
    if policy == "buffer_one":
        # a run waited for the one before it: started well after its own time
        waited = [start / 1000 - occurrence_s(i) for i, (start, _) in spans.items()]
        assert max(waited) >= 1.5, waited
    started = Counter(r["id"] for r in ticks_of(runs.all(), "slow_row") if r["result"] == "started")
    assert max(started.values()) == 1


def _save(database: str, change: str) -> float:
    """Run *change* on the rows as the admin saves them; return when it was committed (epoch s)."""
    saved: float = django_run(
        database,
        f"""
        import time
        from django_celery_beat.models import IntervalSchedule, PeriodicTask
        {change}
        print(json.dumps(time.time()))
        """,
    )
    return saved


def _first_run_after(runs: Runs, marker: str, saved: float, what: str) -> float:
    """Seconds from *saved* to the first run with *marker* after it (waits up to the bound)."""
    wait_for(
        lambda: [r for r in runs_with(runs, marker) if r["wall"] > saved],
        timeout=EDIT_BOUND_S + 10,
        message=what,
    )
    took = min(r["wall"] for r in runs_with(runs, marker) if r["wall"] > saved) - saved
    print(f"{what}: {took:.2f} s after the save")
    return took


def test_a_row_edited_back_re_enabled_or_re_created_takes_effect_within_the_bound(
    make_test_app: AppFactory,
    database: str,
    processes: list[CeleryProcess],
    worker: Callable[..., CeleryProcess],
    runs: Runs,
) -> None:
    # Given two rows every second, served by two companions
    add_interval_row(database, "ticker", 1, ["a"], task="tests.record")
    add_interval_row(database, "toggled", 1, ["toggled"], task="tests.record")
    app = make_test_app(conf={"zdelay_beat": True})
    worker(app)
    served = [companion(app, processes, database, "--beat", "-S", "django") for _ in range(2)]
    wait_for(lambda: runs_with(runs, "a") and runs_with(runs, "toggled"), timeout=60)
    ticker = 'row = PeriodicTask.objects.get(name="ticker")'

    # When the ticker's args are edited, then edited back to what they were
    edited = _save(database, f'{ticker}; row.args = json.dumps(["b"]); row.save()')
    assert _first_run_after(runs, "b", edited, "the edit") < EDIT_BOUND_S
    back = _save(database, f'{ticker}; row.args = json.dumps(["a"]); row.save()')

    # Then the edit back takes effect within the bound too (it is newer, not a rollback)
    assert _first_run_after(runs, "a", back, "the edit back") < EDIT_BOUND_S
    late = [r["wall"] - back for r in runs_with(runs, "b") if r["wall"] > back]
    assert all(seconds < EDIT_BOUND_S for seconds in late), late

    # When the other row is disabled, then enabled again
    toggled = 'row = PeriodicTask.objects.get(name="toggled")'
    _save(database, f"{toggled}; row.enabled = False; row.save()")
    wait_for(
        lambda: not any(i.name == "toggled" for i in _schedules(app)),
        timeout=EDIT_BOUND_S + 10,
        message="the disabled row withdrawn",
    )
    enabled = _save(database, f"{toggled}; row.enabled = True; row.save()")

    # Then it runs again within the bound
    assert _first_run_after(runs, "toggled", enabled, "the row enabled again") < EDIT_BOUND_S

    # When the ticker is deleted, then created again under its name, as it was
    _save(database, f"{ticker}; row.delete()")
    wait_for(
        lambda: not any(i.name == "ticker" for i in _schedules(app)),
        timeout=EDIT_BOUND_S + 10,
        message="the deleted row withdrawn",
    )
    created = _save(
        database,
        """every = IntervalSchedule.objects.get(every=1, period="seconds")
        PeriodicTask.objects.create(
            name="ticker", task="tests.record", interval=every, args=json.dumps(["a"])
        )""",
    )

    # Then it runs again within the bound, each tick once, and no companion
    # took an edit for an old deploy's schedule
    assert _first_run_after(runs, "a", created, "the row created again") < EDIT_BOUND_S
    assert runs.duplicates() == {}
    for process in served:
        assert "was replaced by a newer one" not in process.log()


def test_a_redis_that_lost_everything_gets_the_rows_back_without_an_edit(
    make_test_app: AppFactory,
    sqlite_database: str,
    processes: list[CeleryProcess],
    worker: Callable[..., CeleryProcess],
    runs: Runs,
    redis_client: redis.Redis,
) -> None:
    # Given a companion serving a row every second
    add_interval_row(sqlite_database, "ticker", 1, ["ticker"], task="tests.record")
    app = make_test_app(conf={"zdelay_beat": True})
    worker(app)
    companion(app, processes, sqlite_database, "--beat", "-S", "django")
    wait_for(lambda: runs_with(runs, "ticker"), timeout=60, message="a run of the row")

    # When the store's Redis loses everything (restarted without persistence),
    # and nobody edits a row
    redis_client.flushdb()
    lost = time.time()

    # Then the companion stores the rows again and the row runs on
    wait_for(
        lambda: [r for r in runs_with(runs, "ticker") if r["wall"] > lost + 1],
        timeout=EDIT_BOUND_S + 10,
        message="a run after Redis lost everything",
    )
    assert any(i.name == "ticker" for i in _schedules(app))
