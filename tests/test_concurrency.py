"""Concurrency controls (``zdelay_concurrency``): at most N released and not finished, per control.

Issue 36. Companions take a slot before they publish; workers free it when
the run ends, however it ends; a slot no worker frees ends by itself
``zdelay_max_run_seconds`` after the release. Real Redis, real companions
and real workers; the tasks record when they start and end on the Redis
clock, so overlaps are measured where they happen.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

import celery_zdelay
from celery_zdelay.companion import Companion
from celery_zdelay.config import get_config
from celery_zdelay.errors import ConfigurationError
from celery_zdelay.limits import controls
from celery_zdelay.parking import store_for
from celery_zdelay.store.control import ControlStore, concurrency_lane, hold_reason, lane_control
from celery_zdelay.testing import RedisServer
from tests.conftest import AppFactory
from tests.helpers import CeleryProcess, Runs, wait_for
from tests.servers import LocalCluster
from tests.support.cli import run
from tests.support.clock import redis_ms

pytestmark = pytest.mark.timeout(180)

SLOW = "tests.slow_late"
END_BY = "tests.end_by"
TENANTS = "limit_key:tenant:*"


def _tenant(key: str) -> dict[str, Any]:
    # The limit key travels as the zdelay_limit_key header (the contract with
    # apply_delayed(..., limit_key=...)); Celery puts headers= there as one.
    return {"headers": {"zdelay_limit_key": key}}


def _live(app: Celery, slot: str) -> int:
    return ControlStore(store_for(app)).live_slots(slot)


def _slot_records(client: redis.Redis) -> list[bytes]:
    return sorted(client.scan_iter(match="{zdelay:slots:*"))


def _most_at_once(runs: list[dict[str, Any]]) -> int:
    """The most runs between their "started" and "finished" records at one instant."""
    events = []
    for one in runs:
        if one["result"] == "started":
            events.append((one["redis_ms"], 1))
        elif one["result"] == "finished":
            # At a tie, an end comes before a start: the slot was freed first.
            events.append((one["redis_ms"], -1))
    most = now = 0
    for _, change in sorted(events):
        now += change
        most = max(most, now)
    return most


def _release(app: Celery) -> int:
    # The app's own store (closed with the app): a Companion's own is left open.
    with Companion(app, store=store_for(app)) as companion:
        return companion.release_due().released


# -- exactness ------------------------------------------------------------------------


def test_three_companions_never_have_more_than_two_running_and_each_task_runs_once(
    make_test_app: AppFactory,
    worker: Callable[..., CeleryProcess],
    companion: Callable[..., CeleryProcess],
    runs: Runs,
    redis_client: redis.Redis,
) -> None:
    # Given task:tests.slow_late limited to 2 at once, 3 companions on 4
    # shards, and 3 workers (room for 3 at once without the control)
    app = make_test_app(
        conf={"zdelay_shards": 4, "zdelay_concurrency": {f"task:{SLOW}": 2}},
    )
    for _ in range(3):
        worker(app)
        companion(app)

    # When 12 tasks of 0.4 s fall due at once
    due_ms = redis_ms(redis_client) + 2_000
    parked = [app.tasks[SLOW].apply_delayed((0.4,), countdown=2.0) for _ in range(12)]
    ids = {r.id for r in parked}
    wait_for(
        lambda: Counter(r["result"] for r in runs.all())["finished"] >= 12,
        timeout=90,
        message=lambda: f"12 finished runs, have {runs.all()}",
    )

    # Then never more than 2 ran at once, and 2 did (the control was used, not idle)
    done = runs.all()
    assert _most_at_once(done) == 2
    # And every task ran exactly once, none before it was due
    starts = [r for r in done if r["result"] == "started"]
    assert Counter(r["id"] for r in starts) == Counter(ids)
    assert all(r["redis_ms"] >= due_ms for r in starts)
    # And nothing is left of the slots once all finished
    wait_for(lambda: _slot_records(redis_client) == [], timeout=10)


def test_two_companions_run_one_task_per_tenant_at_a_time_and_tenants_side_by_side(
    make_test_app: AppFactory,
    worker: Callable[..., CeleryProcess],
    companion: Callable[..., CeleryProcess],
    runs: Runs,
    redis_client: redis.Redis,
) -> None:
    # Given 1 at once per tenant, 2 companions on 4 shards and 3 workers
    app = make_test_app(conf={"zdelay_shards": 4, "zdelay_concurrency": {TENANTS: 1}})
    for _ in range(3):
        worker(app)
    for _ in range(2):
        companion(app)

    # When 5 tasks of 0.3 s of each of two tenants fall due at once
    due_ms = redis_ms(redis_client) + 2_000
    tenant_of = {}
    for key in ("tenant:a", "tenant:b"):
        for _ in range(5):
            result = app.tasks[SLOW].apply_delayed((0.3,), countdown=2.0, **_tenant(key))
            tenant_of[result.id] = key
    wait_for(
        lambda: Counter(r["result"] for r in runs.all())["finished"] >= 10,
        timeout=90,
        message=lambda: f"10 finished runs, have {runs.all()}",
    )

    # Then each tenant never had two running at once, and the two ran side by side
    done = runs.all()
    for key in ("tenant:a", "tenant:b"):
        assert _most_at_once([r for r in done if tenant_of[r["id"]] == key]) == 1
    assert _most_at_once(done) == 2
    # And every task ran exactly once, none before it was due
    starts = [r for r in done if r["result"] == "started"]
    assert Counter(r["id"] for r in starts) == Counter(list(tenant_of))
    assert all(r["redis_ms"] >= due_ms for r in starts)
    wait_for(lambda: _slot_records(redis_client) == [], timeout=10)


def test_a_worker_killed_with_sigkill_frees_its_slot_when_its_max_run_ends(
    make_test_app: AppFactory,
    worker: Callable[..., CeleryProcess],
    companion: Callable[..., CeleryProcess],
    runs: Runs,
    redis_client: redis.Redis,
) -> None:
    # Given 1 at once and a max run of 3 s (zdelay_max_run_seconds), and a
    # solo worker running the one task released
    max_run_s = 3.0
    app = make_test_app(
        conf={"zdelay_concurrency": {f"task:{SLOW}": 1}, "zdelay_max_run_seconds": max_run_s}
    )
    doomed = worker(app)
    companion(app)
    first = app.tasks[SLOW].apply_delayed((60,), countdown=0)
    wait_for(lambda: any(r["id"] == first.id for r in runs.all()), timeout=30)
    second = app.tasks[SLOW].apply_delayed((0.1,), countdown=0)
    wait_for(
        lambda: celery_zdelay.lookup(second.id, app=app).held_reason == "concurrency",
        timeout=10,
    )

    # When the worker is SIGKILLed (no run end is ever reported) and another starts
    doomed.kill()
    killed_ms = redis_ms(redis_client)
    worker(app)

    # Then the second task runs once the first one's slot ended: not before
    # the max run, and at most the max run plus the companion's look-up interval
    # (0.5 s) and a margin for this loaded machine after the first's start
    wait_for(lambda: any(r["id"] == second.id for r in runs.all()), timeout=30)
    started = {r["id"]: r["redis_ms"] for r in runs.all() if r["result"] == "started"}
    waited_ms = started[second.id] - started[first.id]
    assert max_run_s * 1000 - 500 <= waited_ms <= (max_run_s + 0.5 + 3.0) * 1000, waited_ms
    assert started[second.id] >= killed_ms
    # And once it finished, the slot record is gone
    wait_for(lambda: _slot_records(redis_client) == [], timeout=10)


# -- per limit key ----------------------------------------------------------------------


def test_each_limit_key_has_its_own_slots_and_what_waits_shows_as_held_by_concurrency(
    make_test_app: AppFactory,
    worker: Callable[..., CeleryProcess],
    runs: Runs,
    redis_client: redis.Redis,
) -> None:
    # Given 1 at once per tenant
    app = make_test_app(conf={"zdelay_concurrency": {TENANTS: 1}})
    record = app.tasks["tests.record"]
    a1 = record.apply_delayed(("a1",), countdown=0, **_tenant("tenant:a"))
    a2 = record.apply_delayed(("a2",), countdown=0, **_tenant("tenant:a"))
    b1 = record.apply_delayed(("b1",), countdown=0, **_tenant("tenant:b"))
    other = record.apply_delayed(("x",), countdown=0, **_tenant("customer:1"))

    # When a companion releases them (no worker yet: nothing finishes)
    assert _release(app) == 3

    # Then one of each tenant went, and the key no glob matches is not limited
    assert celery_zdelay.lookup(a1.id, app=app) is None
    assert celery_zdelay.lookup(b1.id, app=app) is None
    assert celery_zdelay.lookup(other.id, app=app) is None
    # And tenant a's second waits, shown as held by the control, for concurrency
    held = celery_zdelay.lookup(a2.id, app=app)
    assert (held.state.value, held.held_by, held.held_reason) == (
        "held",
        TENANTS,
        "concurrency",
    )
    # And the listing counts the running ones per control, over its keys
    (info,) = [c for c in controls(app=app) if c.name == TENANTS]
    assert (info.concurrency, info.running, info.running_keys, info.waiting) == (1, 2, 2, 1)
    assert info.as_json()["running"] == 2
    # And so does the CLI, and the listing marks the held task
    assert "concurrency 1 per key (2 running over 2 keys, setting)" in run(app, "limit").output
    assert f"held by {TENANTS} (concurrency)" in run(app, "list").output

    # When a worker runs what was released
    worker(app)
    runs.wait_for_ids({a1.id, b1.id, other.id})

    # Then tenant a's slot is free and its second task goes
    def released_a2() -> bool:
        _release(app)
        return celery_zdelay.lookup(a2.id, app=app) is None

    wait_for(released_a2, timeout=20, interval=0.2)
    runs.wait_for_ids({a2.id})
    # And no slot record of an idle key is left behind
    wait_for(lambda: _slot_records(redis_client) == [], timeout=10)


def test_a_held_entry_waits_only_for_the_slots_it_needs(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given tenant a's slot taken, and tenant b with 100 tasks behind tenant a's backlog
    app = make_test_app(conf={"zdelay_concurrency": {TENANTS: 1}})
    record = app.tasks["tests.record"]
    for i in range(5):
        record.apply_delayed((i,), countdown=0, **_tenant("tenant:a"))
    assert _release(app) == 1
    late_b = record.apply_delayed(("b",), countdown=0, **_tenant("tenant:b"))

    # When a companion passes again
    assert _release(app) == 1

    # Then tenant b's task went, past tenant a's four waiting ones
    assert celery_zdelay.lookup(late_b.id, app=app) is None
    assert _live(app, f"{TENANTS} tenant:a") == 1
    assert _live(app, f"{TENANTS} tenant:b") == 1


# -- every end of a run frees the slot -----------------------------------------------------


def _run_one(app: Celery, runs: Runs, how: str, seconds: float = 0) -> str:
    first = app.tasks[END_BY].apply_delayed((how, seconds), countdown=0)
    assert _release(app) == 1
    wait_for(lambda: any(r["result"] == "started" for r in runs.all()), timeout=30)
    return str(first.id)


@pytest.mark.parametrize("how", ["return", "fail", "ignore", "reject"])
def test_a_slot_is_free_once_its_run_ends_however_it_ends(
    make_test_app: AppFactory, worker: Callable[..., CeleryProcess], runs: Runs, how: str
) -> None:
    # Given a worker and the default max run of an hour
    app = make_test_app(conf={"zdelay_concurrency": {f"task:{END_BY}": 1}})
    worker(app)

    # When a released task returns, fails, raises Ignore or Reject(requeue=False)
    _run_one(app, runs, how)
    wait_for(lambda: any(r["result"] == how for r in runs.all()), timeout=30)

    # Then its slot is free at once
    wait_for(lambda: _live(app, f"task:{END_BY}") == 0, timeout=10)


def test_a_retry_keeps_the_slot_until_its_last_run_ends(
    make_test_app: AppFactory, worker: Callable[..., CeleryProcess], runs: Runs
) -> None:
    # Given a task whose first run retries with countdown=3 (through the broker)
    app = make_test_app(conf={"zdelay_concurrency": {"task:tests.retry_once": 1}})
    worker(app)
    app.tasks["tests.retry_once"].apply_delayed((3,), countdown=0)
    assert _release(app) == 1
    runs.wait_for_count(1, timeout=30)

    # Then while the retry waits, the slot stays taken, every time we look
    def retried() -> bool:
        if runs.count() >= 2:
            return True
        assert _live(app, "task:tests.retry_once") == 1, "the slot was freed while the retry waited"
        return False

    wait_for(retried, timeout=30, interval=0.05)
    # And it is free after the last run
    wait_for(lambda: _live(app, "task:tests.retry_once") == 0, timeout=10)


def test_revoke_with_terminate_frees_the_slot(
    make_test_app: AppFactory, worker: Callable[..., CeleryProcess], runs: Runs
) -> None:
    # Given a released task running in a prefork worker's pool process
    app = make_test_app(conf={"zdelay_concurrency": {f"task:{END_BY}": 1}})
    worker(app, pool="prefork")
    first = _run_one(app, runs, "return", 60)
    assert _live(app, f"task:{END_BY}") == 1

    # When it is revoked with terminate=True
    app.control.revoke(first, terminate=True)

    # Then its slot is free long before the hour of zdelay_max_run_seconds
    wait_for(lambda: _live(app, f"task:{END_BY}") == 0, timeout=20)


def test_a_pool_process_killed_mid_run_frees_the_slot_through_the_workers_main_process(
    make_test_app: AppFactory, worker: Callable[..., CeleryProcess], runs: Runs
) -> None:
    # Given a released task running in a prefork worker's pool process
    app = make_test_app(conf={"zdelay_concurrency": {f"task:{END_BY}": 1}})
    worker(app, pool="prefork")
    first = _run_one(app, runs, "return", 60)
    active = app.control.inspect(timeout=10).active() or {}
    (pid,) = [t["worker_pid"] for tasks in active.values() for t in tasks if t["id"] == first]

    # When that process is SIGKILLed (the main process lives on)
    os.kill(pid, signal.SIGKILL)

    # Then the main process reports the run lost and frees its slot
    wait_for(lambda: _live(app, f"task:{END_BY}") == 0, timeout=20)


# -- the handoff and the settings -----------------------------------------------------


def test_with_a_concurrency_control_every_entry_is_leased_for_the_gate(
    make_test_app: AppFactory,
) -> None:
    # Given a Redis broker (the atomic handoff) and a concurrency control of a queue
    app = make_test_app(conf={"zdelay_concurrency": {"queue:celery": 1}})
    record = app.tasks["tests.record"]
    record.apply_delayed((1,), countdown=0)
    record.apply_delayed((2,), countdown=0)

    # When a companion releases them
    with Companion(app) as companion:
        report = companion.release_due()
        # Then the handoff was not taken past the gate: one went, one is held
        assert (report.released, report.held) == (1, {"queue:celery": 1})
        assert companion.gate.by_task


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ({"task:proj.export": 0}, "at least 1"),
        ({"task:proj.export": -2}, "at least 1"),
        ({"task:proj.export": 1.5}, "whole number"),
        ({"task:proj.export": True}, "whole number"),
        ({"task:proj.export": "2"}, "whole number"),
        ({"proj.export": 1}, "not a control name"),
        ({"tenant:*": 1}, "not a control name"),
        ({"limit_key:": 1}, "not a control name"),
        (["task:proj.export"], "must be a dict"),
    ],
)
def test_a_bad_concurrency_setting_says_what_to_write(
    make_test_app: AppFactory, value: Any, says: str
) -> None:
    app = make_test_app(conf={"zdelay_concurrency": value})
    with pytest.raises(ConfigurationError, match=says):
        get_config(app)


def test_a_good_concurrency_setting_is_read() -> None:
    from celery_zdelay.concurrency import parse_concurrency, slots_of

    parsed = parse_concurrency({TENANTS: 2, "task:proj.export": 1, "queue:reports": 5})
    assert parsed == {TENANTS: 2, "task:proj.export": 1, "queue:reports": 5}
    assert slots_of(parsed, task="proj.export", queue="reports", limit_key="tenant:7") == [
        (f"{TENANTS} tenant:7", 2),
        ("queue:reports", 5),
        ("task:proj.export", 1),
    ]
    assert slots_of(parsed, task="proj.other", queue="celery", limit_key="user:7") == []


def test_slots_ended_by_time_are_free_and_a_record_goes_with_its_last_slot(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given two slots of a control of 2, taken for 300 ms
    control = ControlStore(store_for(app))
    assert control.take_slots("task:x", 2, ["a", "b", "c"], max_run_ms=300) == ["a", "b"]
    # A task that took one keeps it, and takes no second one
    assert control.take_slots("task:x", 2, ["a", "c"], max_run_ms=300) == ["a"]

    # When no worker frees them and their max run ends
    wait_for(lambda: control.live_slots("task:x") == 0, timeout=5)

    # Then they are free again, and the record expires once empty
    assert control.take_slots("task:x", 2, ["c"], max_run_ms=300) == ["c"]
    control.free_slots("task:x", ["c"])
    assert _slot_records(redis_client) == []
    control.take_slots("task:y", 1, ["d"], max_run_ms=200)
    wait_for(lambda: _slot_records(redis_client) == [], timeout=5)


def test_slots_limit_runs_on_a_redis_cluster_store(
    make_test_app: AppFactory, cluster: LocalCluster, broker_server: RedisServer
) -> None:
    # Given a store on a 3-master cluster (4 shards over its nodes, each slot
    # record on whichever node its hash tag is) and 1 at once per tenant
    app = make_test_app(
        broker=f"{broker_server.url}/0",
        conf={
            "zdelay_redis_url": cluster.url,
            "zdelay_shards": 4,
            "zdelay_concurrency": {TENANTS: 1},
        },
    )
    record = app.tasks["tests.record"]
    parked = {
        key: [record.apply_delayed((i,), countdown=0, **_tenant(key)) for i in range(3)]
        for key in ("tenant:a", "tenant:b", "tenant:c")
    }

    # When a companion releases what is due
    # Then one task per tenant goes, the others are held for concurrency
    assert _release(app) == 3
    control = ControlStore(store_for(app))
    assert control.running(TENANTS) == (3, 3, False)

    # And when tenant a's task ends (as its worker frees its slot), one more of a goes
    gone = [r for r in parked["tenant:a"] if celery_zdelay.lookup(r.id, app=app) is None]
    control.free_slots(f"{TENANTS} tenant:a", [gone[0].id])
    assert _release(app) == 1
    assert control.running(TENANTS) == (3, 3, False)
    waiting = [r for rs in parked.values() for r in rs if celery_zdelay.lookup(r.id, app=app)]
    assert len(waiting) == 5
    assert {celery_zdelay.lookup(r.id, app=app).held_reason for r in waiting} == {"concurrency"}


def test_a_concurrency_lane_names_its_control_and_its_reason() -> None:
    lane = concurrency_lane(f"{TENANTS} tenant:a b")
    assert lane_control(lane) == TENANTS
    assert lane_control(concurrency_lane("task:proj.export")) == "task:proj.export"
    assert hold_reason(lane, paused=set()) == "concurrency"
    # A paused control's lane holds by pause: nothing of it leaves then
    assert hold_reason(lane, paused={TENANTS}) == "pause"
    assert hold_reason("task:proj.export", paused=set()) == "rate_limit"
