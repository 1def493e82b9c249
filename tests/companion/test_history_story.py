"""Did it fire, when, and who cancelled it? A task's history with a real companion and worker.

Issue 36's story, against real Redis, a real ``celery zdelay`` companion and
a real worker: a task parked while its queue is paused is held (reason
pause), then released by that companion when resumed (how late, on the
Redis clock), and runs; a task cancelled by tag says who; one replaced by
key says replaced; one the handoff cannot deliver is dead-lettered with
why, requeued, and released. The companion's sweep deletes histories once
``zdelay_history_seconds`` passed after their last event; with 0 nothing is
recorded.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import timedelta

import pytest
import redis
from celery import Celery

import celery_zdelay
from celery_zdelay import periodic
from tests.conftest import AppFactory
from tests.helpers import CeleryProcess, Runs, wait_for

pytestmark = pytest.mark.timeout(180)

QUEUES = [{"name": "celery"}, {"name": "emails"}, {"name": "orders"}]


def _events(app: Celery, task_id: str) -> list[str]:
    return [event.event for event in celery_zdelay.history(task_id, app=app)]


def _companion_id(process: CeleryProcess) -> str:
    found = re.search(r"companion (\S+) started: ", process.log())
    assert found, process.log()[-2000:]
    return found.group(1)


def test_paused_held_resumed_released_by_the_companion_then_run(
    make_test_app: AppFactory,
    runs: Runs,
    companion: Callable[..., CeleryProcess],
    worker: Callable[..., CeleryProcess],
) -> None:
    # Given the emails queue paused, a companion and a worker running
    app = make_test_app(queues=QUEUES)
    celery_zdelay.pause("queue:emails", app=app, by="ops")
    comp = companion(app)
    worker(app, "celery", "emails", "orders")
    record = app.tasks["tests.record"]

    # When an email falls due behind the pause, then the queue is resumed
    email = record.apply_delayed(("welcome",), countdown=1, queue="emails")
    wait_for(
        lambda: _events(app, email.id) == ["parked", "held"],
        timeout=30,
        message=lambda: f"parked then held, got {_events(app, email.id)}",
    )
    celery_zdelay.resume("queue:emails", app=app)
    runs.wait_for_ids({email.id})

    # Then its history says parked, held by the pause, released by the companion
    parked, held, released = celery_zdelay.history(email.id, app=app)
    assert (parked.event, parked.call) == ("parked", "plain")
    assert (held.event, held.reason, held.by) == ("held", "pause", "queue:emails")
    assert released.event == "released"
    assert released.by == _companion_id(comp)
    assert released.late_ms is not None
    assert released.late_ms >= 0
    assert parked.due is not None
    # Not early, and as late as it says (the Redis clock, to the ms)
    assert released.at >= parked.due
    assert abs((released.at - parked.due) - timedelta(milliseconds=released.late_ms)) <= timedelta(
        milliseconds=2
    )
    assert parked.at <= held.at <= released.at


def test_cancelled_by_tag_by_alice_replaced_by_key_and_dead_lettered_then_requeued(
    make_test_app: AppFactory,
    redis_client: redis.Redis,
    runs: Runs,
    companion: Callable[..., CeleryProcess],
    worker: Callable[..., CeleryProcess],
) -> None:
    app = make_test_app(queues=QUEUES)
    comp = companion(app)
    worker(app, "celery", "emails", "orders")
    record = app.tasks["tests.record"]

    # Cancelled by tag, by alice
    tagged = record.apply_delayed((1,), countdown=3600, tags=["order:42"])
    assert celery_zdelay.cancel_matching(tag="order:42", app=app, by="alice") == 1
    cancelled = celery_zdelay.history(tagged.id, app=app)[-1]
    assert (cancelled.event, cancelled.reason, cancelled.by) == ("cancelled", "tag", "alice")

    # Replaced by key: the first call's task is cancelled, "replaced"
    first = record.apply_delayed((2,), countdown=3600, key="user:7", on_key="replace")
    record.apply_delayed((3,), countdown=3600, key="user:7", on_key="replace")
    replaced = celery_zdelay.history(first.id, app=app)[-1]
    assert (replaced.event, replaced.reason) == ("cancelled", "replaced")

    # Dead-lettered by the handoff (its queue list key holds a string), with why
    redis_client.set("orders", "not a list")
    order = record.apply_delayed((4,), countdown=0, queue="orders")
    wait_for(lambda: _events(app, order.id) == ["parked", "dead"], timeout=30, message="dead")
    dead = celery_zdelay.history(order.id, app=app)[-1]
    assert dead.reason is not None
    assert "is a string key, not a list" in dead.reason

    # Requeued once fixed, then released by the companion and run
    redis_client.delete("orders")
    assert celery_zdelay.store.deadletters.requeue_dead(
        celery_zdelay.parking.store_for(app), [order.id]
    ) == [True]
    runs.wait_for_ids({order.id})
    wait_for(lambda: _events(app, order.id)[-1:] == ["released"], timeout=30, message="released")
    assert _events(app, order.id) == ["parked", "dead", "requeued", "released"]
    assert celery_zdelay.history(order.id, app=app)[-1].by == _companion_id(comp)


def test_the_companion_sweeps_a_history_once_its_time_is_over(
    make_test_app: AppFactory,
    redis_client: redis.Redis,
    runs: Runs,
    companion: Callable[..., CeleryProcess],
    worker: Callable[..., CeleryProcess],
) -> None:
    # Given histories kept 2 s, and a task released and run
    app = make_test_app(conf={"zdelay_history_seconds": 2}, queues=QUEUES)
    companion(app)
    worker(app, "celery")
    result = app.tasks["tests.record"].apply_delayed((1,), countdown=0)
    runs.wait_for_ids({result.id})
    wait_for(lambda: _events(app, result.id) == ["parked", "released"], timeout=30)
    store = celery_zdelay.parking.store_for(app)
    history_key = store.keys(store.shard_of(result.id)).history
    assert redis_client.hexists(history_key, result.id)

    # Then, its time over, the running companion deletes it (a sweep a second)
    wait_for(
        lambda: not redis_client.hexists(history_key, result.id),
        timeout=30,
        message="the companion's sweep deleting the expired history",
    )
    assert celery_zdelay.history(result.id, app=app) == []


def test_with_history_seconds_zero_a_released_task_leaves_no_history(
    make_test_app: AppFactory,
    redis_client: redis.Redis,
    runs: Runs,
    companion: Callable[..., CeleryProcess],
    worker: Callable[..., CeleryProcess],
) -> None:
    app = make_test_app(conf={"zdelay_history_seconds": 0}, queues=QUEUES)
    companion(app)
    worker(app, "celery")
    result = app.tasks["tests.record"].apply_delayed((1,), countdown=0)
    runs.wait_for_ids({result.id})

    assert celery_zdelay.history(result.id, app=app) == []
    store = celery_zdelay.parking.store_for(app)
    assert redis_client.exists(store.keys(store.shard_of(result.id)).history) == 0


def test_a_periodic_occurrence_is_parked_by_its_schedule_and_released(
    make_test_app: AppFactory,
    runs: Runs,
    companion: Callable[..., CeleryProcess],
    worker: Callable[..., CeleryProcess],
) -> None:
    app = make_test_app(queues=QUEUES)
    periodic.add("tick", app=app, task="tests.record", schedule=1)
    companion(app, "--beat")
    worker(app, "celery")

    def last_run() -> str | None:
        (tick,) = periodic.schedules(app)[1]
        return tick.last_run_id

    occurrence = wait_for(last_run, timeout=60, message="a released occurrence")
    wait_for(lambda: _events(app, occurrence)[-1:] == ["released"], timeout=30)
    parked = celery_zdelay.history(occurrence, app=app)[0]
    assert (parked.event, parked.call) == ("parked", "periodic")
