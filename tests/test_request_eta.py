"""A released task sees the ETA it would have seen without celery-zdelay.

Given a task parked with an ETA (by ``apply_delayed`` or by transparent
mode), when the companion releases it, then the message in the broker has
no ``eta`` (the worker runs it at once and holds nothing in its timer),
and yet the task's ``self.request.eta`` is the ETA Celery would have sent:
the very string of Celery's own header in transparent mode, the due time
for ``apply_delayed``. A ``retry()`` of a released task has its own ETA,
or none, never the released one's.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis
from celery import Celery, group

from celery_zdelay.companion import Companion
from tests.conftest import AppFactory
from tests.helpers import Runs, wait_for

pytestmark = pytest.mark.timeout(90)

HOUR_MS = 3_600_000
#: The broker's default queue, a list in the broker's Redis database.
QUEUE = "celery"
#: The header that carries the ETA of a parked message (celery_zdelay.store.headers),
#: spelt out: the wire contract, not whatever the module says today.
ETA_HEADER = "zdelay_eta"


@pytest.fixture
def app(make_test_app: AppFactory) -> Celery:
    return make_test_app(conf={"zdelay_threshold": 60})


def _release_within_the_hour(app: Celery) -> int:
    with Companion(app) as companion:
        report = companion.release_due(advance_ms=HOUR_MS + 60_000)
    assert not report.failed
    return report.released


def _queued_headers(client: redis.Redis) -> list[dict[str, Any]]:
    """Return the headers of the messages waiting in the broker's queue."""
    return [json.loads(raw)["headers"] for raw in client.lrange(QUEUE, 0, -1)]


def _instant(eta: str) -> datetime:
    return datetime.fromisoformat(eta)


def test_a_far_eta_parked_by_transparent_mode_reaches_the_task_as_celery_wrote_it(
    app: Celery, redis_client: redis.Redis, worker, runs: Runs
) -> None:
    # Given a task sent with an ETA an hour ahead, parked by transparent mode
    eta = datetime.now(timezone.utc) + timedelta(hours=1)
    result = app.send_task("tests.record", ("later",), eta=eta)

    # When the companion releases it
    assert _release_within_the_hour(app) == 1

    # Then the broker holds it without an ETA: no worker holds it in its timer
    (headers,) = _queued_headers(redis_client)
    assert headers["id"] == result.id
    assert headers["eta"] is None
    # And the task sees Celery's own eta header, character for character
    worker(app)
    assert result.get(timeout=30) == ["later"]
    (run,) = runs.all()
    assert run["eta"] == eta.isoformat()
    # And the header that carried it is not among the task's custom headers
    assert ETA_HEADER not in run["headers"]


def test_apply_delayed_gives_the_task_its_due_time_as_its_eta(
    make_test_app: AppFactory, redis_client: redis.Redis, worker, runs: Runs
) -> None:
    app = make_test_app()
    worker(app)
    eta = datetime(2100, 1, 1, 12, 30, 15, 250_000, tzinfo=timezone.utc)
    before = datetime.now(timezone.utc)

    # Given one call parked with eta= and one with countdown=
    at_eta = app.tasks["tests.record"].apply_delayed(("eta",), eta=eta)
    in_an_hour = app.tasks["tests.record"].apply_delayed(("countdown",), countdown=3600)
    after = datetime.now(timezone.utc)

    # When both are released
    with Companion(app) as companion:
        report = companion.release_due(advance_ms=int((eta - before).total_seconds() * 1000))
    assert report.released == 2

    # Then each task sees its due time as its ETA, in the app's time zone
    assert at_eta.get(timeout=30) == ["eta"]
    assert in_an_hour.get(timeout=30) == ["countdown"]
    by_id = runs.by_id()
    assert _instant(by_id[at_eta.id]["eta"]) == eta
    counted = _instant(by_id[in_an_hour.id]["eta"])
    hour = timedelta(hours=1)
    assert before + hour - timedelta(milliseconds=1) <= counted <= after + hour
    assert counted.utcoffset() == timedelta(0)


def test_every_header_task_of_a_delayed_chord_sees_its_eta(
    app: Celery, redis_client: redis.Redis, worker, runs: Runs
) -> None:
    # Celery's own t/integration test_group_or_task_countdown_delays_header,
    # with a delay transparent mode parks.
    add, tsum = app.tasks["tests.add"], app.tasks["tests.tsum"]
    before = datetime.now(timezone.utc)
    result = (group(add.s(1, 1), add.s(2, 2)) | tsum.s()).apply_async(countdown=3600)
    after = datetime.now(timezone.utc)

    assert _release_within_the_hour(app) == 2
    assert all(h["eta"] is None for h in _queued_headers(redis_client))
    worker(app)

    assert result.get(timeout=30) == 6
    header_runs = [run for run in runs.all() if run["task"] == "tests.add"]
    assert len(header_runs) == 2
    hour = timedelta(hours=1)
    for run in header_runs:
        assert run["eta"] is not None, "a header task of a delayed chord saw no ETA"
        assert before + hour <= _instant(run["eta"]) <= after + hour


def test_a_retry_of_a_released_task_has_its_own_eta_not_the_released_one(
    make_test_app: AppFactory, worker, runs: Runs
) -> None:
    app = make_test_app()
    worker(app)

    # Given a released task that retries at once (countdown=0: Celery sends
    # the retry without an ETA)
    result = app.tasks["tests.retry_once"].apply_delayed((0,), countdown=0)
    with Companion(app) as companion:
        wait_for(lambda: companion.release_due().released, message="the release")

    # Then the first run sees its ETA and the retry sees none, as without celery-zdelay
    assert result.get(timeout=30) == "retried"
    first, retry = runs.wait_for_count(2)
    assert (first["retries"], retry["retries"]) == (0, 1)
    assert first["eta"] is not None
    assert retry["eta"] is None, "the retry inherited the released run's ETA"
