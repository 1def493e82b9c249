"""The opt-in audit trail: one INFO line per released, cancelled, rescheduled or dead task.

Given ``zdelay_audit_log``, when the companion hands entries straight into a
Redis broker (the atomic handoff), publishes them through kombu, or
dead-letters one, then the ``celery_zdelay.audit`` logger names each task
id. Without the setting it says nothing. Counts in log lines read as words
("1 message waits").
"""

from __future__ import annotations

import logging

import pytest

from celery_zdelay.companion import Companion
from celery_zdelay.parking import store_for
from celery_zdelay.testing import free_port
from tests.conftest import AppFactory
from tests.support.store import put_raw

pytestmark = pytest.mark.timeout(60)


def _release(app) -> int:
    with Companion(app) as companion:
        report = companion.release_due()
    assert not report.failed
    return report.released + report.dead_lettered


def test_the_atomic_handoff_logs_each_released_id(
    make_test_app: AppFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # Regression: handoff releases were logged per batch, without ids.
    app = make_test_app(conf={"zdelay_audit_log": True})
    results = [app.tasks["tests.record"].apply_delayed((i,), countdown=0) for i in range(3)]

    with caplog.at_level(logging.INFO, logger="celery_zdelay.audit"):
        assert _release(app) == 3

    for result in results:
        assert f"Released {result.id} (handoff)" in caplog.text


def test_the_generic_path_logs_each_released_id(
    make_test_app: AppFactory, redis_server, caplog: pytest.LogCaptureFixture
) -> None:
    # The store in another database than the broker: no handoff, kombu publishes.
    app = make_test_app(
        conf={"zdelay_audit_log": True, "zdelay_redis_url": f"{redis_server.url}/3"}
    )
    results = [app.tasks["tests.record"].apply_delayed((i,), countdown=0) for i in range(2)]

    with caplog.at_level(logging.INFO, logger="celery_zdelay.audit"):
        assert _release(app) == 2

    for result in results:
        assert f"Released {result.id} (publish)" in caplog.text


def test_a_dead_lettered_id_is_in_the_trail_with_its_reason(
    make_test_app: AppFactory, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_test_app(conf={"zdelay_audit_log": True})
    put_raw(store_for(app), "broken-1", b"not an entry", due_in_ms=0)

    with caplog.at_level(logging.INFO, logger="celery_zdelay.audit"):
        assert _release(app) == 1

    assert "Dead-lettered broken-1: " in caplog.text


def test_without_the_setting_releases_are_not_logged_per_id(
    make_test_app: AppFactory, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_test_app()
    result = app.tasks["tests.record"].apply_delayed((1,), countdown=0)

    with caplog.at_level(logging.INFO, logger="celery_zdelay.audit"):
        assert _release(app) == 1

    assert result.id not in caplog.text


def test_one_waiting_message_is_counted_in_the_singular(
    make_test_app: AppFactory, redis_server, caplog: pytest.LogCaptureFixture
) -> None:
    # Regression: "1 messages wait".
    app = make_test_app(
        broker=f"redis://127.0.0.1:{free_port()}/0",
        conf={"zdelay_redis_url": f"{redis_server.url}/3"},
    )
    app.tasks["tests.record"].apply_delayed((1,), countdown=0)

    with caplog.at_level(logging.WARNING, logger="celery_zdelay"), Companion(app) as companion:
        report = companion.release_due()

    assert report.failed
    assert "Broker unreachable or silent, 1 message waits" in caplog.text
