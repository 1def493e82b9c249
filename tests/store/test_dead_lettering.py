"""A claimed entry that cannot be published is dead-lettered with its reason and payload.

Pins the lines of ``store/lua/deadletter.lua`` (see docs/mutation.rst)
through :meth:`Store.dead_letter` on a private Redis, no worker or
companion: each id this claim leases leaves the lease set, the leased hash
and the message hash, and is added to the dead set (scored by Redis-now)
with its record (the reason, a newline, the payload: empty when its message
was gone); its key is given up and its tags leave the index, its record
kept as ``d:<id>`` for a requeue; ids leased by another claim, or not leased
at all, stay where they are and are not counted; a key of another type
refuses the call before anything moves.
"""

from __future__ import annotations

import pytest
import redis
from celery import Celery

from celery_zdelay.parking import store_for
from celery_zdelay.store import Store
from celery_zdelay.store.dead_reason import DeadReason
from celery_zdelay.store.marks import check_marks, key_owner, tagged_ids
from tests.support.clock import redis_ms
from tests.support.keys import SHARD0, refused_while_written_over

pytestmark = pytest.mark.timeout(60)

HOUR = 3_600_000


def _reason(text: str) -> DeadReason:
    return DeadReason(reason=text, due_ms=1_700_000_000_000, companion="c-test")


def _claimed(app: Celery, calls: list[dict[str, object]]) -> tuple[Store, int, list[str]]:
    """Park one ``tests.record`` call per item of *calls* (its options), due now; claim them."""
    record = app.tasks["tests.record"]
    ids = [record.apply_delayed((n,), countdown=0, **options).id for n, options in enumerate(calls)]
    store = store_for(app)
    claimed = store.claim(0, limit=len(ids), lease_ms=HOUR)
    assert sorted(e.task_id for e in claimed.entries) == sorted(ids)
    return store, claimed.token, ids


def test_each_entry_this_claim_leases_is_dead_lettered_with_its_reason_and_payload(
    app: Celery, redis_client: redis.Redis
) -> None:
    store, token, (keyed, tagged, plain) = _claimed(
        app, [{"key": "order:1", "tags": ["shop", "eu"]}, {"tags": ["shop"]}, {}]
    )
    # Ids only: an AsyncResult kept in a failing test's frame outlives Redis
    other = app.tasks["tests.record"].apply_delayed(("theirs",), countdown=0, key="order:2").id
    other_token = store.claim(0, limit=1, lease_ms=HOUR).token
    payloads = {i: redis_client.hget(SHARD0.msg, i) for i in (keyed, tagged, plain)}
    records = {i: redis_client.hget(SHARD0.marks, f"i:{i}") for i in (keyed, tagged)}
    # The third entry's message is gone (why a companion dead-letters one)
    redis_client.hdel(SHARD0.msg, plain)
    reasons = [
        (keyed, _reason("foreign entry")),
        ("nowhere", _reason("not leased at all")),
        (tagged, _reason("bad signature")),
        (other, _reason("another claim's")),
        (plain, _reason("message missing")),
    ]

    before = redis_ms(redis_client)
    assert store.dead_letter(0, token, reasons) == 3
    after = redis_ms(redis_client)

    died = {m.decode(): int(s) for m, s in redis_client.zrange(SHARD0.dead, 0, -1, withscores=True)}
    assert sorted(died) == sorted([keyed, tagged, plain])
    assert all(before <= ms <= after for ms in died.values()), (before, died, after)
    assert redis_client.hgetall(SHARD0.dead_msg) == {
        keyed.encode(): _reason("foreign entry").to_json().encode() + b"\n" + payloads[keyed],
        tagged.encode(): _reason("bad signature").to_json().encode() + b"\n" + payloads[tagged],
        plain.encode(): _reason("message missing").to_json().encode() + b"\n",
    }
    # Gone from the lease, the leased hash and the messages; the other
    # claim's entry is where it was
    assert [m.decode() for m in redis_client.zrange(SHARD0.lease, 0, -1)] == [other]
    assert [f.decode() for f in redis_client.hkeys(SHARD0.leased)] == [other]
    assert [f.decode() for f in redis_client.hkeys(SHARD0.msg)] == [other]
    assert redis_client.hget(SHARD0.leased, other).endswith(f" {other_token}".encode())
    # Key given up, tags left, records kept for a requeue
    assert key_owner(store, "order:1") is None
    assert key_owner(store, "order:2") == (other, None)
    assert tagged_ids(store, "shop") == tagged_ids(store, "eu") == []
    assert redis_client.hgetall(SHARD0.marks) == {
        f"d:{keyed}".encode(): records[keyed],
        f"d:{tagged}".encode(): records[tagged],
        f"i:{other}".encode(): redis_client.hget(SHARD0.marks, f"i:{other}"),
        b"k:order:2": other.encode(),
    }
    assert check_marks(store) == []


def test_a_claim_that_leases_none_of_the_ids_dead_letters_nothing(
    app: Celery, redis_client: redis.Redis
) -> None:
    store, token, (parked,) = _claimed(app, [{"tags": ["shop"]}])

    assert store.dead_letter(0, token + 1, [(parked, _reason("wrong claim"))]) == 0
    # The lease itself was recovered (expired): the entry is not this claim's any more
    redis_client.zrem(SHARD0.lease, parked)
    assert store.dead_letter(0, token, [(parked, _reason("lease gone"))]) == 0

    assert not redis_client.exists(SHARD0.dead)
    assert not redis_client.exists(SHARD0.dead_msg)
    assert redis_client.hexists(SHARD0.msg, parked)
    assert tagged_ids(store, "shop") == [parked]


@pytest.mark.parametrize(
    ("key", "kind"),
    [
        (SHARD0.lease, "zset"),
        (SHARD0.leased, "hash"),
        (SHARD0.msg, "hash"),
        (SHARD0.dead, "zset"),
        (SHARD0.dead_msg, "hash"),
    ],
    ids=["lease", "leased", "msg", "dead", "dead_msg"],
)
def test_a_key_of_another_type_refuses_the_dead_letter_before_anything_moves(
    app: Celery, redis_client: redis.Redis, key: str, kind: str
) -> None:
    store, token, (entry,) = _claimed(app, [{}])
    payload = redis_client.hget(SHARD0.msg, entry)
    with refused_while_written_over(redis_client, key, kind):
        store.dead_letter(0, token, [(entry, _reason("refused"))])

    assert redis_client.zscore(SHARD0.lease, entry) is not None
    assert redis_client.hget(SHARD0.leased, entry).endswith(f" {token}".encode())
    assert redis_client.hget(SHARD0.msg, entry) == payload
    assert not redis_client.exists(SHARD0.dead)
    assert not redis_client.exists(SHARD0.dead_msg)


def test_an_id_dead_lettered_twice_in_one_call_counts_once_and_keeps_the_index_exact(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given a keyed, tagged entry and a tagged one in flight, one claim
    store, token, (twice, other) = _claimed(
        app, [{"key": "order:1", "tags": ["shop"]}, {"tags": ["shop"]}]
    )

    # When one call names the first twice
    reasons = [(twice, _reason("first")), (twice, _reason("again"))]
    assert store.dead_letter(0, token, reasons) == 1

    # Then it is dead once, and the other keeps its tag in an exact index
    assert [m.decode() for m in redis_client.zrange(SHARD0.dead, 0, -1)] == [twice]
    assert tagged_ids(store, "shop") == [other]
    assert check_marks(store) == []
