"""The worker-side guard drops a second publish, runs a redelivery, and never loses a task.

Pins each line of the guard (``celery_zdelay/worker.py``) that mutation testing found
unguarded (see docs/mutation.rst), by calling the guard as a worker does
before a task starts (:func:`refuse_second_delivery`) and when it ends
(:func:`note_run_finished`), on a real task's request and a private Redis:
a first delivery runs and is remembered for a day; a second publish of the
same park is dropped; a redelivery by the broker runs unless a run already
finished; retries, other parks and unguarded tasks are left alone; a store
that cannot be reached lets the task run. The worker-level stories are in
test_dedupe.py.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import pytest
import redis
from celery import Celery
from celery.exceptions import Ignore

from celery_zdelay.store.headers import PARK_HEADER
from celery_zdelay.worker import SEEN_SECONDS, note_run_finished, refuse_second_delivery
from tests.conftest import AppFactory

pytestmark = pytest.mark.timeout(60)

PARK = "0f" * 16
DAY = 24 * 3600


def _request(
    park: str | None = PARK,
    *,
    redelivered: bool | None = False,
    retries: int | None = 0,
    in_headers: bool = False,
    is_eager: bool = False,
) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "id": "task-1",
        "retries": retries,
        "is_eager": is_eager,
        "delivery_info": None if redelivered is None else {"redelivered": redelivered},
        "headers": {PARK_HEADER: park} if in_headers and park else {},
    }
    if park and not in_headers:
        fields[PARK_HEADER] = park
    return fields


def _starts(app: Celery, **request: Any) -> str:
    """What the guard does as this delivery starts: "runs" or "dropped"."""
    task = app.tasks["tests.record"]
    task.push_request(**request)
    try:
        refuse_second_delivery(task)
        return "runs"
    except Ignore:
        return "dropped"
    finally:
        task.pop_request()


def _finishes(app: Celery, **request: Any) -> None:
    task = app.tasks["tests.record"]
    task.push_request(**request)
    try:
        note_run_finished(task)
    finally:
        task.pop_request()


def _record(retries: int = 0) -> str:
    return f"zdelay:seen:{PARK}:{retries}"


@pytest.fixture
def guarded(make_test_app: AppFactory) -> Celery:
    return make_test_app(conf={"zdelay_worker_dedupe": True})


def test_a_first_delivery_runs_and_is_remembered_for_a_day(
    guarded: Celery, redis_client: redis.Redis
) -> None:
    assert SEEN_SECONDS == DAY
    assert _starts(guarded, **_request()) == "runs"
    assert redis_client.get(_record()) == b"running"
    assert DAY - 60 <= redis_client.ttl(_record()) <= DAY


def test_a_second_publish_is_dropped_whether_or_not_the_first_run_finished(
    guarded: Celery, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    assert _starts(guarded, **_request()) == "runs"
    with caplog.at_level(logging.WARNING, "celery_zdelay.worker"):
        assert _starts(guarded, **_request()) == "dropped"
    assert "celery-zdelay published it twice" in caplog.text
    # A message without delivery_info is a publish, not a redelivery.
    assert _starts(guarded, **_request(redelivered=None)) == "dropped"
    _finishes(guarded, **_request())
    assert _starts(guarded, **_request()) == "dropped"


def test_a_redelivery_runs_until_a_run_has_finished(
    guarded: Celery, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    assert _starts(guarded, **_request()) == "runs"
    # The broker gave it back unacknowledged: the first run may have died.
    assert _starts(guarded, **_request(redelivered=True)) == "runs"
    assert _starts(guarded, **_request(redelivered=True)) == "runs"
    _finishes(guarded, **_request(redelivered=True))
    assert redis_client.get(_record()) == b"finished"
    # Finishing keeps the day the record is remembered for.
    assert DAY - 60 <= redis_client.ttl(_record()) <= DAY
    with caplog.at_level(logging.WARNING, "celery_zdelay.worker"):
        assert _starts(guarded, **_request(redelivered=True)) == "dropped"
    assert "a run of it already finished" in caplog.text


def test_a_redelivery_seen_first_runs(guarded: Celery, redis_client: redis.Redis) -> None:
    assert _starts(guarded, **_request(redelivered=True)) == "runs"
    assert redis_client.get(_record()) == b"running"


def test_each_retry_is_guarded_on_its_own(guarded: Celery, redis_client: redis.Redis) -> None:
    assert _starts(guarded, **_request(retries=0)) == "runs"
    _finishes(guarded, **_request(retries=0))
    assert _starts(guarded, **_request(retries=1)) == "runs"
    assert _starts(guarded, **_request(retries=2)) == "runs"
    assert _starts(guarded, **_request(retries=1)) == "dropped"
    assert redis_client.get(_record(1)) == b"running"
    assert redis_client.get(_record(0)) == b"finished"


def test_the_park_id_is_read_from_the_message_headers_too(
    guarded: Celery, redis_client: redis.Redis
) -> None:
    assert _starts(guarded, **_request(in_headers=True)) == "runs"
    assert _starts(guarded, **_request(in_headers=True)) == "dropped"
    assert _starts(guarded, **_request()) == "dropped"  # the same park either way


def test_another_park_of_the_same_task_id_runs(guarded: Celery) -> None:
    assert _starts(guarded, **_request()) == "runs"
    assert _starts(guarded, **_request(park="1e" * 16)) == "runs"


def test_tasks_the_guard_does_not_cover_run_and_leave_no_record(
    make_test_app: AppFactory, guarded: Celery, redis_client: redis.Redis
) -> None:
    unguarded = make_test_app(conf={"zdelay_worker_dedupe": False})
    for _ in range(2):
        assert _starts(guarded, **_request(park=None)) == "runs"  # not parked by zdelay
        assert _starts(guarded, **_request(is_eager=True)) == "runs"  # apply(), no broker
        assert _starts(unguarded, **_request()) == "runs"  # the guard is off
        _finishes(guarded, **_request(park=None))
        _finishes(guarded, **_request(is_eager=True))
        _finishes(unguarded, **_request())
    assert redis_client.keys("zdelay:seen:*") == []


def test_finishing_without_a_first_delivery_records_nothing(
    guarded: Celery, redis_client: redis.Redis
) -> None:
    _finishes(guarded, **_request())
    assert not redis_client.exists(_record())


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_store_that_cannot_be_reached_lets_the_task_run(
    make_test_app: AppFactory, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_test_app(
        conf={
            "zdelay_worker_dedupe": True,
            "zdelay_redis_url": f"redis://127.0.0.1:{_closed_port()}/0",
        }
    )
    with caplog.at_level(logging.WARNING, "celery_zdelay.worker"):
        assert _starts(app, **_request()) == "runs"
        assert _starts(app, **_request()) == "runs"
        _finishes(app, **_request())
    assert "Could not check tests.record[task-1] for a second delivery" in caplog.text
    assert "Could not record the end of tests.record[task-1]" in caplog.text
