"""Celery events for parked work: what Flower and event consumers see.

Given an app with Celery's ``task_send_sent_event``, a parked task is
announced as ``task-sent`` with its due time as ``eta`` (again with the new
one when rescheduled), a cancelled one as
``task-revoked``, a dead-lettered one as ``task-rejected``; nothing is
announced for a call that was not parked, nor without the setting; and a
broker that cannot take events delays and fails no park.
"""

from __future__ import annotations

import logging
import time
import uuid
from datetime import datetime
from typing import Any

import pytest
import redis
from celery import Celery
from kombu.exceptions import EncodeError

import celery_zdelay
from celery_zdelay import events, signals
from celery_zdelay.companion import Companion
from celery_zdelay.schedule import Due
from celery_zdelay.steering import reschedule_ids as _reschedule_ids
from tests.conftest import AppFactory
from tests.support.cli import run as run_cli
from tests.support.events import EventsSeen
from tests.support.keys import SHARD0

pytestmark = pytest.mark.timeout(60)

DUE, MSG = SHARD0.due, SHARD0.msg


@pytest.fixture
def evented(make_test_app: AppFactory) -> Celery:
    return make_test_app(conf={"task_send_sent_event": True})


def test_a_parked_task_is_sent_with_its_due_time_as_eta(evented: Celery) -> None:
    # Breaks if: announce_parked is not connected, or eta is not the due time.
    with EventsSeen(evented) as seen:
        result = evented.tasks["tests.record"].apply_delayed((1,), countdown=600)
        seen.wait_for(lambda: seen.of_type("task-sent"), what="task-sent")
    (sent,) = seen.of_type("task-sent")
    assert sent["uuid"] == result.id
    assert sent["name"] == "tests.record"
    assert sent["queue"] == "celery"
    found = celery_zdelay.lookup(result.id, app=evented)
    assert found is not None
    assert datetime.fromisoformat(sent["eta"]) == found.due


def test_bulk_batch_and_canvas_parks_are_each_announced(evented: Celery) -> None:
    record = evented.tasks["tests.record"]
    with EventsSeen(evented) as seen:
        many = record.apply_delayed_many([(n,) for n in range(5)], countdown=600)
        with celery_zdelay.batch(evented):
            batched = [record.apply_delayed((n,), countdown=600) for n in range(3)]
        chained = celery_zdelay.apply_delayed(record.s(1) | record.si(2), countdown=600)
        expected = {r.id for r in [*many, *batched]} | {chained.parent.id}
        seen.wait_for(
            lambda: {e["uuid"] for e in seen.of_type("task-sent")} >= expected, what="task-sent"
        )
    assert len(seen.of_type("task-sent")) == len(expected)


def test_a_call_that_was_not_parked_is_not_announced(evented: Celery) -> None:
    # Breaks if: the event is sent from the capture instead of after the park.
    record = evented.tasks["tests.record"]
    with EventsSeen(evented) as seen:
        with pytest.raises(EncodeError):
            record.apply_delayed((object(),), countdown=600, serializer="json")
        with pytest.raises(RuntimeError):
            _batch_that_fails(evented)
        seen.settle()
    assert seen.of_type("task-sent") == []


def _batch_that_fails(app: Celery) -> None:
    with celery_zdelay.batch(app):
        app.tasks["tests.record"].apply_delayed((1,), countdown=600)
        raise RuntimeError("the block fails: nothing is parked")


def test_a_cancelled_task_is_revoked(evented: Celery) -> None:
    parked = evented.tasks["tests.record"].apply_delayed((1,), countdown=600)
    with EventsSeen(evented) as seen:
        assert celery_zdelay.cancel(parked.id, app=evented) is True
        seen.wait_for(lambda: seen.of_type("task-revoked"), what="task-revoked")
    (revoked,) = seen.of_type("task-revoked")
    assert revoked["uuid"] == parked.id
    assert revoked["terminated"] is False


def test_a_task_replaced_by_key_is_revoked_once(evented: Celery) -> None:
    # Breaks if: a keyed replace takes a parked task out without announcing it.
    record = evented.tasks["tests.record"]
    first = record.apply_delayed((1,), countdown=600, key="k", on_key="debounce")
    with EventsSeen(evented) as seen:
        second = record.apply_delayed((2,), countdown=600, key="k", on_key="debounce")
        seen.wait_for(lambda: seen.of_type("task-sent"), what="task-sent")
        seen.wait_for(lambda: seen.of_type("task-revoked"), what="task-revoked")
        assert events.flush(evented)
        seen.wait_for(seen.marker_back, what="marker")
    (revoked,) = seen.of_type("task-revoked")
    assert revoked["uuid"] == first.id
    assert [e["uuid"] for e in seen.of_type("task-sent")] == [second.id]


