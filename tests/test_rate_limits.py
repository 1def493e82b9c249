"""Global rate limits at release: one limit for all companions and shards, seen at the broker."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis
from celery import Celery
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import celery_zdelay
from celery_zdelay.companion import Companion
from celery_zdelay.companion.metrics import Metrics
from celery_zdelay.config import get_config
from celery_zdelay.errors import ConfigurationError
from celery_zdelay.limits import UnknownControlWarning, controls, rate_limits
from celery_zdelay.rates import parse_limit
from celery_zdelay.testing import RedisServer
from tests.conftest import AppFactory
from tests.control_support import (
    BrokerTap,
    as_released,
    largest_overtake_s,
    most_in_any_window,
)
from tests.helpers import CeleryProcess, wait_for
from tests.servers import LocalCluster
from tests.support.cli import run
from tests.support.clock import redis_ms
from tests.support.keys import keys_of

pytestmark = [pytest.mark.timeout(180), pytest.mark.timing]

#: How long a task may go out after one due after it, released by another
#: companion at the same moment (or from another shard of the same batch):
#: tens to hundreds of milliseconds, but a companion that waits for the CPU
#: between taking its entries and releasing them adds that wait. 1.009 s was
#: seen once in a make flake-hunt round, against a 1 s bound then; the span
#: of each test's release (3 s and 5 s) still fails an order not kept.
OVERTAKE_S = 2.0

QUEUES = [{"name": "celery"}, {"name": "emails"}]


def _app(make_test_app: AppFactory, **conf: Any) -> Celery:
    return make_test_app(conf={"zdelay_shards": 4, **conf}, queues=QUEUES)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_limit_holds_across_three_companions_and_four_shards_and_spares_other_queues(
    make_test_app: AppFactory, redis_client: redis.Redis, companion: Any
) -> None:
    # Given 3 companions on a 4-shard store, and a 50/s limit on the emails queue
    app = _app(make_test_app, zdelay_rate_limits={"queue:emails": "50/s"})
    record = app.tasks["tests.record"]
    for _ in range(3):
        companion(app)

    # (the tap runs before anything can be due: parking takes seconds on a
    # loaded machine, and a backlog taken at once would look like a burst)
    with BrokerTap(redis_client, "emails", "celery") as tap:
        # When 300 emails and 300 unlimited tasks fall due within 300 ms
        instant = datetime.now(timezone.utc) + timedelta(seconds=1.5)
        emails = [
            record.apply_delayed((i,), eta=instant + timedelta(milliseconds=i), queue="emails")
            for i in range(300)
        ]
        others = [record.apply_delayed((i,), eta=instant) for i in range(300)]
        parked_at = redis_ms(redis_client) / 1000
        due_ms = {r.id: round(instant.timestamp() * 1000) + i for i, r in enumerate(emails)}
        released = tap.wait_for("emails", 300, timeout=60)
        # The last emails can go out right after the last other task is
        # parked (the parks take seconds on a loaded machine, while the first
        # emails are due): those are then still on their way. The time bound
        # below says whether they were held back.
        tap.wait_for("celery", 300, timeout=30)
        time.sleep(0.3)  # a duplicate would arrive right behind the last one
        unlimited = tap.of("celery")
        released = tap.of("emails")

    # Then every email arrives once, none early...
    ids = [a.task_id for a in released]
    assert Counter(ids) == Counter(r.id for r in emails)
    assert all(a.redis_ms >= due_ms[a.task_id] for a in released)
    # ...at the limit: one burst of 50, then 50/s (timed by when each was
    # released, from its history: see as_released)
    released = as_released(app, released)
    unlimited = as_released(app, unlimited)
    elapsed = released[-1].at - released[0].at
    assert elapsed >= (300 - 50) / 50 * 0.9, elapsed
    after_burst = [a for a in released if a.at >= released[0].at + 1.0]
    rate = len(after_burst) / (released[-1].at - released[0].at - 1.0)
    assert rate >= 0.6 * 50, rate
    # ...never more than the burst plus T seconds' worth in any T (the slack
    # covers a companion that took its tokens, then had to wait for the CPU
    # before it released them). The promise is this bound, not a steady 50/s
    # after the first second: when the companions fall behind in it (the 600
    # parks compete with them), the bucket refills up to its burst and the
    # rest may go out faster.
    for window in (1.0, 2.0, 3.0):
        assert most_in_any_window(released, window) <= 50 + 50 * window + 25, window
    # ...in due order, but for entries in transit at the same moment in other
    # companions: none goes out more than a moment after one due after it
    # (OVERTAKE_S)
    assert largest_overtake_s(released, due_ms) < OVERTAKE_S
    # And the unlimited queue was not held back by the limited one (counted from
    # when the last of them was parked, if that was after they fell due: the
    # 600 parks can take seconds on a loaded machine)
    assert Counter(a.task_id for a in unlimited) == Counter(r.id for r in others)
    assert max(a.at for a in unlimited) - max(released[0].at, parked_at) < 3.0


def test_a_limit_holds_on_a_redis_cluster_store(
    make_test_app: AppFactory, cluster: LocalCluster, broker_server: RedisServer, companion: Any
) -> None:
    # Given a store on a 3-master cluster (4 shards over its nodes, the bucket
    # on whichever node its slot is), a separate broker, 3 companions, 40/s
    app = make_test_app(
        broker=f"{broker_server.url}/0",
        conf={
            "zdelay_redis_url": cluster.url,
            "zdelay_shards": 4,
            "zdelay_rate_limits": {"queue:emails": "40/s"},
        },
        queues=QUEUES,
    )
    record = app.tasks["tests.record"]
    for _ in range(3):
        companion(app)
    broker = broker_server.client(0)

    with BrokerTap(broker, "emails", "celery") as tap:
        # When 160 emails and 100 other tasks fall due within 160 ms
        instant = datetime.now(timezone.utc) + timedelta(seconds=1.5)
        emails = [
            record.apply_delayed((i,), eta=instant + timedelta(milliseconds=i), queue="emails")
            for i in range(160)
        ]
        others = [record.apply_delayed((i,), eta=instant) for i in range(100)]
        parked_at = redis_ms(broker) / 1000  # one host: the cluster's clock too
        due_ms = {r.id: round(instant.timestamp() * 1000) + i for i, r in enumerate(emails)}
        released = tap.wait_for("emails", 160, timeout=60)
        # The last emails can go out right after the last other task is
        # parked (the parks take seconds on a loaded machine, while the first
        # emails are due): those are then still on their way. The time bound
        # below says whether they were held back.
        tap.wait_for("celery", 100, timeout=30)
        time.sleep(0.3)
        released = tap.of("emails")
        unlimited = tap.of("celery")

    # Then the emails go out once each, none early (the broker's clock is the
    # store's: one host), at the limit, in due order but for entries in
    # transit at the same moment in other companions; the others at once
    assert Counter(a.task_id for a in released) == Counter(r.id for r in emails)
    assert all(a.redis_ms >= due_ms[a.task_id] for a in released)
    # (timed by when each was released, from its history: the tap's own times
    # are this process's, late and in bunches on a loaded machine; an
    # overtake of 1.55 s by the tap's times failed once under make flake-hunt)
    released = as_released(app, released)
    unlimited = as_released(app, unlimited)
    assert released[-1].at - released[0].at >= (160 - 40) / 40 * 0.9
    assert most_in_any_window(released, 1.0) <= 40 + 40 + 20
    assert largest_overtake_s(released, due_ms) < OVERTAKE_S
    assert Counter(a.task_id for a in unlimited) == Counter(r.id for r in others)
    assert max(a.at for a in unlimited) - max(released[0].at, parked_at) < 3.0


def test_a_companion_killed_while_throttled_loses_and_duplicates_nothing(
    make_test_app: AppFactory, redis_client: redis.Redis, companion: Any
) -> None:
    # Given 3 companions releasing 200 emails at 40/s, with short leases
    app = _app(make_test_app, zdelay_rate_limits={"queue:emails": "40/s"}, zdelay_lease_seconds=2)
    record = app.tasks["tests.record"]
    companions: list[CeleryProcess] = [companion(app) for _ in range(3)]
    with BrokerTap(redis_client, "emails") as tap:
        emails = [record.apply_delayed((i,), countdown=0.2, queue="emails") for i in range(200)]

        # When one of them is SIGKILLed in the middle of it
        tap.wait_for("emails", 80, timeout=60)
        companions[0].kill()

        # Then every email still arrives, exactly once, and still at the limit
        arrived = tap.wait_for("emails", 200, timeout=60)
        assert arrived[-1].at - arrived[0].at >= (200 - 40) / 40 * 0.9
        time.sleep(2.5)  # past a lease: what the dead one held comes back once
        ids = Counter(a.task_id for a in tap.of("emails"))
    assert ids == Counter(r.id for r in emails)


def test_a_limit_changed_at_run_time_applies_without_a_restart(
    make_test_app: AppFactory, redis_client: redis.Redis, companion: Any
) -> None:
    # Given a companion releasing under a limit of 5/s with a burst of 1
    app = _app(make_test_app)
    record = app.tasks["tests.record"]
    celery_zdelay.set_rate_limit("queue:emails", "5/s", burst=1, app=app)
    companion(app)
    with BrokerTap(redis_client, "emails") as tap:
        emails = [record.apply_delayed((i,), countdown=0, queue="emails") for i in range(60)]
        tap.wait_for("emails", 3, timeout=30)
        assert len(tap.of("emails")) < 30

        # When the limit is removed (no restart)
        removed_at = time.monotonic()
        assert celery_zdelay.set_rate_limit("queue:emails", None, app=app) is None

        # Then the rest go out at once, not at 5/s (that would take 10 s)
        arrived = tap.wait_for("emails", 60, timeout=30)
    assert arrived[-1].at - removed_at < 5.0
    assert Counter(a.task_id for a in arrived) == Counter(r.id for r in emails)
    assert rate_limits(app=app) == {}


def test_tasks_a_removed_task_limit_held_wait_for_their_queues_limit_set_since(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given tests.record limited to 1/h (burst 1) and three of its emails due:
    # one goes out, two are held by the task's limit
    app = _app(make_test_app)
    record = app.tasks["tests.record"]
    celery_zdelay.set_rate_limit("task:tests.record", "1/h", burst=1, app=app)
    for i in range(3):
        record.apply_delayed((i,), countdown=0, queue="emails")
    with Companion(app) as comp:
        comp.release_due()
        assert redis_client.llen("emails") == 1
        assert {c.name: c.waiting for c in controls(app=app)} == {"task:tests.record": 2}

        # When the emails queue is limited to 1/h (burst 1), the task's limit
        # removed, and a companion makes a pass
        celery_zdelay.set_rate_limit("queue:emails", "1/h", burst=1, app=app)
        celery_zdelay.set_rate_limit("task:tests.record", None, app=app)
        comp.gate.refresh(comp.shards, force=True)
        comp.release_due()

    # Then the queue's limit holds them, as any of its tasks: one goes out in
    # that pass (its burst), the other waits for a token
    assert redis_client.llen("emails") == 2
    assert {c.name: c.waiting for c in controls(app=app) if c.waiting} == {"queue:emails": 1}


def test_a_throttled_companion_sleeps_until_the_next_token(
    make_test_app: AppFactory, redis_client: redis.Redis, companion: Any
) -> None:
    # Given a companion holding 500 entries back under a limit of 2/s
    app = _app(make_test_app, zdelay_rate_limits={"queue:emails": "2/s"})
    record = app.tasks["tests.record"]
    for i in range(500):
        record.apply_delayed((i,), countdown=0, queue="emails")
    process = companion(app)
    wait_for(lambda: redis_client.llen("emails") >= 2, timeout=30)

    # When it waits for tokens for 3 s
    before, started = _cpu_seconds(process.pid), time.monotonic()
    time.sleep(3.0)
    used = _cpu_seconds(process.pid) - before
    wall = time.monotonic() - started

    # Then it used a small part of a core
    # (measured 1.3-1.7 %; waking without waiting for the token: 15 %)
    assert used / wall < 0.06, used / wall
    assert 2 <= redis_client.llen("emails") <= 2 + 2 * (wall + 5)


def test_with_nothing_configured_the_atomic_handoff_is_kept(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given no limit and no pause
    record = app.tasks["tests.record"]
    for i in range(20):
        record.apply_delayed((i,), countdown=0)

    # When a companion releases
    with Companion(app) as comp:
        report = comp.release_due()

    # Then every entry took the one-script handoff, none the lease-and-check path
    assert not comp.gate.active
    assert report.handed_off == 20
    assert report.published == 0


def test_with_a_limit_on_one_queue_the_others_keep_the_atomic_handoff(
    make_test_app: AppFactory, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a limit on emails only, and due tasks on both queues
    app = _app(make_test_app, zdelay_rate_limits={"queue:emails": "1/m"})
    record = app.tasks["tests.record"]
    for i in range(20):
        record.apply_delayed((i,), countdown=0)
        record.apply_delayed((i,), countdown=0, queue="emails")

    # When a companion releases
    with Companion(app) as comp:
        leased: list[int] = []
        claim = comp.store.claim
        monkeypatch.setattr(
            comp.store, "claim", lambda *a, **kw: leased.append(1) or claim(*a, **kw)
        )
        report = comp.release_due()

    # Then the unlimited queue went through handoff.lua, never the lease-all claim,
    # and only the emails were held
    assert leased == []
    assert redis_client.llen("celery") == 20
    assert redis_client.llen("emails") == 1
    assert report.held == {"queue:emails": 20}


def test_held_entries_stay_parked_in_redis_not_in_the_companion(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given a limit of 1/m with a burst of 1 and 30 due emails
    app = _app(make_test_app)
    celery_zdelay.set_rate_limit("queue:emails", "1/m", app=app)
    record = app.tasks["tests.record"]
    for i in range(30):
        record.apply_delayed((i,), countdown=0, queue="emails")

    # When a companion makes a pass
    with Companion(app) as comp:
        report = comp.release_due()

    # Then one went out, 29 wait in Redis, and nothing is leased
    assert redis_client.llen("emails") == 1
    assert report.held == {"queue:emails": 30}
    (info,) = controls(app=app)
    assert (info.name, info.waiting, info.limit and info.limit.text) == ("queue:emails", 29, "1/m")
    assert sum(redis_client.zcard(keys_of(s).lease) for s in range(4)) == 0


def _metric(samples: list[Any], name: str, **labels: str) -> float:
    """Return the sum of the samples of *name* whose labels include *labels*."""
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


def _scrape(metrics: Metrics) -> list[Any]:
    text = generate_latest(metrics.registry).decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def test_a_task_held_by_a_limit_counts_as_late_and_as_held_by_a_limit(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given a limit of 1/m (burst 1) on emails, and two emails due now
    app = _app(make_test_app, zdelay_rate_limits={"queue:emails": "1/m"})
    record = app.tasks["tests.record"]
    for i in range(2):
        record.apply_delayed((i,), countdown=0, queue="emails")

    with Companion(app) as comp:
        metrics = Metrics(comp.store).connect(comp)
        try:
            # When a pass releases one with the token and holds the other...
            comp.release_due()
            throttled = _scrape(metrics)
            # ...and the limit is lifted more than a second later
            lift_at = redis_ms(redis_client) + 1_100
            wait_for(lambda: redis_ms(redis_client) >= lift_at, timeout=10)
            celery_zdelay.set_rate_limit("queue:emails", None, app=app)
            comp.gate.refresh(comp.shards, force=True)
            comp.release_due()
            lifted = _scrape(metrics)
        finally:
            metrics.close()

    # Then while throttled, the gauge and the counter name the limit as the reason
    held = {"control": "queue:emails", "reason": "rate_limit"}
    assert _metric(throttled, "zdelay_held_tasks", **held) == 1
    assert _metric(throttled, "zdelay_held_total", **held) == 2
    # And once out, the held one counts as late by the time it waited (the
    # other went out at once): the lateness metrics show the throttling too
    assert redis_client.llen("emails") == 2
    assert _metric(lifted, "zdelay_release_lateness_seconds_count") == 2
    assert _metric(lifted, "zdelay_release_lateness_seconds_bucket", le="1.0") == 1
    assert _metric(lifted, "zdelay_release_lateness_seconds_sum") >= 1.1
    assert _metric(lifted, "zdelay_held_tasks", **held) == 0


# -- bad input ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "rate", "says"),
    [
        ("emails", "5/s", "not a control name"),
        ("queues:emails", "5/s", "not a control name"),
        ("queue:", "5/s", "not a control name"),
        ("queue:emails", "fast", "is not a rate"),
        ("queue:emails", "5/w", "is not a rate"),
        ("queue:emails", "0/s", "is not a rate"),
        ("queue:emails", "-3/m", "is not a rate"),
    ],
)
def test_a_bad_name_or_rate_is_refused_and_nothing_is_stored(
    app: Celery, name: str, rate: str, says: str
) -> None:
    with pytest.raises(ConfigurationError, match=says):
        celery_zdelay.set_rate_limit(name, rate, app=app)
    assert rate_limits(app=app) == {}


def test_a_limit_on_a_queue_the_app_does_not_know_is_a_warning(app: Celery) -> None:
    with pytest.warns(UnknownControlWarning, match="knows no queue 'emials'"):
        celery_zdelay.set_rate_limit("queue:emials", "5/s", app=app)
    assert set(rate_limits(app=app)) == {"queue:emials"}


def test_the_setting_is_validated_with_the_others(make_test_app: AppFactory) -> None:
    app = make_test_app(conf={"zdelay_rate_limits": {"queue:emails": "lots"}})
    with pytest.raises(ConfigurationError, match="zdelay_rate_limits"):
        get_config(app)


def test_the_burst_is_a_second_worth_unless_given() -> None:
    assert parse_limit("100/s").burst == 100
    assert parse_limit("10/m").burst == 1
    assert parse_limit("7").burst == 7
    assert parse_limit({"rate": "100/s", "burst": 500}).burst == 500
    assert parse_limit("100/s", burst=3).burst == 3
    with pytest.raises(ConfigurationError, match="burst"):
        parse_limit("100/s", burst=0)


# -- the CLI ------------------------------------------------------------------------


def test_the_cli_sets_lists_and_removes_limits(make_test_app: AppFactory) -> None:
    app = _app(make_test_app, zdelay_rate_limits={"task:tests.record": "10/m"})
    assert run(app, "limit", "queue:emails", "50/s", "--burst", "80").output == (
        "queue:emails: 50/s (burst 80)\n"
    )
    listing = run(app, "limit").output
    assert "queue:emails" in listing
    assert "limit 50/s (burst 80, runtime)" in listing
    assert "limit 10/m (burst 1, setting)" in listing
    document = json.loads(run(app, "limit", "--json").output)
    assert {d["name"]: d["rate"] for d in document} == {
        "queue:emails": "50/s",
        "task:tests.record": "10/m",
    }
    assert run(app, "limit", "task:tests.record", "off").exit_code == 0
    assert set(rate_limits(app=app)) == {"queue:emails"}
    bad = run(app, "limit", "queue:emails", "often")
    assert bad.exit_code == 78
    assert "is not a rate" in bad.output
