"""django-celery-beat test support: a migrated database, rows, companions on it.

Shared by the tests of django-celery-beat rows as the schedule source
(``tests/periodic/test_django_beat*.py``) and of the Django admin's history: Django
runs in its own process on the database, as the admin would write to it.
Loaded as a pytest plugin (``tests/conftest.py``) for its ``database``
fixture.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import textwrap
import uuid
from collections.abc import Generator, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from tests.helpers import ROOT, CeleryProcess, Runs, unavailable
from tests.support import django_forks

SETTINGS = "tests.beat_project.settings"
#: Seconds within which an edit made in the database reaches the companions
#: (the periodic server checks django-celery-beat's change marker every second).
EDIT_BOUND_S = 12.0
#: The period of the row switched from celery beat to the companions: longer
#: than stopping beat and starting a companion takes on a loaded machine
#: (40 s was seen), so that no tick falls due in between.
PERIOD_S = 45
MIGRATE = "from django.core.management import call_command\ncall_command('migrate', verbosity=0)"


@pytest.fixture(params=["sqlite", "postgres"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A migrated django-celery-beat database: ``sqlite:<path>`` or ``postgres:<name>``."""
    yield from migrated_database(request.param, tmp_path)


def migrated_database(kind: str, tmp_path: Path) -> Generator[str, None, None]:
    """A migrated django-celery-beat database of *kind* (a fixture's body).

    Yields ``sqlite:<path>`` or ``postgres:<name>`` (dropped afterwards).
    """
    spec = new_migrated_database(kind, tmp_path)
    try:
        yield spec
    finally:
        if kind == "postgres":
            psql(f"DROP DATABASE IF EXISTS {spec.partition(':')[2]} WITH (FORCE)")


def new_migrated_database(kind: str, tmp_path: Path) -> str:
    """Make a migrated database of *kind*; return ``sqlite:<path>`` or ``postgres:<name>``.

    It is a copy of a database this test process migrated once (a migration
    is a Django process of 2-4 s on this machine; a copy is a file copy, or
    PostgreSQL's ``CREATE DATABASE ... TEMPLATE``). The caller drops a
    PostgreSQL one.
    """
    if kind == "sqlite":
        path = tmp_path / "beat.sqlite3"
        shutil.copyfile(_migrated_template("sqlite"), path)
        return f"sqlite:{path}"
    name = f"zdelay_beat_{uuid.uuid4().hex[:10]}"
    psql(f"CREATE DATABASE {name} TEMPLATE {_migrated_template('postgres')}")
    return f"postgres:{name}"


#: kind -> the database this process migrated for its tests to copy: a
#: file's path (sqlite) or a database's name (postgres, one per process:
#: PostgreSQL copies a template no other session is connected to).
_templates: dict[str, str] = {}


def _migrated_template(kind: str) -> str:
    if kind not in _templates:
        if kind == "sqlite":
            folder = Path(tempfile.mkdtemp(prefix="zdelay-beat-template-"))
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            template = str(folder / "beat.sqlite3")
            django_run(f"sqlite:{template}", MIGRATE)
        else:
            template = f"zdelay_beat_template_{uuid.uuid4().hex[:10]}"
            psql(f"CREATE DATABASE {template}")
            atexit.register(_drop_quietly, template)
            # The migrating process has exited when django_run returns: no
            # session is left on the template to stop it being copied.
            django_run(f"postgres:{template}", MIGRATE)
        _templates[kind] = template
    return _templates[kind]


def _drop_quietly(name: str) -> None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(
            _psql_command(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
            capture_output=True,
            timeout=30,
            check=False,
        )


def _psql_command(sql: str) -> list[str]:
    return ["psql", "-h", "127.0.0.1", "-U", "postgres", "-d", "postgres", "-c", sql]


def psql(sql: str) -> None:
    try:
        subprocess.run(_psql_command(sql), check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.CalledProcessError) as exc:
        unavailable(
            f"PostgreSQL on 127.0.0.1:5432 not usable: {exc}",
            in_ci=f"PostgreSQL on 127.0.0.1:5432 is required in CI: {exc}",
        )


def django_run(
    database: str,
    code: str,
    *,
    settings: str = SETTINGS,
    env: dict[str, str] | None = None,
    timeout: float = 60,
) -> Any:
    """Run *code* in a Django process on *database*; return what it prints, as JSON.

    The process is forked from one that imported Django already (see
    :mod:`tests.support.django_forks`).
    """
    program = "import django, json\ndjango.setup()\n" + textwrap.dedent(code)
    done = django_forks.run(
        program,
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "DJANGO_SETTINGS_MODULE": settings,
            "ZDELAY_TEST_BEAT_DB": database,
            **(env or {}),
        },
        cwd=ROOT,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise AssertionError(f"Django code failed:\n{code}\n{done.stderr[-3000:]}")
    out = done.stdout.strip()
    return json.loads(out) if out else None


def add_interval_row(
    database: str, name: str, seconds: int, args: list[Any], **extra: Any
) -> float:
    """Add a row; return when it was committed (epoch s)."""
    saved: float = django_run(
        database,
        f"""
        import time
        from django_celery_beat.models import IntervalSchedule, PeriodicTask
        every, _ = IntervalSchedule.objects.get_or_create(every={seconds}, period="seconds")
        PeriodicTask.objects.create(
            name={name!r}, interval=every, args=json.dumps({args!r}), **{extra!r}
        )
        print(json.dumps(time.time()))
        """,
    )
    return saved


def row_of(database: str, name: str) -> dict[str, Any]:
    row: dict[str, Any] = django_run(
        database,
        f"""
        from django_celery_beat.models import PeriodicTask
        row = PeriodicTask.objects.get(name={name!r})
        print(json.dumps({{
            "last_run_at": row.last_run_at.timestamp() if row.last_run_at else None,
            "total_run_count": row.total_run_count,
        }}))
        """,
    )
    return row


def companion(
    app: Celery, processes: list[CeleryProcess], database: str, *args: str
) -> CeleryProcess:
    process = CeleryProcess(
        app,
        "zdelay",
        "-l",
        "DEBUG",
        *args,
        env={"DJANGO_SETTINGS_MODULE": SETTINGS, "ZDELAY_TEST_BEAT_DB": database},
    )
    processes.append(process)
    process.start()
    process.wait_for_log(" started: ")
    return process


def runs_with(runs: Runs, marker: str) -> list[dict[str, Any]]:
    return [r for r in runs.all() if r["args"] and r["args"][0] == marker]


def occurrence_s(task_id: str) -> float:
    """The occurrence time an id names (``periodic:<name>:v<n>:<ISO time>Z``), epoch s."""
    stamp = task_id.rsplit(":v", 1)[1].split(":", 1)[1]
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
