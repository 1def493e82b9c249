"""Rate limits per limit key: a bucket per tenant, fair turns, exact, and nothing left behind.

Given ``zdelay_rate_limits = {"limit_key:tenant:*": ...}`` and tasks parked
with ``limit_key="tenant:<n>"``, every distinct key is held in a lane of its
own and released under a bucket of its own, for all companions at once; a
backlog drains in turns between keys; and a key that is done leaves no
Redis key behind once its bucket would be full again.
"""

from __future__ import annotations

import json
import time
import warnings
from collections import Counter
from typing import Any

import pytest
import redis
from celery import Celery
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from werkzeug.test import Client

import celery_zdelay
from celery_zdelay.companion import Companion
from celery_zdelay.companion.metrics import Metrics
from celery_zdelay.errors import ConfigurationError
from celery_zdelay.limits import controls
from celery_zdelay.rates import control_name
from celery_zdelay.store.headers import LIMIT_KEY_HEADER
from celery_zdelay.testing import RedisServer
from celery_zdelay.web import create_app
from tests.conftest import AppFactory
from tests.control_support import BrokerTap, as_released, most_in_any_window
from tests.helpers import wait_for
from tests.servers import LocalCluster
from tests.support.cli import run
from tests.support.keys import keys_of

pytestmark = pytest.mark.timeout(120)

SHARDS = 4
PER_TENANT = "limit_key:tenant:*"


def _app(make_test_app: AppFactory, limit: Any = None, **conf: Any) -> Celery:
    limits = {} if limit is None else {PER_TENANT: limit}
    return make_test_app(conf={"zdelay_shards": SHARDS, "zdelay_rate_limits": limits, **conf})


def _released(client: redis.Redis, queue: str = "celery") -> list[dict[str, Any]]:
    """The messages in a broker list, oldest push first (kombu pushes at the head)."""
    return [json.loads(raw) for raw in reversed(client.lrange(queue, 0, -1))]


def _scrape(metrics: Metrics) -> list[Any]:
    text = generate_latest(metrics.registry).decode()
    return [x for family in text_string_to_metric_families(text) for x in family.samples]


def _parked(client: redis.Redis) -> int:
    return sum(int(client.zcard(keys_of(s).due)) for s in range(SHARDS))


# -- the key at the boundary ------------------------------------------------------


