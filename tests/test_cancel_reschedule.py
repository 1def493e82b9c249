"""Cancel and reschedule parked tasks; parking an id again replaces it."""

from __future__ import annotations

import json

import pytest
import redis
from celery import Celery

import celery_zdelay
from celery_zdelay.companion import Companion
from tests.support.keys import SHARD0

pytestmark = pytest.mark.timeout(60)

DUE, MSG = SHARD0.due, SHARD0.msg


def _release(app: Celery) -> int:
    with Companion(app) as companion:
        return companion.release_due().released


def test_a_cancelled_task_is_never_released(app: Celery, redis_client: redis.Redis) -> None:
    result = app.tasks["tests.record"].apply_delayed((1,), countdown=0)

    assert celery_zdelay.cancel(result.id, app=app) is True
    assert celery_zdelay.cancel(result.id, app=app) is False
    assert _release(app) == 0
    assert redis_client.llen("celery") == 0
    assert redis_client.hlen(MSG) == 0


def test_cancelling_an_unknown_or_released_id_returns_false(app: Celery) -> None:
    assert celery_zdelay.cancel("no-such-id", app=app) is False
    result = app.tasks["tests.record"].apply_delayed((1,), countdown=0)
    assert _release(app) == 1
    assert celery_zdelay.cancel(result.id, app=app) is False


def test_rescheduling_moves_the_due_time_both_ways(app: Celery, redis_client: redis.Redis) -> None:
    record = app.tasks["tests.record"]
    soon = record.apply_delayed(("soon",), countdown=0)
    later = record.apply_delayed(("later",), countdown=3600)

    assert celery_zdelay.reschedule(soon.id, countdown=3600, app=app) is True
    assert celery_zdelay.reschedule(later.id, countdown=0, app=app) is True
    assert _release(app) == 1

    (raw,) = redis_client.lrange("celery", 0, -1)
    assert json.loads(raw)["headers"]["id"] == later.id
    assert redis_client.zrange(DUE, 0, -1) == [soon.id.encode()]


def test_rescheduling_an_unknown_id_returns_false(app: Celery) -> None:
    assert celery_zdelay.reschedule("no-such-id", countdown=5, app=app) is False


def test_parking_the_same_id_twice_keeps_one_entry_the_latest(
    app: Celery, redis_client: redis.Redis
) -> None:
    record = app.tasks["tests.record"]
    record.apply_delayed(("first",), task_id="order-42", countdown=3600)
    record.apply_delayed(("second",), task_id="order-42", countdown=0)

    assert redis_client.zcard(DUE) == 1
    assert _release(app) == 1
    (raw,) = redis_client.lrange("celery", 0, -1)
    assert json.loads(raw)["headers"]["argsrepr"] == "('second',)"
    assert redis_client.zcard(DUE) == 0


def test_send_delayed_parks_by_task_name(app: Celery, redis_client: redis.Redis) -> None:
    result = celery_zdelay.send_delayed(app, "some.remote.task", args=(1,), countdown=0)

    assert _release(app) == 1
    (raw,) = redis_client.lrange("celery", 0, -1)
    headers = json.loads(raw)["headers"]
    assert headers["task"] == "some.remote.task"
    assert headers["id"] == result.id


def test_a_batch_parks_everything_in_one_go_or_nothing(
    app: Celery, redis_client: redis.Redis
) -> None:
    record = app.tasks["tests.record"]
    with celery_zdelay.batch(app):
        results = [record.apply_delayed((i,), countdown=60) for i in range(100)]
        assert redis_client.zcard(DUE) == 0  # nothing until the block ends
    assert redis_client.zcard(DUE) == 100
    assert {m.decode() for m in redis_client.zrange(DUE, 0, -1)} == {r.id for r in results}

    def failing_block() -> None:
        with celery_zdelay.batch(app):
            record.apply_delayed(("lost",), countdown=60)
            raise RuntimeError("the block failed")

    with pytest.raises(RuntimeError):
        failing_block()
    assert redis_client.zcard(DUE) == 100


def test_under_task_always_eager_apply_delayed_runs_now(
    make_test_app, redis_client: redis.Redis
) -> None:
    app = make_test_app(conf={"task_always_eager": True})
    result = app.tasks["tests.add"].apply_delayed((2, 3), countdown=1800)

    assert result.get() == 5
    assert redis_client.zcard(DUE) == 0