def test_a_rescheduled_task_is_sent_again_with_its_new_eta(evented: Celery) -> None:
    # Breaks if: announce_rescheduled is not connected, or a reschedule path
    # (by id, by ids as the dashboard does, by filter) sends no signal.
    record = evented.tasks["tests.record"]
    by_id, by_ids = (record.apply_delayed((n,), countdown=600) for n in range(2))
    tagged = record.apply_delayed((3,), countdown=600, tags=["ev:1"])
    with EventsSeen(evented) as seen:
        assert celery_zdelay.reschedule(by_id.id, countdown=900, app=evented) is True
        assert _reschedule_ids([by_ids.id], Due("r", 1_200_000), app=evented) == [True]
        assert celery_zdelay.reschedule_matching(tag="ev:1", countdown=1500, app=evented) == 1
        moved = {by_id.id, by_ids.id, tagged.id}
        seen.wait_for(
            lambda: {e["uuid"] for e in seen.of_type("task-sent")} >= moved, what="task-sent"
        )
    sent = {e["uuid"]: e for e in seen.of_type("task-sent")}
    assert set(sent) == moved
    for task_id in moved:
        found = celery_zdelay.lookup(task_id, app=evented)
        assert found is not None
        assert datetime.fromisoformat(sent[task_id]["eta"]) == found.due
        assert sent[task_id]["zdelay"] == "rescheduled"


def test_receivers_hear_each_reschedule_with_who_moved_it(app: Celery) -> None:
    # Breaks if: a reschedule path drops by= or sends no tasks_rescheduled.
    record = app.tasks["tests.record"]
    first, second, third = (record.apply_delayed((n,), countdown=600) for n in range(3))
    heard: list[dict[str, Any]] = []

    def receiver(sender: Celery, task_ids: list[str], due_ms: list[int], by: Any, **_: Any) -> None:
        heard.append({"ids": list(task_ids), "due_ms": list(due_ms), "by": by})

    signals.tasks_rescheduled.connect(receiver, weak=False)
    try:
        celery_zdelay.reschedule(first.id, countdown=900, app=app, by="support:alice")
        assert run_cli(app, "reschedule", second.id, "--countdown", "900").exit_code == 0
        assert (
            run_cli(app, "reschedule", "--task", "tests.record", "--countdown", "1200").exit_code
            == 0
        )
        assert celery_zdelay.reschedule(str(uuid.uuid4()), countdown=900, app=app) is False
    finally:
        signals.tasks_rescheduled.disconnect(receiver)
    assert [h["ids"] for h in heard[:2]] == [[first.id], [second.id]]
    assert set(heard[2]["ids"]) == {first.id, second.id, third.id}
    assert heard[0]["by"] == "support:alice"
    assert all(h["by"].startswith("cli") for h in heard[1:])
    assert len(heard) == 3  # nothing for an id that was not parked
    found = celery_zdelay.lookup(third.id, app=app)
    assert found is not None
    assert heard[2]["due_ms"][heard[2]["ids"].index(third.id)] == found.due_ms


def test_a_dead_lettered_task_is_rejected_with_its_reason(
    evented: Celery, redis_client: redis.Redis
) -> None:
    good = evented.tasks["tests.record"].apply_delayed((1,), countdown=0)
    redis_client.hset(MSG, "forged", b"\x80 not ours at all")
    redis_client.zadd(DUE, {"forged": redis_client.zscore(DUE, good.id) or 0})
    with EventsSeen(evented) as seen:
        with Companion(evented) as companion:
            assert companion.release_due().dead_lettered == 1
        seen.wait_for(lambda: seen.of_type("task-rejected"), what="task-rejected")
    (rejected,) = seen.of_type("task-rejected")
    assert rejected["uuid"] == "forged"
    assert rejected["requeue"] is False
    assert rejected["reason"].startswith("foreign entry")


def test_nothing_is_announced_without_task_events(app: Celery) -> None:
    # Breaks if: a receiver ignores task_send_sent_event.
    assert not app.conf.task_send_sent_event
    with EventsSeen(app) as seen:
        parked = app.tasks["tests.record"].apply_delayed((1,), countdown=600)
        celery_zdelay.cancel(parked.id, app=app)
        seen.settle()
    assert seen.seen == [] or {e["type"] for e in seen.seen} == {"task-marker"}


def test_a_broker_that_cannot_take_events_delays_and_fails_no_park(
    make_test_app: AppFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # The store is up; the broker (where events go) answers nothing.
    app = make_test_app(
        broker="amqp://guest:guest@127.0.0.1:1//", conf={"task_send_sent_event": True}
    )
    record = app.tasks["tests.record"]
    record.apply_delayed((0,), countdown=600)  # the first park builds the store
    started = time.monotonic()
    parked = [record.apply_delayed((n,), countdown=600) for n in range(20)]
    elapsed = time.monotonic() - started

    assert all(celery_zdelay.lookup(r.id, app=app) is not None for r in parked)
    # Sending inline would wait on a connect per park (at least its retry
    # interval); handed to the thread, 20 parks take what parking takes.
    assert elapsed < 2.0
    with caplog.at_level(logging.WARNING, logger="celery_zdelay.events"):
        assert events.flush(app, timeout_s=30)
    assert "not sent" in caplog.text
