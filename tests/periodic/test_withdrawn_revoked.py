"""An occurrence its schedule took back ends REVOKED, as every cancel does (issue 33).

A change, a removal or a pause takes back what the schedule had parked,
and none of it runs. Each such occurrence ends ``REVOKED`` in the result
backend and is announced once (``tasks_cancelled``: ``task-revoked``, the
audit line), whether the change's own script took it from a due set or it
was held back by a queue's pause and taken from the cancel set. Before,
it stayed ``PENDING`` for ever. One released before the change runs, and
is neither.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery, states
from celery.result import AsyncResult

import celery_zdelay
from celery_zdelay import periodic, signals
from celery_zdelay.companion import Companion
from tests.support.periodic import parked_ids, server_for, tend

pytestmark = pytest.mark.timeout(60)


@contextlib.contextmanager
def _cancellations() -> Iterator[list[list[str]]]:
    heard: list[list[str]] = []

    def receiver(sender: Celery, task_ids: list[str], **_: Any) -> None:
        heard.append(sorted(task_ids))

    signals.tasks_cancelled.connect(receiver, weak=False)
    try:
        yield heard
    finally:
        signals.tasks_cancelled.disconnect(receiver)


def _parked_one(app: Celery, redis_client: redis.Redis) -> str:
    """Schedule "a" (every 10 min, added at run time) with its next occurrence parked."""
    assert periodic.add("a", app=app, task="tests.record", schedule=600.0)
    tend(server_for(app, {}))
    (task_id,) = parked_ids(redis_client, "a")
    return task_id


def _state(app: Celery, task_id: str) -> str:
    return str(AsyncResult(task_id, app=app).state)


@pytest.mark.parametrize("how", ["change", "pause", "remove"])
def test_an_occurrence_taken_back_by_its_schedule_ends_revoked(
    app: Celery, redis_client: redis.Redis, how: str
) -> None:
    # Breaks if: define.lua or pause.lua no longer names what it took from
    # a due set, or PeriodicStore reports it to no one.
    task_id = _parked_one(app, redis_client)

    with _cancellations() as heard:
        if how == "change":
            assert periodic.add("a", app=app, task="tests.record", schedule=300.0)
        elif how == "pause":
            assert periodic.pause("a", app=app)
        else:
            assert periodic.remove("a", app=app)

    assert parked_ids(redis_client, "a") == set()
    assert _state(app, task_id) == states.REVOKED
    assert heard == [[task_id]]


def test_an_occurrence_a_queue_pause_holds_ends_revoked_when_its_schedule_changes(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Breaks if: the held ones, cancelled from the cancel set, are not reported.
    task_id = _parked_one(app, redis_client)
    assert celery_zdelay.pause("queue:celery", app=app)
    with Companion(app) as companion:
        companion.release_due(advance_ms=601_000)  # due: held back by the pause
    assert parked_ids(redis_client, "a") == set()

    with _cancellations() as heard:
        assert periodic.add("a", app=app, task="tests.record", schedule=300.0)

    assert _state(app, task_id) == states.REVOKED
    assert heard == [[task_id]]
    assert celery_zdelay.resume("queue:celery", app=app)
    with Companion(app) as companion:
        assert companion.release_due().released == 0


def test_an_occurrence_released_before_the_change_is_not_revoked(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Breaks if: define.lua names what it did not take back.
    task_id = _parked_one(app, redis_client)
    with Companion(app) as companion:
        assert companion.release_due(advance_ms=601_000).released == 1

    with _cancellations() as heard:
        assert periodic.add("a", app=app, task="tests.record", schedule=300.0)

    assert heard == []
    assert _state(app, task_id) == states.PENDING
    assert redis_client.llen("celery") == 1
