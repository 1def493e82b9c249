"""Who serves the periodic schedules is shown, and nobody serving them fails the check.

Given a stored schedule and companions started without ``--beat`` (a deploy
that forgot it), then ``status --check`` fails naming the schedules, the
companions table says no companion serves them, and each companion's start
line says so; once a companion serves them, the check passes.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from celery import Celery

from celery_zdelay import periodic
from celery_zdelay.cli import EXIT_CHECK_FAILED, EXIT_OK
from tests.helpers import CeleryProcess, wait_for
from tests.support.cli import run

pytestmark = pytest.mark.timeout(90)


def _beat_column(app: Celery) -> list[bool]:
    document = json.loads(run(app, "status", "--json").stdout)
    return [c["beat"] for c in document["companions"] if c["alive"]]


def test_schedules_that_no_live_companion_serves_fail_the_check(
    app: Celery, companion: Callable[..., CeleryProcess]
) -> None:
    # Given a schedule stored, and a companion started without --beat
    periodic.add("cleanup", app=app, task="tests.record", schedule=3600)
    plain = companion(app)
    plain.wait_for_log("periodic tasks not served")
    wait_for(lambda: _beat_column(app) == [False], timeout=20, message="the heartbeat")

    # Then the check fails and says why
    result = run(app, "status", "--check")
    assert result.exit_code == EXIT_CHECK_FAILED
    assert "1 periodic schedule stored but no live companion serves them" in result.stdout
    assert "BEAT" in run(app, "status").stdout

    # When a paused schedule is all there is, nothing is missing
    periodic.pause("cleanup", app=app)
    assert run(app, "status", "--check").exit_code == EXIT_OK
    periodic.resume("cleanup", app=app)

    # When a companion serves them, the check passes
    served = companion(app, "--beat")
    served.wait_for_log("periodic tasks served")
    wait_for(
        lambda: sorted(_beat_column(app)) == [False, True], timeout=20, message="the heartbeat"
    )
    result = run(app, "status", "--check")
    assert (result.exit_code, result.stdout.strip()) == (
        EXIT_OK,
        "OK: 2 companions alive, nothing overdue",
    )
