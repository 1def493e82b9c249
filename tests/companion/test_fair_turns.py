"""A backlog that a pause or a queue's or task's limit held drains fairly between limit keys.

Issue 36: "When a backlog drains (after a pause, under a limit), releases
alternate fairly between keys", and one tenant holding 90 % of it delays
the others by one turn at most. Per-key limits (``limit_key:<glob>``) did
so already; a pause and a queue's or task's limit held every tenant in
one lane, drained in due order, so a tenant that parked first stood in
front of all the others. Now such a control holds each limit key in a
lane of its own under it (``store.control.fair_lane``) and the release
pass serves them in turns, from the control's one bucket.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
import redis
from celery import Celery

import celery_zdelay
from celery_zdelay.companion import Companion
from celery_zdelay.limits import controls
from celery_zdelay.store.control import fair_lane, lane_base, lane_control, pause_lane
from tests.conftest import AppFactory

pytestmark = pytest.mark.timeout(120)

SHARDS = 4
QUEUE = "queue:celery"
BATCH = 100
BIG, SMALL, TENANTS = 900, 11, 10


def _released(client: redis.Redis, queue: str = "celery") -> list[dict[str, Any]]:
    """The messages in a broker list, oldest push first (kombu pushes at the head)."""
    return [json.loads(raw) for raw in reversed(client.lrange(queue, 0, -1))]


def _app(make_test_app: AppFactory, **conf: Any) -> Celery:
    return make_test_app(conf={"zdelay_shards": SHARDS, "zdelay_batch_size": BATCH, **conf})


def _backlog(app: Celery) -> dict[str, str]:
    """Tenant 0 parks 900 tasks first, then nine tenants 11 each: id -> tenant."""
    record = app.tasks["tests.record"]
    key_of: dict[str, str] = {}
    for r in record.apply_delayed_many(
        [(i,) for i in range(BIG)], countdown=0, limit_key="tenant:0"
    ):
        key_of[r.id] = "tenant:0"
    for tenant in range(1, TENANTS):
        many = [(i,) for i in range(SMALL)]
        for r in record.apply_delayed_many(many, countdown=0, limit_key=f"tenant:{tenant}"):
            key_of[r.id] = f"tenant:{tenant}"
    return key_of


def _assert_turns(order: list[str], lanes: int = TENANTS) -> None:
    """Each small tenant's k-th task waited for at most one share of tenant 0 per turn.

    A turn gives each of *lanes* lanes a share of a batch: the first turn
    of a limit counts the queue's own lane too (empty here), so its shares
    are smaller by one lane's.
    """
    low, high = BATCH // lanes, BATCH // TENANTS
    for tenant in range(1, TENANTS):
        big_before, seen = 0, 0
        for key in order:
            if key == "tenant:0":
                big_before += 1
            elif key == f"tenant:{tenant}":
                assert big_before <= (seen // low + 1) * high, (tenant, seen, big_before)
                seen += 1
    # (every small tenant was done within two turns: ~200 releases, not 999)
    last_small = max(i for i, key in enumerate(order) if key != "tenant:0")
    assert last_small < 2 * BATCH + high, last_small


def test_lane_names_split_a_control_from_its_limit_key_and_nothing_else() -> None:
    # A control's lane and a pause's get a lane per limit key under them...
    assert fair_lane(QUEUE, "tenant 7") == "queue:celery tenant 7"
    assert fair_lane(pause_lane("task:proj.sms"), "t:1") == "pause|task:proj.sms t:1"
    assert lane_control("queue:celery tenant 7") == QUEUE
    assert lane_control("pause|task:proj.sms t:1") == "task:proj.sms"
    assert lane_base("pause|task:proj.sms t:1") == "pause|task:proj.sms"
    # ...and an entry without a limit key waits in the control's own lane
    assert fair_lane(QUEUE, None) == QUEUE
    # A key's own lane and a concurrency slot's are per key already: a space
    # in their key splits nothing
    assert fair_lane("limit_key:ten ant", "ten ant") == "limit_key:ten ant"
    assert lane_base("limit_key:ten ant") == "limit_key:ten ant"
    assert lane_control("limit_key:ten ant") == "limit_key:ten ant"
    slot_lane = "concurrency|limit_key:t:* t 1"
    assert fair_lane(slot_lane, "t 1") == slot_lane
    assert lane_base(slot_lane) == slot_lane
    assert lane_control(slot_lane) == "limit_key:t:*"


# (No limit is configured: the limit keys' warning says they limit nothing
# but their turns under a pause, which is what this test is about.)
@pytest.mark.filterwarnings("ignore::celery_zdelay.UnmatchedLimitKeyWarning")
def test_on_resume_a_paused_backlog_drains_in_turns_between_keys(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given a paused queue, tenant 0 holding 900 of its 999 due tasks
    app = _app(make_test_app)
    celery_zdelay.pause(QUEUE, app=app)
    key_of = _backlog(app)
    with Companion(app) as comp:
        comp.release_due()
        assert redis_client.llen("celery") == 0
        # (held by the pause, each tenant in a lane of its own, counted and
        # shown under the queue)
        some_small = next(i for i, k in key_of.items() if k == "tenant:3")
        found = celery_zdelay.lookup(some_small, app=app)
        assert found is not None
        assert (found.held_by, found.held_reason) == (QUEUE, "pause")
        held = celery_zdelay.history(some_small, app=app)[-1]
        assert (held.event, held.reason, held.by) == ("held", "pause", QUEUE)
        (info,) = controls(app=app)
        assert (info.name, info.waiting) == (QUEUE, len(key_of))

        # When the queue is resumed and one pass drains the backlog
        celery_zdelay.resume(QUEUE, app=app)
        comp.gate.refresh(comp.shards, force=True)
        comp.release_due()

    # Then every task went out once, and the small tenants were served in
    # turns beside tenant 0, not after it
    order = [key_of[m["headers"]["id"]] for m in _released(redis_client)]
    assert Counter(order) == Counter(key_of.values())
    _assert_turns(order)


def test_under_a_queue_limit_a_backlog_drains_in_turns_between_keys(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given a queue limit too generous to hold anyone back long (its bucket
    # is not what spreads the tenants) and the same backlog, all due
    app = _app(make_test_app, zdelay_rate_limits={QUEUE: {"rate": "10000/s", "burst": 10000}})
    key_of = _backlog(app)

    # When one pass releases it
    with Companion(app) as comp:
        comp.release_due()

    # Then the tenants were served in turns (the first one among 11 lanes:
    # the queue's own lane, for tasks without a limit key, takes its turn)
    order = [key_of[m["headers"]["id"]] for m in _released(redis_client)]
    assert Counter(order) == Counter(key_of.values())
    _assert_turns(order, lanes=TENANTS + 1)


def test_a_queue_limit_deals_its_one_bucket_out_a_token_per_key_in_turn(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given a queue limit of 1 an hour with a burst of 10: the bucket grants
    # 10 tasks now and nothing more for the length of the test; tenant 0
    # parks 50 tasks first, nine other tenants 5 each, and 5 tasks have no
    # limit key
    app = _app(make_test_app, zdelay_rate_limits={QUEUE: {"rate": "1/h", "burst": 10}})
    record = app.tasks["tests.record"]
    key_of = {
        r.id: "tenant:0"
        for r in record.apply_delayed_many(
            [(i,) for i in range(50)], countdown=0, limit_key="tenant:0"
        )
    }
    for tenant in range(1, TENANTS):
        many = [(i,) for i in range(5)]
        key_of.update(
            {
                r.id: f"tenant:{tenant}"
                for r in record.apply_delayed_many(many, countdown=0, limit_key=f"tenant:{tenant}")
            }
        )
    key_of.update(
        {r.id: "none" for r in record.apply_delayed_many([(i,) for i in range(5)], countdown=0)}
    )

    # When two passes run
    with Companion(app) as comp:
        first = comp.release_due()
        second = comp.release_due()

    # Then the limit held for all of them together: 10 went out, in the first
    # pass, the 10 tokens dealt out one per lane in turn (11 lanes: the ten
    # tenants' and the queue's own), never 10 to the tenant parked first
    out_ids = [m["headers"]["id"] for m in _released(redis_client)]
    out = [key_of[i] for i in out_ids]
    assert first.released == 10
    assert second.released == 0
    assert len(out) == 10
    assert max(Counter(out).values()) == 1, Counter(out)
    # And what waits is shown held by the queue's limit, not by a key
    (info,) = controls(app=app)
    assert (info.name, info.waiting) == (QUEUE, len(key_of) - 10)
    waiting = next(i for i, k in key_of.items() if k == "tenant:0" and i not in out_ids)
    found = celery_zdelay.lookup(waiting, app=app)
    assert found is not None
    assert (found.held_by, found.held_reason) == (QUEUE, "rate_limit")


def test_the_next_pass_starts_its_turns_at_the_next_key(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given a task limit whose bucket grants one task per pass (burst 1, then
    # one token put back by hand before each pass) and three tenants
    name = "task:tests.record"
    app = _app(make_test_app, zdelay_rate_limits={name: {"rate": "1/h", "burst": 1}})
    record = app.tasks["tests.record"]
    key_of: dict[str, str] = {}
    for tenant in range(3):
        many = [(i,) for i in range(4)]
        key_of.update(
            {
                r.id: f"t{tenant}"
                for r in record.apply_delayed_many(many, countdown=0, limit_key=f"t{tenant}")
            }
        )

    # When six passes each get one token
    with Companion(app) as comp:
        comp.release_due()
        bucket = comp.gate.limit_of(name)
        assert bucket is not None
        for _ in range(5):
            comp.gate.control.give_back(name, bucket, 1)
            comp.release_due()

    # Then the tenants took turns: each got two of the six
    out = [key_of[m["headers"]["id"]] for m in _released(redis_client)]
    assert Counter(out) == {"t0": 2, "t1": 2, "t2": 2}, out