def test_the_limit_key_travels_in_its_header_to_the_worker(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = _app(make_test_app, "100/s")
    record = app.tasks["tests.record"]
    one = record.apply_delayed((1,), countdown=0, limit_key="tenant:42")
    many = record.apply_delayed_many([(2,), (3,)], countdown=0, limit_key="tenant:7")
    with Companion(app) as comp:
        comp.release_due()
    headers = {
        m["headers"]["id"]: m["headers"].get(LIMIT_KEY_HEADER) for m in _released(redis_client)
    }
    assert headers == {one.id: "tenant:42", many[0].id: "tenant:7", many[1].id: "tenant:7"}


@pytest.mark.parametrize("bad", ["", "tenant\n42", 42, "t" * 201])
def test_a_bad_limit_key_is_refused_and_nothing_is_parked(
    make_test_app: AppFactory, redis_client: redis.Redis, bad: Any
) -> None:
    app = _app(make_test_app, "100/s")
    record = app.tasks["tests.record"]
    with pytest.raises(ConfigurationError, match=r"limit_key=.*[Nn]othing was"):
        record.apply_delayed((1,), countdown=60, limit_key=bad)
    with pytest.raises(ConfigurationError, match="limit_key="):
        record.apply_delayed_many([(1,), (2,)], countdown=60, limit_key=bad)
    assert _parked(redis_client) == 0


def test_transparent_mode_checks_a_limit_key_header_and_parks_and_sends_nothing_bad(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = _app(make_test_app, "100/s", zdelay_threshold=60)
    record = app.tasks["tests.record"]
    with pytest.raises(ConfigurationError, match="limit_key="):
        record.apply_async((1,), countdown=3600, headers={LIMIT_KEY_HEADER: "a\nb"})
    assert _parked(redis_client) == 0
    assert redis_client.llen("celery") == 0
    # A good one is parked as limit_key= parks it
    record.apply_async((2,), countdown=3600, headers={LIMIT_KEY_HEADER: "tenant:1"})
    assert _parked(redis_client) == 1


def test_a_limit_key_no_limit_matches_is_warned_once_and_released_all_the_same(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given per-tenant limits only
    app = _app(make_test_app, "100/s")
    record = app.tasks["tests.record"]

    # When tasks are parked under a key no glob matches, twice
    with pytest.warns(celery_zdelay.UnmatchedLimitKeyWarning, match="zdelay_rate_limits"):
        first = record.apply_delayed((1,), countdown=0, limit_key="partner-x:1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = record.apply_delayed((2,), countdown=0, limit_key="partner-x:2")

    # Then the second call of that pattern was not warned about, and both are released
    with Companion(app) as comp:
        comp.release_due()
    assert {m["headers"]["id"] for m in _released(redis_client)} == {first.id, second.id}


def test_a_per_key_control_name_is_accepted_and_spelled_out_when_wrong(app: Celery) -> None:
    assert control_name("limit_key:tenant:*") == "limit_key:tenant:*"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no UnknownControlWarning: keys are not declared
        celery_zdelay.set_rate_limit("limit_key:tenant:*", "5/s", app=app)
    with pytest.raises(ConfigurationError, match="limit_key:<glob>"):
        control_name("limit_key:")


# -- a lane and a bucket per key -----------------------------------------------------


def test_each_key_has_its_own_bucket_and_is_shown_held_by_its_key(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given one task per minute per tenant (burst 1), three tasks of each of
    # two tenants and two tasks without a limit key, all due
    app = _app(make_test_app, {"rate": "1/m", "burst": 1})
    record = app.tasks["tests.record"]
    ones = [record.apply_delayed((i,), countdown=0, limit_key="tenant:1") for i in range(3)]
    twos = [record.apply_delayed((i,), countdown=0, limit_key="tenant:2") for i in range(3)]
    free = [record.apply_delayed((i,), countdown=0) for i in range(2)]

    # When a companion makes a pass
    with Companion(app) as comp:
        metrics = Metrics(comp.store).connect(comp)
        try:
            report = comp.release_due()
            samples = _scrape(metrics)
        finally:
            metrics.close()

    # Then every keyed task met the gate (handoff.lua, which cannot read
    # headers, would have moved them all); each tenant got its own token,
    # the others went out; the held count under the glob
    assert comp.gate.by_task
    # (which of a tenant's three goes first is not asserted: parked in one
    # millisecond on two shards, two tasks have one score, and due order
    # across shards goes no finer than the millisecond)
    out = {m["headers"]["id"] for m in _released(redis_client)}
    assert {r.id for r in free} <= out
    assert len(out & {r.id for r in ones}) == 1
    assert len(out & {r.id for r in twos}) == 1
    assert len(out) == 4
    assert report.held == {PER_TENANT: 6}
    # And the held ones say by which key's limit
    (waiting, *_) = [r for r in ones if r.id not in out]
    held = celery_zdelay.lookup(waiting.id, app=app)
    assert held is not None
    assert (held.held_by, held.held_reason) == ("limit_key:tenant:1", "rate_limit")
    # And controls() counts them under the glob, the keys counted, not listed
    (info,) = controls(app=app)
    assert (info.name, info.waiting, info.held_keys) == (PER_TENANT, 4, 2)
    listing = run(app, "limit").output
    assert "4 waiting" in listing
    assert "over 2 keys" in listing
    assert "tenant:1" not in listing.replace(PER_TENANT, "")
    # And so do the gauge and the counter: one label value for the glob
    gauge = [x for x in samples if x.name == "zdelay_held_tasks"]
    assert [(x.labels["control"], x.labels["reason"], x.value) for x in gauge] == [
        (PER_TENANT, "rate_limit", 4)
    ]
    assert {x.labels["control"] for x in samples if x.name == "zdelay_held_total"} == {PER_TENANT}
    # And so does the dashboard's page of limits: one row for the glob
    page = Client(create_app(app)).get("/control").get_data(as_text=True)
    assert page.count('<tr data-name="limit_key:') == 1
    assert "4 held by the limit" in page
    assert "over 2 keys, a bucket each" in page


def test_each_key_has_its_own_bucket_on_a_redis_cluster_store(
    make_test_app: AppFactory,
    cluster: LocalCluster,
    broker_server: RedisServer,
    broker_client: redis.Redis,
) -> None:
    # Given a store on a 3-master cluster (each key's bucket in a slot of
    # its own), a separate broker, and 1/m per tenant
    app = make_test_app(
        broker=f"{broker_server.url}/0",
        conf={
            "zdelay_redis_url": cluster.url,
            "zdelay_shards": SHARDS,
            "zdelay_rate_limits": {PER_TENANT: {"rate": "1/m", "burst": 1}},
        },
    )
    record = app.tasks["tests.record"]
    for tenant in range(5):
        for i in range(2):
            record.apply_delayed((i,), countdown=0, limit_key=f"tenant:{tenant}")

    # When a companion makes a pass
    with Companion(app) as comp:
        comp.release_due()

    # Then one task per tenant went out, the other waits under the glob
    assert broker_client.llen("celery") == 5
    (info,) = controls(app=app)
    assert (info.name, info.waiting, info.held_keys) == (PER_TENANT, 5, 5)


def test_a_paused_glob_holds_every_key_it_matches_and_resume_releases_them(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = _app(make_test_app, "100/s")
    record = app.tasks["tests.record"]
    celery_zdelay.pause(PER_TENANT, app=app)
    held = [record.apply_delayed((i,), countdown=0, limit_key=f"tenant:{i}") for i in range(3)]
    with Companion(app) as comp:
        comp.release_due()
        assert redis_client.llen("celery") == 0
        found = celery_zdelay.lookup(held[0].id, app=app)
        assert found is not None
        assert found.held_reason == "pause"
        celery_zdelay.resume(PER_TENANT, app=app)
        comp.gate.refresh(comp.shards, force=True)
        comp.release_due()
    assert {m["headers"]["id"] for m in _released(redis_client)} == {r.id for r in held}


# -- fairness -------------------------------------------------------------------------


def test_a_key_with_90_percent_of_the_backlog_delays_the_others_by_one_turn_at_most(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given 10 tenants under a generous per-tenant limit (a bucket of 10,000
    # each: the bucket is not what spreads them), tenant 0 holding 900 of
    # the 999 due tasks, parked first, and batches of 100
    app = _app(make_test_app, {"rate": "10000/s", "burst": 10000}, zdelay_batch_size=100)
    record = app.tasks["tests.record"]
    key_of: dict[str, str] = {}
    record_many = record.apply_delayed_many
    for r in record_many([(i,) for i in range(900)], countdown=0, limit_key="tenant:0"):
        key_of[r.id] = "tenant:0"
    for tenant in range(1, 10):
        for r in record_many([(i,) for i in range(11)], countdown=0, limit_key=f"tenant:{tenant}"):
            key_of[r.id] = f"tenant:{tenant}"

    # When one companion pass releases the backlog
    with Companion(app) as comp:
        comp.release_due()
    order = [key_of[m["headers"]["id"]] for m in _released(redis_client)]
    assert Counter(order) == Counter(key_of.values())

    # Then turns of a share each (100 / 10 keys = 10): the k-th task of a
    # small tenant waited for at most one share of tenant 0 per turn it
    # needed, however large tenant 0's backlog
    share = 10
    for tenant in range(1, 10):
        big_before, seen = 0, 0
        for key in order:
            if key == "tenant:0":
                big_before += 1
            elif key == f"tenant:{tenant}":
                assert big_before <= (seen // share + 1) * share, (tenant, seen, big_before)
                seen += 1
    # (all small tenants were done within two turns: ~200 releases, not 999)
    last_small = max(i for i, key in enumerate(order) if key != "tenant:0")
    assert last_small < 2 * 100 + 10, last_small


# -- exactness with several companions ----------------------------------------------


@pytest.mark.timing
@pytest.mark.timeout(180)
def test_per_key_buckets_hold_across_three_companions(
    make_test_app: AppFactory, redis_client: redis.Redis, companion: Any
) -> None:
    # Given 3 companions and 10/s per tenant (burst 10)
    app = _app(make_test_app, "10/s")
    record = app.tasks["tests.record"]
    for _ in range(3):
        companion(app)
    rate, burst, each = 10, 10, 60

    with BrokerTap(redis_client, "celery") as tap:
        # When 3 tenants have 60 tasks each due at once
        key_of: dict[str, str] = {}
        for tenant in range(3):
            results = record.apply_delayed_many(
                [(i,) for i in range(each)], countdown=1.5, limit_key=f"tenant:{tenant}"
            )
            key_of.update((r.id, f"tenant:{tenant}") for r in results)
        tap.wait_for("celery", 3 * each, timeout=60)
        time.sleep(0.3)  # a duplicate would arrive right behind the last one
        arrivals = tap.of("celery")

    # Then every task arrives once (timed from here on by when each was
    # released, from its history: see as_released)
    assert Counter(a.task_id for a in arrivals) == Counter(list(key_of))
    arrivals = as_released(app, arrivals)
    for tenant in range(3):
        mine = [a for a in arrivals if key_of[a.task_id] == f"tenant:{tenant}"]
        # ...and no tenant ever got more than burst + rate x T in any T
        # (slack of 8, under a second's worth: a companion that took its
        # tokens may wait for the CPU before it releases them; a bucket shared
        # by the companions' or none would be off by 20 and more)
        for window in (1.0, 2.0, 3.0):
            assert most_in_any_window(mine, window) <= burst + rate * window + 8, (tenant, window)
        # ...and each drained at its own rate: a bucket of its own
        elapsed = mine[-1].at - mine[0].at
        assert elapsed >= (each - burst) / rate * 0.9, (tenant, elapsed)
    # And the tenants ran side by side, not one after another (a bucket
    # shared by all three takes (180 - 10) / 10 = 17 s: measured so)
    span = arrivals[-1].at - arrivals[0].at
    assert span < 12.0, span


# -- memory ---------------------------------------------------------------------------


def _per_key_keys(client: redis.Redis) -> list[str]:
    return sorted(k.decode() for k in client.scan_iter(match="*limit_key:*", count=1000))


def _lane_members(client: redis.Redis) -> int:
    return sum(
        1
        for shard in range(SHARDS)
        for name in client.smembers(f"{{zdelay:{shard}}}:lanes")
        if name.startswith(b"limit_key:")
    )


def _park_1000_keys_once_and_release(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> Celery:
    app = _app(make_test_app, "100/s", zdelay_batch_size=500)
    record = app.tasks["tests.record"]
    for tenant in range(1_000):
        record.apply_delayed((tenant,), countdown=0, limit_key=f"tenant:{tenant}")
    with Companion(app) as comp:
        wait_for(
            lambda: comp.release_due() is not None and redis_client.llen("celery") == 1_000,
            timeout=60,
            message="1,000 released",
        )
        comp.release_due()  # a pass that finds the lanes empty forgets them
    return app


@pytest.mark.timeout(180)
def test_a_thousand_keys_used_once_leave_only_buckets_that_expire_when_full(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given 1,000 tenants that each parked one task, all released
    _park_1000_keys_once_and_release(make_test_app, redis_client)

    # Then no held set and no lane of a key is left, only the buckets...
    assert _lane_members(redis_client) == 0
    left = _per_key_keys(redis_client)
    assert left, "the buckets exist while they refill"
    assert all(":bucket:limit_key:tenant:" in key for key in left), left[:5]
    # ...each expiring once it would be full again (100/s, burst 100: 1 s,
    # plus the bucket's minute of margin against a clock that jumps)
    # (Redis expires them by that TTL: nothing else runs here to extend it,
    # so waiting the 61 s out would test Redis, not this package.)
    ttls = [int(redis_client.pttl(key)) for key in left]
    assert all(0 < ttl <= 1_000 + 60_000 for ttl in ttls), (min(ttls), max(ttls))


# -- a per-key limit and a per-key concurrency on one glob ---------------------------


def test_a_key_under_both_a_rate_limit_and_a_concurrency_waits_for_each_once(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given tenants limited to 100/s each and to 1 running each (one glob, two controls)
    app = _app(
        make_test_app,
        {"rate": "100/s", "burst": 100},
        zdelay_concurrency={PER_TENANT: 1},
    )
    record = app.tasks["tests.record"]
    ones = [record.apply_delayed((i,), countdown=0, limit_key="tenant:1") for i in range(3)]
    two = record.apply_delayed((9,), countdown=0, limit_key="tenant:2")

    # When a companion makes two passes, no worker running (nothing finishes)
    with Companion(app) as comp:
        comp.release_due()
        comp.release_due()

    # Then each tenant has one task out: the rate limit let all through, the
    # slots only one per tenant
    out = {m["headers"]["id"] for m in _released(redis_client)}
    assert two.id in out
    assert len(out & {r.id for r in ones}) == 1
    assert len(out) == 2
    # And the two others wait for a slot (not for tokens, which they had),
    # counted under the glob, with their tenant's running one
    waiting = [r for r in ones if r.id not in out]
    for result in waiting:
        held = celery_zdelay.lookup(result.id, app=app)
        assert held is not None
        assert (held.held_by, held.held_reason) == (PER_TENANT, "concurrency")
    (info,) = controls(app=app)
    assert (info.name, info.waiting, info.concurrency, info.running) == (PER_TENANT, 2, 1, 2)
    # And their history says where each waited: in the key's lane for its
    # tokens, then for a slot, once each
    for result in waiting:
        events = celery_zdelay.history(result.id, app=app)
        assert [(e.event, e.reason, e.by) for e in events] == [
            ("parked", None, None),
            ("held", "rate_limit", "limit_key:tenant:1"),
            ("held", "concurrency", PER_TENANT),
        ]
