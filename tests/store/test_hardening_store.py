"""Hardening of the store's Lua scripts (issue 11, items 3 and 5): a command
that fails halfway through a script must not lose, strand or forge an
entry, and only the claim that leased an entry may settle it."""

from __future__ import annotations

import json

import pytest
import redis
from celery import Celery

from celery_zdelay.companion import Companion
from celery_zdelay.errors import StoreRefusedError
from celery_zdelay.parking import store_for
from celery_zdelay.store import Store
from celery_zdelay.store.admin import requeue_dead
from celery_zdelay.store.dead_reason import DeadReason
from celery_zdelay.store.redis_keys import lanes_key
from tests.conftest import AppFactory
from tests.support.deadletters import dead_reasons
from tests.support.keys import PREFIX, SHARD0

pytestmark = pytest.mark.timeout(90)

KEY = "k" * 32
DUE = SHARD0.due
MSG = SHARD0.msg
LEASE = SHARD0.lease
LEASED = SHARD0.leased
DEAD = SHARD0.dead
DEAD_MSG = SHARD0.dead_msg


def _queued_ids(client: redis.Redis, queue: str = "celery") -> list[str]:
    return [json.loads(raw)["headers"]["id"] for raw in client.lrange(queue, 0, -1)]


def _park_ten_and_one_for_a_string_key(app: Celery, client: redis.Redis) -> tuple[set[str], str]:
    # "orders" is a queue name whose kombu list key is, by accident, a string.
    client.set("orders", "not a list")
    record = app.tasks["tests.record"]
    good = {record.apply_delayed((i,), countdown=0).id for i in range(5)}
    bad = record.apply_delayed(("bad",), countdown=0, queue="orders").id
    good |= {record.apply_delayed((i,), countdown=0).id for i in range(5, 10)}
    return good, bad


@pytest.mark.parametrize("signed", [False, True], ids=["handoff", "verified-push"])
def test_a_queue_key_of_another_type_dead_letters_its_entry_and_releases_the_others(
    make_test_app: AppFactory, redis_client: redis.Redis, signed: bool
) -> None:
    # Given ten good entries and one whose queue list key holds a string
    # (LPUSH would fail with WRONGTYPE after the script had removed entries),
    app = make_test_app(conf={"zdelay_signing_key": KEY} if signed else {})
    good, bad = _park_ten_and_one_for_a_string_key(app, redis_client)

    # when a companion releases them,
    with Companion(app) as companion:
        report = companion.release_due()

    # then the ten are in their queue, the bad one is dead-lettered with the
    # reason, nothing is left parked, leased or orphaned, and the key is untouched.
    assert set(_queued_ids(redis_client)) == good
    assert report.handed_off == 10
    assert report.dead_lettered == 1
    reasons = dead_reasons(redis_client)
    assert set(reasons) == {bad}
    assert "queue list orders is a string key, not a list" in reasons[bad]
    assert redis_client.zcard(DUE) == 0
    assert redis_client.zcard(LEASE) == 0
    assert redis_client.hlen(LEASED) == 0
    assert redis_client.hlen(MSG) == 0
    assert redis_client.get("orders") == b"not a list"

    # and once the key is fixed, a requeue releases the entry normally.
    redis_client.delete("orders")
    assert requeue_dead(store_for(app), [bad]) == [True]
    with Companion(app) as companion:
        companion.release_due()
    assert _queued_ids(redis_client, "orders") == [bad]


