"""django-celery-beat rows read as a companion reads them again, in a Django process.

Imported by the code :func:`tests.support.django_beat.django_run` runs (Django
set up on a test database), never by the test process itself. A
:class:`Reading` keeps one :class:`DjangoBeatSource` across edits, as a
companion does, and compares each of its reads with a fresh source's
first read of the same rows, which builds every row: what a read that
builds only the rows that changed must give (``tests/periodic/test_rows_incremental.py``).
Edits are made as django-celery-beat and its admin make them: ``save()``,
the admin's enable/disable actions (``QuerySet.update`` then
``PeriodicTasks.update_changed()``), saves of shared schedules.
"""

from __future__ import annotations

from contextlib import suppress
from datetime import datetime, timedelta, timezone
from typing import Any

from celery import Celery

from celery_zdelay.periodic.django_beat import DjangoBeatSource

#: A task every Celery app registers, and one none does.
TASK = "celery.backend_cleanup"
UNKNOWN_TASK = "tests.no_such_task"
#: A clocked moment: fixed, so that two reads of a row agree on it.
CLOCKED_AT = datetime(2030, 1, 1, tzinfo=timezone.utc)

#: A value for each column a definition is made of, to update one at a time in bulk.
BULK_EDITS = {
    "args": '["bulk"]',
    "kwargs": '{"bulk": 1}',
    "task": "tests.no_such_task",
    "queue": "bulk",
    "exchange": "bulk",
    "routing_key": "bulk",
    "headers": '{"zdelay_overlap": "skip"}',
    "priority": 5,
    "expire_seconds": 30,
    "one_off": True,
    "name": "renamed in bulk",
    "expires": "2031-01-01T00:00:00+00:00",
    "start_time": "2029-01-01T00:00:00+00:00",
}


def app() -> Celery:
    return Celery("beat_rows_reading", set_as_current=False)


def snapshot(source: DjangoBeatSource) -> dict[str, Any]:
    """Read the rows with *source*, as the periodic server does; what it gives, as JSON."""
    source.changed()
    definitions, errors = source.definitions()
    return {
        "definitions": [[d.name, d.label, d.body()] for d in definitions],
        "errors": errors,
        "last_runs": source.last_runs(),
        "pinned": source.pinned(),
        "rows": source._rows,
        "one_off": sorted(source._one_off),
    }


class Reading:
    """One source kept across edits, its reads compared with a fresh source's."""

    def __init__(self) -> None:
        self.app = app()
        self.source = DjangoBeatSource(self.app)
        #: Rows built (the definition builder called) by the kept source, per read.
        self.built: list[int] = []
        self.steps: list[dict[str, Any]] = []
        build = self.source._definition

        def counted(row: Any, name: str, known: set[str]) -> Any:
            self.built[-1] += 1
            return build(row, name, known)

        self.source._definition = counted  # type: ignore[method-assign]

    def check(self, step: str) -> dict[str, Any]:
        """Read with the kept source and a fresh one; record and return both."""
        self.built.append(0)
        kept = snapshot(self.source)
        fresh = snapshot(DjangoBeatSource(self.app))
        done = {"step": step, "kept": kept, "fresh": fresh, "built": self.built[-1]}
        self.steps.append(done)
        return done


def clear() -> None:
    """No rows, no schedules, no change marker: a database as migrated.

    In SQL: Django's delete loads the crontabs, and refuses one whose time
    zone does not exist.
    """
    from django.db import connection
    from django_celery_beat.models import (
        ClockedSchedule,
        CrontabSchedule,
        IntervalSchedule,
        PeriodicTask,
        PeriodicTasks,
        SolarSchedule,
    )

    with connection.cursor() as cursor:
        for model in (
            PeriodicTask,
            IntervalSchedule,
            CrontabSchedule,
            SolarSchedule,
            ClockedSchedule,
            PeriodicTasks,
        ):
            cursor.execute(f"DELETE FROM {model._meta.db_table}")


def toggle(name: str, *, enabled: bool) -> None:
    """Enable or disable a row as the admin's actions do: no save, the marker moved."""
    from django_celery_beat.models import PeriodicTask, PeriodicTasks

    PeriodicTask.objects.filter(name=name).update(enabled=enabled)
    PeriodicTasks.update_changed()


