"""Pytest plugin for Celery's own integration tests: the delayed-work subset.

Loaded by ``.ci/celery_suite.py`` with ``-p celery_suite_plugin`` into a run
of ``t/integration`` from the installed Celery's sdist. With
``ZDELAY_SUITE=zdelay`` it imports ``celery_zdelay`` before Celery's test
app exists (so the app is hooked; ``zdelay_threshold = 0`` comes from
``integration-tests-config.json``, Celery's own way to configure the
suite); with ``ZDELAY_SUITE=native`` the same tests run on Celery alone.

Either way it keeps only the tests that send delayed work: their source
names a countdown, an ETA, a retry or a backoff (``retry_backoff``,
``test_task_retried_*``, canvas countdowns), and leaves out those in
:data:`EXCLUDED`, each with its reason.
"""

from __future__ import annotations

import inspect
import os
import re
from typing import Any

import pytest

#: Tests left out, and why: they inspect what the worker holds in memory,
#: which a parked task never is until it is due.
EXCLUDED = {
    "t/integration/test_inspect.py::test_Inspect::test_scheduled": (
        "asserts that `inspect scheduled` lists a task with an ETA 5 s ahead; "
        "parked in Redis, the task is in no worker's memory until it is due"
    ),
}

#: A test sends delayed work when its source says so.
DELAYED = re.compile(r"countdown|(?<![a-z])eta(?![a-z])|retr(y|ies|ied)|backoff", re.IGNORECASE)

if os.environ.get("ZDELAY_SUITE") == "zdelay":
    # Before Celery's session app is created: celery_zdelay hooks every app
    # created after it is imported.
    import celery_zdelay  # noqa: F401


def _sends_delayed_work(item: Any) -> bool:
    if DELAYED.search(item.name):
        return True
    function = getattr(item, "function", None)
    try:
        source = inspect.getsource(function) if function is not None else ""
    except (OSError, TypeError):
        return False
    return bool(DELAYED.search(source))


def pytest_collection_modifyitems(config: pytest.Config, items: list[Any]) -> None:
    kept, dropped = [], []
    for item in items:
        node = item.nodeid.split("[")[0]
        if node in EXCLUDED or not _sends_delayed_work(item):
            dropped.append(item)
        else:
            kept.append(item)
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept


def pytest_report_header(config: pytest.Config) -> list[str]:
    mode = os.environ.get("ZDELAY_SUITE", "?")
    lines = [f"celery-zdelay suite mode: {mode} (the delayed-work subset of t/integration)"]
    lines += [f"left out: {node}: {reason}" for node, reason in EXCLUDED.items()]
    return lines