def test_a_shard_key_of_another_type_fails_the_claim_before_anything_moves(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given parked entries and a leased hash that something else made a string,
    app = make_test_app()
    record = app.tasks["tests.record"]
    ids = {record.apply_delayed((i,), countdown=0).id for i in range(5)}
    redis_client.set(LEASED, "foreign")
    store = store_for(app)

    # when a claim runs, it refuses with a message saying what to do,
    with pytest.raises(StoreRefusedError, match=r"holds a string, not a hash"):
        store.claim(0, limit=10, lease_ms=60_000)

    # and every entry is still parked with its payload: nothing stranded.
    assert {m.decode() for m in redis_client.zrange(DUE, 0, -1)} == ids
    assert redis_client.hlen(MSG) == 5
    assert redis_client.zcard(LEASE) == 0

    # Once the key is removed, the same entries are released.
    redis_client.delete(LEASED)
    with Companion(app) as companion:
        assert companion.release_due().handed_off == 5
    assert set(_queued_ids(redis_client)) == ids


def test_a_corrupt_delivery_tag_counter_fails_the_handoff_before_anything_moves(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = make_test_app()
    ids = {app.tasks["tests.record"].apply_delayed((i,), countdown=0).id for i in range(3)}
    redis_client.set(SHARD0.tags, "not a number")
    with Companion(app) as companion, pytest.raises(StoreRefusedError, match="not a count"):
        companion.release_due()
    assert {m.decode() for m in redis_client.zrange(DUE, 0, -1)} == ids
    assert redis_client.llen("celery") == 0


def test_an_unreadable_lease_record_is_recovered_due_now_not_stranded(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given an entry whose lease expired and whose leased record is garbage,
    app = make_test_app()
    task_id = app.tasks["tests.record"].apply_delayed((1,), countdown=0).id
    store = store_for(app)
    claimed = store.claim(0, limit=10, lease_ms=1)
    assert [e.task_id for e in claimed.entries] == [task_id]
    redis_client.hset(LEASED, task_id, "garbage")

    # when a companion recovers expired leases and releases,
    with Companion(app) as companion:
        report = companion.release_due()

    # then the entry is released once, not stuck between due and lease.
    assert report.released == 1
    assert _queued_ids(redis_client) == [task_id]
    assert redis_client.zcard(LEASE) == 0
    assert redis_client.zcard(DUE) == 0


def test_requeue_refuses_an_id_parked_again_and_in_flight_so_neither_message_is_lost(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given an id that was dead-lettered, then parked again and now leased
    # (claimed by a companion, being published),
    app = make_test_app(broker="memory://")
    store = store_for(app)
    record = app.tasks["tests.record"]
    task_id = record.apply_delayed(("first",), countdown=0).id
    first = store.claim(0, limit=10, lease_ms=60_000)
    store.dead_letter(0, first.token, [(task_id, DeadReason("test", due_ms=0, companion="test"))])
    record.apply_delayed(("second",), countdown=0, task_id=task_id)
    in_flight = store.claim(0, limit=10, lease_ms=60_000)
    assert [e.task_id for e in in_flight.entries] == [task_id]
    second_payload = in_flight.entries[0].payload

    # when an operator requeues the dead-lettered id,
    flags = requeue_dead(store, [task_id])

    # then the requeue is refused (the dead letter stays for later), the
    # in-flight payload is untouched, and the in-flight release completes.
    assert flags == [False]
    assert redis_client.hget(MSG, task_id) == second_payload
    assert redis_client.zscore(DEAD, task_id) is not None
    assert store.ack(0, in_flight.token, [task_id]) == 1
    # After that release the requeue goes through: both messages are released.
    assert requeue_dead(store, [task_id]) == [True]
    assert redis_client.zscore(DUE, task_id) is not None


def test_each_claim_has_its_own_token_so_an_old_claim_cannot_ack_a_new_one(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given an id claimed, parked again and claimed again within one
    # transaction (the same millisecond, on a fast Redis),
    app = make_test_app(broker="memory://")
    store: Store = store_for(app)
    record = app.tasks["tests.record"]
    task_id = record.apply_delayed(("first",), countdown=0).id
    keys = store.keys(0)
    with redis_client.pipeline(transaction=True) as pipe:
        store.scripts.claim(
            keys=[keys.due, keys.msg, keys.lease, keys.leased, keys.tags],
            args=[60_000, 10, 0],
            client=pipe,
        )
        pipe.zadd(keys.due, {task_id: 0})
        pipe.hset(keys.msg, task_id, redis_client.hget(keys.msg, task_id) or b"")
        pipe.zrem(keys.lease, task_id)
        store.scripts.claim(
            keys=[keys.due, keys.msg, keys.lease, keys.leased, keys.tags],
            args=[60_000, 10, 0],
            client=pipe,
        )
        first, *_, second = pipe.execute()

    # then the tokens differ, and the first claim's ack leaves the second's
    # entry in its lease: only its own claim settles it.
    assert first[1] != second[1]
    assert store.ack(0, int(first[1]), [task_id]) == 0
    assert redis_client.zscore(LEASE, task_id) is not None
    assert store.ack(0, int(second[1]), [task_id]) == 1


def test_a_due_time_that_is_not_a_number_moves_nothing(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given a parked entry, a reschedule whose due time reads as NaN (tonumber
    # takes "nan"; ZADD refuses it, after the entry had left the due set)
    app = make_test_app()
    task_id = app.tasks["tests.record"].apply_delayed((1,), countdown=60).id
    store = store_for(app)
    keys = store.keys(0)
    score = redis_client.zscore(DUE, task_id)

    with pytest.raises(redis.ResponseError, match="not a number"):
        store.scripts.reschedule(
            keys=[keys.due, lanes_key(PREFIX, 0)], args=[keys.wake, task_id, "a", "nan"]
        )

    # leaves the entry parked where it was, with its payload.
    assert redis_client.zscore(DUE, task_id) == score
    assert redis_client.hexists(MSG, task_id)


def test_a_lease_record_reading_as_nan_is_recovered_due_now(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = make_test_app()
    task_id = app.tasks["tests.record"].apply_delayed((1,), countdown=0).id
    store = store_for(app)
    claimed = store.claim(0, limit=10, lease_ms=1)
    assert [e.task_id for e in claimed.entries] == [task_id]
    redis_client.hset(LEASED, task_id, f"nan {claimed.token}")
    assert store.unclaim(0, claimed.token, [task_id]) == 0  # not a score it can use

    with Companion(app) as companion:
        assert companion.release_due().released == 1
    assert _queued_ids(redis_client) == [task_id]