def set_zone(crontab_id: int, zone: str) -> None:
    """Write a crontab's time zone as text (a name Django would refuse, too), the marker moved."""
    from django.db import connection
    from django_celery_beat.models import PeriodicTasks

    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE django_celery_beat_crontabschedule SET timezone = %s WHERE id = %s",
            [zone, crontab_id],
        )
    PeriodicTasks.update_changed()


def note_run(name: str, at: datetime) -> None:
    """Write a run as the companions do (``note_runs``): no save, the marker unmoved."""
    from django.db.models import F
    from django_celery_beat.models import PeriodicTask

    PeriodicTask.objects.filter(name=name).update(
        last_run_at=at, total_run_count=F("total_run_count") + 1
    )


def explore(examples: int, seed: int) -> dict[str, Any]:
    """Random edit sequences of a few rows: after each edit, kept and fresh reads agree.

    Hypothesis draws the sequences (*examples* of them, from *seed*) and
    shrinks a failing one; returns how many edits were checked.
    """
    from django.core.exceptions import ValidationError
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as use_seed
    from hypothesis import strategies as st

    # At least one edit per sequence: the caller counts them (30 sequences
    # of 0 to 12 made 100 edits or fewer with some seeds).
    edits = st.lists(
        st.tuples(st.sampled_from(sorted(_EDITS)), st.integers(0, 11)), min_size=1, max_size=12
    )
    checked = {"edits": 0, "built": 0}

    @use_seed(seed)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(edits)
    def run(sequence: list[tuple[str, int]]) -> None:
        clear()
        _start()
        reading = Reading()
        reading.check("start")
        for kind, which in sequence:
            # An edit django-celery-beat's save refuses (as its admin would) changes nothing.
            with suppress(ValidationError):
                _EDITS[kind](which)
            done = reading.check(f"{kind} {which}")
            checked["edits"] += 1
            checked["built"] += done["built"]
            assert done["kept"] == done["fresh"], (sequence, done)

    run()
    return checked


# -- the model's rows and edits --------------------------------------------------

#: Names the rows take: two pairs differing by spaces and '_' only.
_NAMES = ["r0", "r1", "a b", "a_b", "c  d", "c_d", "r6"]


def _start() -> None:
    """Four rows on two shared intervals, a crontab, a solar schedule and a clocked one."""
    from django_celery_beat.models import (
        ClockedSchedule,
        CrontabSchedule,
        IntervalSchedule,
        PeriodicTask,
        SolarSchedule,
    )

    minute = IntervalSchedule.objects.create(every=60, period="seconds")
    IntervalSchedule.objects.create(every=1, period="days")
    CrontabSchedule.objects.create(minute="5", hour="*")
    SolarSchedule.objects.create(event="sunrise", latitude="48.85", longitude="2.35")
    ClockedSchedule.objects.create(clocked_time=CLOCKED_AT)
    for name in ("r0", "r1", "a b", "c  d"):
        PeriodicTask.objects.create(name=name, task=TASK, interval=minute)


def _row(which: int) -> Any:
    from django_celery_beat.models import PeriodicTask

    rows = list(PeriodicTask.objects.order_by("pk"))
    return rows[which % len(rows)] if rows else None


def _schedule(model: Any, which: int) -> Any:
    return list(model.objects.order_by("pk"))[which % model.objects.count()]


