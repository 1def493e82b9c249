"""Forgetting the companion is like forgetting beat: tasks never run. Say so.

Given no live companion, a worker says so when it starts, and a producer on
its first park; given one, neither says a word. A misspelt ``zdelay_*``
setting is reported when a worker starts, in the spelling the app uses.
"""

from __future__ import annotations

import logging

import pytest
from celery import Celery

from celery_zdelay.parking import store_for
from tests.conftest import AppFactory
from tests.support.store import write_heartbeat

pytestmark = pytest.mark.timeout(90)

NO_COMPANION = "No celery-zdelay companion is running for the store"


def test_a_worker_started_without_a_companion_warns(app: Celery, worker) -> None:
    process = worker(app)

    assert NO_COMPANION in process.log()
    assert "celery -A proj zdelay" in process.log()


def test_a_worker_started_beside_a_live_companion_does_not_warn(
    app: Celery, worker, companion
) -> None:
    companion(app)

    process = worker(app)

    assert NO_COMPANION not in process.log()


def test_a_misspelt_setting_is_reported_when_a_worker_starts(
    make_test_app: AppFactory, worker
) -> None:
    app = make_test_app(conf={"zdelay_treshold": 60})

    process = worker(app)

    assert "Unknown setting zdelay_treshold. Did you mean zdelay_threshold?" in process.log()


def test_the_first_park_of_a_process_warns_when_no_companion_is_alive(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    record = app.tasks["tests.record"]

    with caplog.at_level(logging.WARNING, logger="celery_zdelay.parking"):
        record.apply_delayed(("a",), countdown=600)
        record.apply_delayed(("b",), countdown=600)

    assert caplog.text.count(NO_COMPANION) == 1


def test_the_first_park_is_quiet_when_a_companion_is_alive(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    write_heartbeat(store_for(app), "live-1", seen_ago_ms=1_000)

    with caplog.at_level(logging.WARNING, logger="celery_zdelay.parking"):
        app.tasks["tests.record"].apply_delayed(("a",), countdown=600)

    assert NO_COMPANION not in caplog.text


def test_an_app_that_does_not_use_celery_zdelay_gets_no_warning() -> None:
    # Importing celery_zdelay hooks every app of the process: one that neither
    # sets a zdelay_* setting nor uses its task class is left in peace.
    from celery_zdelay.worker import startup_problems

    plain = Celery("plain", broker="amqp://127.0.0.1:1//", set_as_current=False)
    used = Celery(
        "used", broker="amqp://127.0.0.1:1//", task_cls="celery_zdelay:Task", set_as_current=False
    )

    assert startup_problems(plain) == []
    (problem,) = startup_problems(used)
    assert "set zdelay_redis_url" in problem
