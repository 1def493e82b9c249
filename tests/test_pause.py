"""Pauses at release: paused work stays parked, survives restarts, and goes out on resume."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis
from celery import Celery
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import celery_zdelay
from celery_zdelay import periodic
from celery_zdelay.companion import Companion
from celery_zdelay.companion.gate import REFRESH_SECONDS
from celery_zdelay.companion.metrics import Metrics
from celery_zdelay.errors import ConfigurationError
from celery_zdelay.limits import UnknownControlWarning, controls
from tests.conftest import AppFactory
from tests.control_support import BrokerTap, as_released, largest_overtake_s
from tests.helpers import CeleryProcess, Runs, wait_for
from tests.support.clock import redis_ms
from tests.support.periodic import (
    occurrence_ms,
    server_for,
    start_beat_companion,
    tend,
    tick_counts,
    ticks_of,
)
from tests.support.store import held_sets

pytestmark = [pytest.mark.timeout(180), pytest.mark.timing]

QUEUES = [{"name": "celery"}, {"name": "emails"}]


def _app(make_test_app: AppFactory, **conf: Any) -> Celery:
    return make_test_app(conf={"zdelay_shards": 4, **conf}, queues=QUEUES)


def test_a_paused_queue_stays_parked_through_a_restart_and_goes_out_in_order_on_resume(
    make_test_app: AppFactory, redis_client: redis.Redis, companion: Any
) -> None:
    # Given two companions and the emails queue paused
    app = _app(make_test_app)
    record = app.tasks["tests.record"]
    since = celery_zdelay.pause("queue:emails", app=app)
    running: list[CeleryProcess] = [companion(app) for _ in range(2)]

    with BrokerTap(redis_client, "emails", "celery") as tap:
        # When 100 emails and 100 other tasks fall due
        instant = datetime.now(timezone.utc) + timedelta(seconds=0.5)
        emails = [
            record.apply_delayed((i,), eta=instant + timedelta(milliseconds=i), queue="emails")
            for i in range(100)
        ]
        others = [record.apply_delayed((i,), eta=instant) for i in range(100)]

        # Then the others go out and the emails wait, parked in Redis
        tap.wait_for("celery", 100, timeout=30)
        time.sleep(1.0)
        assert tap.of("emails") == []
        (info,) = controls(app=app)
        assert (info.name, info.paused_since_ms, info.waiting) == ("queue:emails", since, 100)

        # ...also after every companion was restarted
        for process in running:
            assert process.terminate() == 0
        companion(app)
        time.sleep(2.0)
        assert tap.of("emails") == []

        # When the queue is resumed
        assert celery_zdelay.resume("queue:emails", app=app) is True

        # Then every email goes out once, in due order (batch by batch: within one
        # batch, released in one go, the shards go one after another)
        released = tap.wait_for("emails", 100, timeout=30)
        time.sleep(0.3)
        released = tap.of("emails")
    due_ms = {r.id: round(instant.timestamp() * 1000) + i for i, r in enumerate(emails)}
    assert Counter(a.task_id for a in released) == Counter(list(due_ms))
    # (timed by when each was released, from its history: the tap's own
    # times are this process's, late and in bunches on a loaded machine)
    assert largest_overtake_s(as_released(app, released), due_ms) < 0.5
    assert Counter(a.task_id for a in tap.of("celery")) == Counter(r.id for r in others)
    assert controls(app=app) == []


def test_a_pause_reaches_every_companion_within_the_refresh_time(
    make_test_app: AppFactory, redis_client: redis.Redis, companion: Any
) -> None:
    # Given three companions releasing a steady stream of emails (one every
    # 50 ms, for 30 s: a loaded machine's pause still lands mid-stream; at one
    # every 10 ms all 600 were once out before it did)
    app = _app(make_test_app)
    record = app.tasks["tests.record"]
    for _ in range(3):
        companion(app)
    start = datetime.now(timezone.utc) + timedelta(seconds=1)
    for i in range(600):
        record.apply_delayed((i,), eta=start + timedelta(milliseconds=50 * i), queue="emails")

    with BrokerTap(redis_client, "emails") as tap:
        tap.wait_for("emails", 20, timeout=30)

        # When the queue is paused
        celery_zdelay.pause("queue:emails", app=app)
        paused_at = time.monotonic()
        time.sleep(3 * REFRESH_SECONDS + 1.0)

        # Then no companion releases one more email after the refresh time
        # (plus a margin for a loaded machine)
        last = max(a.at for a in tap.of("emails"))
        count = len(tap.of("emails"))
        time.sleep(1.0)
        assert len(tap.of("emails")) == count
    assert last - paused_at < REFRESH_SECONDS + 1.0, last - paused_at
    assert count < 600
    # (held: those due since; the rest are not due yet)
    (info,) = controls(app=app)
    assert 0 < info.waiting <= 600 - count


def test_a_paused_task_name_holds_only_that_task(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given tests.add paused, and two tasks due on the same queue
    app = _app(make_test_app)
    celery_zdelay.pause("task:tests.add", app=app)
    add = app.tasks["tests.add"].apply_delayed((1, 2), countdown=0)
    recorded = app.tasks["tests.record"].apply_delayed((1,), countdown=0)

    # When a companion makes a pass
    with Companion(app) as comp:
        report = comp.release_due()

        # Then only the other task went out
        ids = [json.loads(raw)["headers"]["id"] for raw in redis_client.lrange("celery", 0, -1)]
        assert ids == [recorded.id]
        assert report.held == {"task:tests.add": 1}

        # And it goes out on resume
        celery_zdelay.resume("task:tests.add", app=app)
        comp.gate.refresh(comp.shards, force=True)
        comp.release_due()
    assert redis_client.llen("celery") == 2
    assert add.id in {
        json.loads(raw)["headers"]["id"] for raw in redis_client.lrange("celery", 0, -1)
    }


def test_on_resume_the_overdue_tasks_go_out_under_the_rate_limit(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given emails limited to 1/m with a burst of 3, paused, and 20 of them overdue
    app = _app(make_test_app, zdelay_rate_limits={"queue:emails": {"rate": "1/m", "burst": 3}})
    celery_zdelay.pause("queue:emails", app=app)
    for i in range(20):
        app.tasks["tests.record"].apply_delayed((i,), countdown=0, queue="emails")
    with Companion(app) as comp:
        comp.release_due()
        assert redis_client.llen("emails") == 0
        assert controls(app=app)[0].waiting == 20

        # When the queue is resumed and a companion makes two passes
        assert celery_zdelay.resume("queue:emails", app=app) is True
        comp.gate.refresh(comp.shards, force=True)
        comp.release_due()
        comp.release_due()

    # Then only the burst went out, and the rest wait for tokens, still parked
    assert redis_client.llen("emails") == 3
    (info,) = controls(app=app)
    assert (info.paused_since_ms, info.waiting) == (None, 17)


@pytest.mark.parametrize("last", ["task:tests.record", "queue:emails"])
def test_tasks_held_by_two_pauses_go_out_under_their_queues_limit_whichever_resumes_last(
    make_test_app: AppFactory, redis_client: redis.Redis, last: str
) -> None:
    # Given emails limited to 1/h (burst 1), both the queue and tests.record
    # paused, and three of its emails due (held by the task's pause)
    app = _app(make_test_app, zdelay_rate_limits={"queue:emails": {"rate": "1/h", "burst": 1}})
    both = ["queue:emails", "task:tests.record"]
    for name in both:
        celery_zdelay.pause(name, app=app)
    for i in range(3):
        app.tasks["tests.record"].apply_delayed((i,), countdown=0, queue="emails")
    with Companion(app) as comp:
        comp.release_due()
        assert redis_client.llen("emails") == 0

        # When one pause is resumed, a companion makes a pass, then the other
        for name in sorted(both, key=lambda n: n == last):
            celery_zdelay.resume(name, app=app)
            comp.gate.refresh(comp.shards, force=True)
            comp.release_due()

    # Then the queue's limit holds them as if they had never been paused: one
    # goes out (its burst), two wait for tokens
    assert redis_client.llen("emails") == 1
    assert {c.name: c.waiting for c in controls(app=app) if c.waiting} == {"queue:emails": 2}


def test_a_task_paused_and_limited_releases_what_its_pause_held_under_its_queues_limit(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given emails limited to 1/h (burst 1), tests.record limited to 1/h
    # (burst 5) and paused, and three of its emails due (held by the pause)
    limits = {
        "queue:emails": {"rate": "1/h", "burst": 1},
        "task:tests.record": {"rate": "1/h", "burst": 5},
    }
    app = _app(make_test_app, zdelay_rate_limits=limits)
    celery_zdelay.pause("task:tests.record", app=app)
    for i in range(3):
        app.tasks["tests.record"].apply_delayed((i,), countdown=0, queue="emails")
    with Companion(app) as comp:
        comp.release_due()
        assert redis_client.llen("emails") == 0

        # When the task is resumed and a companion makes a pass
        celery_zdelay.resume("task:tests.record", app=app)
        comp.gate.refresh(comp.shards, force=True)
        comp.release_due()

    # Then the queue's limit holds them too: one goes out, two wait
    assert redis_client.llen("emails") == 1


def test_a_held_entry_can_still_be_cancelled(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given an email held back by a pause
    app = _app(make_test_app)
    celery_zdelay.pause("queue:emails", app=app)
    held = app.tasks["tests.record"].apply_delayed((1,), countdown=0, queue="emails")
    with Companion(app) as comp:
        comp.release_due()
        assert controls(app=app)[0].waiting == 1

        # When it is cancelled, then resumed
        assert celery_zdelay.cancel(held.id, app=app) is True
        celery_zdelay.resume("queue:emails", app=app)
        comp.gate.refresh(comp.shards, force=True)
        comp.release_due()

    # Then it never goes out
    assert redis_client.llen("emails") == 0
    assert controls(app=app) == []


def test_pausing_an_unknown_task_is_a_warning_and_a_bad_name_an_error(app: Celery) -> None:
    with pytest.warns(UnknownControlWarning, match="knows no task 'tests.ad'"):
        celery_zdelay.pause("task:tests.ad", app=app)
    with pytest.raises(ConfigurationError, match="not a control name"):
        celery_zdelay.pause("emails", app=app)
    assert celery_zdelay.resume("task:tests.ad", app=app) is True
    assert celery_zdelay.resume("task:tests.ad", app=app) is False


def test_metrics_tell_held_by_a_pause_from_held_by_a_limit(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given emails paused, tests.add limited to 1/m, and both due
    app = _app(make_test_app)
    celery_zdelay.pause("queue:emails", app=app)
    celery_zdelay.set_rate_limit("task:tests.add", "1/m", app=app)
    for i in range(3):
        app.tasks["tests.record"].apply_delayed((i,), countdown=0, queue="emails")
        app.tasks["tests.add"].apply_delayed((i, i), countdown=0)

    # When a companion with metrics makes a pass
    with Companion(app) as comp:
        metrics = Metrics(comp.store).connect(comp)
        try:
            comp.release_due()
            text = generate_latest(metrics.registry).decode()
        finally:
            metrics.close()

    # Then the counter and the gauge name each control and why it holds
    samples = {
        (s.name, s.labels.get("control"), s.labels.get("reason")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("zdelay_held_total", "queue:emails", "pause")] == 3
    assert samples[("zdelay_held_total", "task:tests.add", "rate_limit")] == 3
    assert samples[("zdelay_held_tasks", "queue:emails", "pause")] == 3
    assert samples[("zdelay_held_tasks", "task:tests.add", "rate_limit")] == 2


@pytest.mark.parametrize("missed", ["once", "skip", "all"])
def test_a_paused_queue_holds_periodic_ticks_by_the_schedules_missed_policy(
    make_test_app: AppFactory,
    redis_client: redis.Redis,
    worker: Callable[..., CeleryProcess],
    processes: list[CeleryProcess],
    runs: Runs,
    missed: str,
) -> None:
    # Given a schedule ticking 4 times a second on the emails queue, served
    # by two companions, on 4 shards
    app = _app(make_test_app)
    worker(app, "emails")
    schedule = {
        "fast": {
            "task": "tests.record",
            "schedule": 0.25,
            "args": ["fast"],
            "options": {"queue": "emails"},
            "zdelay_missed": missed,
        }
    }
    processes += [start_beat_companion(app, schedule) for _ in range(2)]
    wait_for(lambda: len(ticks_of(runs.all(), "fast")) >= 3, timeout=60, message="3 ticks")

    # When the queue is paused for 6 s, then resumed
    celery_zdelay.pause("queue:emails", app=app)
    paused_ms = redis_ms(redis_client)
    wait_for(lambda: redis_ms(redis_client) > paused_ms + 6000, timeout=20, interval=0.1)
    assert celery_zdelay.resume("queue:emails", app=app) is True
    resumed_ms = redis_ms(redis_client)

    # Then the schedule goes on after the resume
    def ticks_after_resume() -> list[dict[str, Any]]:
        ticks = ticks_of(runs.all(), "fast")
        return [t for t in ticks if occurrence_ms(t["id"]) > resumed_ms + 1000]

    wait_for(lambda: len(ticks_after_resume()) >= 3, timeout=30, message="ticks after resume")
    # and of the ticks held back (due 2.5 s or more before the resume: held
    # long enough for any companion to have seen them), the policy decides:
    # one for the pause (once), none (skip), each (all)
    held_then_run = [
        t
        for t in ticks_of(runs.all(), "fast")
        if t["redis_ms"] >= resumed_ms and occurrence_ms(t["id"]) < resumed_ms - 2500
    ]
    print(f"zdelay_missed={missed!r}: {len(held_then_run)} held ticks ran after the resume")
    if missed == "all":
        assert len(held_then_run) >= 10
    else:
        assert len(held_then_run) == {"once": 1, "skip": 0}[missed]
        assert tick_counts(app, "fast")["missed"] >= 10
    assert runs.duplicates() == {}


def test_a_pause_longer_than_a_schedules_memory_of_its_ticks_is_still_one_gap(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given a schedule every 250 ms on the paused emails queue, whose pointer
    # remembers its ticks for 1.5 s only (an hour-long pause of a
    # schedule, in short)
    app = _app(make_test_app)
    celery_zdelay.pause("queue:emails", app=app)
    server = server_for(
        app,
        {"fast": {"task": "tests.record", "schedule": 0.25, "options": {"queue": "emails"}}},
    )
    server.periodic.remember_parked_ms = 1500
    server.reconcile()
    start = redis_ms(redis_client)

    # When a companion holds its ticks back and plans for 5 s
    planned_ms = start
    with Companion(app) as comp:
        comp.gate.refresh(comp.shards, force=True)

        def passes() -> bool:
            nonlocal planned_ms
            planned_ms = redis_ms(redis_client)
            tend(server)
            comp.release_due()
            return redis_ms(redis_client) > start + 5000

        wait_for(passes, timeout=30, interval=0.1)

    # Then of the ticks held back for over 2 s when the last plan ran, one
    # waits (zdelay_missed="once"), though the pointer forgot it long ago.
    # (Counted from the last plan, not from now: on a loaded machine the
    # ticks it rightly kept, under 1.5 s old then, may be 2 s old by now.)
    held = [
        i.decode()
        for shard in range(4)
        for key in held_sets(shard, "queue:emails")
        for i in redis_client.zrange(key, 0, -1)
    ]
    old = [t for t in held if occurrence_ms(t) < planned_ms - 2000]
    assert len(old) == 1, held
    assert tick_counts(app, "fast")["missed"] >= 4


def _held_ticks(redis_client: redis.Redis, prefix: str) -> set[str]:
    """Ids starting with *prefix* held back on the 4 shards for the emails queue."""
    held = set()
    for shard in range(4):
        for key in held_sets(shard, "queue:emails"):
            for raw in redis_client.zrange(key, 0, -1):
                if raw.decode().startswith(prefix):
                    held.add(raw.decode())
    return held


@pytest.mark.parametrize("change", ["pause", "change", "remove"])
def test_a_schedule_paused_changed_or_removed_takes_back_its_held_ticks(
    make_test_app: AppFactory, redis_client: redis.Redis, change: str
) -> None:
    # Given a schedule every 250 ms on the paused emails queue (each held tick
    # kept, zdelay_missed="all"), whose pointer remembers its ticks for 1.5 s,
    # and ticks held back for over 3 s
    app = _app(make_test_app)
    celery_zdelay.pause("queue:emails", app=app)
    entry = {"task": "tests.record", "schedule": 0.25, "options": {"queue": "emails"}}
    server = server_for(app, {"fast": {**entry, "zdelay_missed": "all"}})
    server.periodic.remember_parked_ms = 1500
    server.reconcile()
    start = redis_ms(redis_client)
    with Companion(app) as comp:
        comp.gate.refresh(comp.shards, force=True)

        def passes() -> bool:
            tend(server)
            comp.release_due()
            return redis_ms(redis_client) > start + 3500

        wait_for(passes, timeout=30, interval=0.1)
    held = _held_ticks(redis_client, "periodic:fast:v1:")
    remembered = {i for _, i in server.periodic.snapshot().pointers["fast"].parked}
    assert held - remembered
    assert held & remembered

    # When the schedule is paused, changed or removed
    if change == "pause":
        assert periodic.pause("fast", app=app)
    elif change == "change":
        periodic.add("fast", app=app, args=["new"], missed="all", **entry)
    else:
        assert periodic.remove("fast", app=app)

    # Then the ticks its pointer remembers are taken back when the call
    # returns, and those held for longer at the next pass of a companion:
    # none is left to run at the resume
    assert _held_ticks(redis_client, "periodic:fast:v1:") == held - remembered
    tend(server)
    assert _held_ticks(redis_client, "periodic:fast:v1:") == set()


def test_a_rate_limit_a_schedule_cannot_keep_up_with_holds_one_tick_per_gap(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given a schedule every 250 ms on the emails queue, limited to 1 a minute
    app = _app(make_test_app, zdelay_rate_limits={"queue:emails": {"rate": "1/m", "burst": 1}})
    server = server_for(
        app,
        {"fast": {"task": "tests.record", "schedule": 0.25, "options": {"queue": "emails"}}},
    )
    server.reconcile()
    start = redis_ms(redis_client)

    # When a companion releases and plans for 4 s
    with Companion(app) as comp:

        def passes() -> bool:
            tend(server)
            comp.release_due()
            return redis_ms(redis_client) > start + 4000

        wait_for(passes, timeout=30, interval=0.1)

    # Then one tick went out with the token, and of those held back for over
    # 2 s one waits for the next token (zdelay_missed="once"); the others were
    # withdrawn as missed
    assert redis_client.llen("emails") == 1
    held = [
        i.decode()
        for shard in range(4)
        for key in held_sets(shard, "queue:emails")
        for i in redis_client.zrange(key, 0, -1)
    ]
    old = [t for t in held if occurrence_ms(t) < redis_ms(redis_client) - 2000]
    assert len(old) == 1, held
    assert tick_counts(app, "fast")["missed"] >= 4