def _set_field(field: str, values: list[Any]) -> Any:
    """An edit of one column: saved (as the admin saves), or updated in bulk.

    Updated as a script or a data migration updates rows, then
    ``update_changed()`` as django-celery-beat asks: the row's
    ``date_changed`` stays as it was, so only the column itself tells.
    """

    def edit(which: int) -> None:
        from django_celery_beat.models import PeriodicTask, PeriodicTasks

        row = _row(which)
        if row is None:
            return
        value = values[which // 2 % len(values)]
        if which % 2:
            PeriodicTask.objects.filter(pk=row.pk).update(**{field: value})
            PeriodicTasks.update_changed()
        else:
            setattr(row, field, value)
            row.save()

    return edit


def _rename(which: int) -> None:
    from django_celery_beat.models import PeriodicTask

    row = _row(which)
    name = _NAMES[which % len(_NAMES)]
    if row is not None and not PeriodicTask.objects.filter(name=name).exists():
        row.name = name
        row.save()


def _switch_schedule(which: int) -> None:
    """Give a row another schedule: one of the intervals, the crontab, the solar, the clocked."""
    from django_celery_beat.models import (
        ClockedSchedule,
        CrontabSchedule,
        IntervalSchedule,
        SolarSchedule,
    )

    row = _row(which)
    if row is None:
        return
    kinds = [
        ("interval", IntervalSchedule),
        ("crontab", CrontabSchedule),
        ("solar", SolarSchedule),
        ("clocked", ClockedSchedule),
    ]
    kind, model = kinds[which % len(kinds)]
    for other, _ in kinds:
        setattr(row, other, None)
    setattr(row, kind, _schedule(model, which))
    # django-celery-beat's save refuses a clocked row that is not one_off.
    row.one_off = row.one_off or kind == "clocked"
    row.save()


def _toggle(which: int) -> None:
    row = _row(which)
    if row is not None:
        toggle(row.name, enabled=not row.enabled)


def _delete(which: int) -> None:
    row = _row(which)
    if row is not None:
        row.delete()


def _add(which: int) -> None:
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    name = _NAMES[which % len(_NAMES)]
    if not PeriodicTask.objects.filter(name=name).exists():
        PeriodicTask.objects.create(name=name, task=TASK, interval=_schedule(IntervalSchedule, 0))


def _edit_interval(which: int) -> None:
    from django_celery_beat.models import IntervalSchedule

    interval = _schedule(IntervalSchedule, which)
    interval.every = [60, 30, 0, 2][which % 4]  # 0: not positive, a bad row
    interval.save()


def _edit_crontab(which: int) -> None:
    from django_celery_beat.models import CrontabSchedule

    crontab = _schedule(CrontabSchedule, 0)
    crontab.minute = ["5", "*/10", "99"][which % 3]  # 99: an invalid crontab
    crontab.save()


def _crontab_zone(which: int) -> None:
    from django_celery_beat.models import CrontabSchedule

    set_zone(_schedule(CrontabSchedule, 0).pk, ["UTC", "Europe/Paris", "Mars/Olympus"][which % 3])


def _edit_solar(which: int) -> None:
    from django_celery_beat.models import SolarSchedule

    solar = _schedule(SolarSchedule, 0)
    solar.event = ["sunrise", "sunset"][which % 2]
    solar.save()


def _edit_clocked(which: int) -> None:
    from django_celery_beat.models import ClockedSchedule

    clocked = _schedule(ClockedSchedule, 0)
    clocked.clocked_time = CLOCKED_AT - timedelta(days=3650 * (which % 2))
    clocked.save()


def _run(which: int) -> None:
    row = _row(which)
    if row is not None:
        note_run(row.name, CLOCKED_AT - timedelta(days=3650 + which))


_EDITS = {
    "args": _set_field("args", ['["x"]', '["y"]', "[oops"]),
    "kwargs": _set_field("kwargs", ['{"k": 1}', "[1]", "{}"]),
    "task": _set_field("task", [TASK, UNKNOWN_TASK]),
    "queue": _set_field("queue", [None, "q1", "q2"]),
    "routing": _set_field("routing_key", [None, "rk"]),
    "exchange": _set_field("exchange", [None, "ex"]),
    "priority": _set_field("priority", [None, 3, 7]),
    "headers": _set_field(
        "headers", ["{}", '{"zdelay_overlap": "skip"}', '{"h": 1}', '{"zdelay_overlap": "x"}']
    ),
    "one_off": _set_field("one_off", [True, False]),
    "start": _set_field("start_time", [None, CLOCKED_AT - timedelta(days=1)]),
    "expires": _set_field("expires", [None, CLOCKED_AT + timedelta(days=1)]),
    "expire_seconds": _set_field("expire_seconds", [None, 30]),
    "description": _set_field("description", ["", "said"]),
    "rename": _rename,
    "schedule": _switch_schedule,
    "toggle": _toggle,
    "delete": _delete,
    "add": _add,
    "interval": _edit_interval,
    "crontab": _edit_crontab,
    "zone": _crontab_zone,
    "solar": _edit_solar,
    "clocked": _edit_clocked,
    "run": _run,
}
