"""A claim leases exactly the entries due by Redis-now, earliest first, under one new token.

Pins the lines of ``store/lua/claim.lua`` (see docs/mutation.rst) through
:meth:`Store.claim` on a private Redis, no worker: an entry is claimed
when its due time (the score's millisecond) is at or before Redis-now, to
the last sequence number of that millisecond and not one past it; at most
*limit* are, the earliest first, each with its payload; each moves from
the due set to the lease set (expiring at now + the lease) with its score
and the claim's token, a token no claim had before; the reply says when the
next entry is due and the first lease expires; and a key of another type
refuses the claim before anything moves.
"""

from __future__ import annotations

import pytest
import redis
from celery import Celery

from celery_zdelay.errors import StoreRefusedError
from celery_zdelay.parking import store_for
from celery_zdelay.store import Store
from tests.support.clock import redis_ms
from tests.support.keys import SHARD0

pytestmark = pytest.mark.timeout(60)

LEASE_MS = 60_000
#: A due score is ``due_ms * 1024 + seq``: the last sequence number of a ms.
LAST_SEQ = 1023


def _put(client: redis.Redis, entries: dict[str, int]) -> None:
    """Write entries by hand: id -> due score, each with a payload naming it."""
    client.zadd(SHARD0.due, entries)  # type: ignore[arg-type]
    client.hset(SHARD0.msg, mapping={i: f"payload of {i}" for i in entries})


def _due_ids(client: redis.Redis) -> list[str]:
    return [m.decode() for m in client.zrange(SHARD0.due, 0, -1)]


def test_every_entry_due_by_redis_now_is_claimed_to_the_last_sequence_and_none_after(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given, for each ms from 20 ms ago to 2 s ahead, an entry at its
    # first and at its last sequence number
    start = redis_ms(redis_client)
    scores = {}
    for ms in range(start - 20, start + 2000):
        scores[f"{ms}-first"] = ms * 1024
        scores[f"{ms}-last"] = ms * 1024 + LAST_SEQ
    _put(redis_client, scores)

    claimed = store_for(app).claim(0, limit=len(scores), lease_ms=LEASE_MS)

    # Then exactly those of a ms at or before the claim's Redis-now are
    # claimed (the claim runs within those 2 s, so some are not)
    due = {i for i, s in scores.items() if s // 1024 <= claimed.now_ms}
    assert {e.task_id for e in claimed.entries} == due
    assert set(_due_ids(redis_client)) == set(scores) - due
    assert claimed.now_ms < start + 1999


def test_advance_picks_entries_due_that_much_later(app: Celery, redis_client: redis.Redis) -> None:
    now = redis_ms(redis_client)
    _put(redis_client, {"in-5s": (now + 5_000) * 1024, "in-60s": (now + 60_000) * 1024})
    store = store_for(app)
    assert store.claim(0, limit=10, lease_ms=LEASE_MS).entries == []
    claimed = store.claim(0, limit=10, lease_ms=LEASE_MS, advance_ms=30_000)
    assert [e.task_id for e in claimed.entries] == ["in-5s"]


def test_at_most_limit_entries_are_claimed_the_earliest_first_each_with_its_score_and_payload(
    app: Celery, redis_client: redis.Redis
) -> None:
    now = redis_ms(redis_client)
    scores = {f"e{k}": (now - 1000 + k) * 1024 + k for k in range(5)}
    _put(redis_client, scores)

    claimed = store_for(app).claim(0, limit=3, lease_ms=LEASE_MS)

    assert [(e.task_id, e.score, e.payload) for e in claimed.entries] == [
        (i, scores[i], f"payload of {i}".encode()) for i in ("e0", "e1", "e2")
    ]
    assert _due_ids(redis_client) == ["e3", "e4"]
    assert claimed.next_due_ms == now - 1000 + 3


def test_each_claimed_entry_is_leased_until_now_plus_the_lease_under_the_claims_new_token(
    app: Celery, redis_client: redis.Redis
) -> None:
    now = redis_ms(redis_client)
    _put(redis_client, {"a": (now - 10) * 1024 + 7, "b": (now - 5) * 1024})
    store: Store = store_for(app)
    redis_client.set(SHARD0.tags, 41)

    first = store.claim(0, limit=1, lease_ms=LEASE_MS)
    second = store.claim(0, limit=1, lease_ms=2 * LEASE_MS)

    # A token no claim had before: the shard's counter, moved on each time
    assert (first.token, second.token) == (42, 43)
    assert redis_client.get(SHARD0.tags) == b"43"
    assert redis_client.hgetall(SHARD0.leased) == {
        b"a": f"{(now - 10) * 1024 + 7} 42".encode(),
        b"b": f"{(now - 5) * 1024} 43".encode(),
    }
    assert redis_client.zscore(SHARD0.lease, "a") == first.now_ms + LEASE_MS
    assert redis_client.zscore(SHARD0.lease, "b") == second.now_ms + 2 * LEASE_MS
    # The reply names the first lease to expire, and no entry left parked
    assert second.next_lease_ms == first.now_ms + LEASE_MS
    assert second.next_due_ms is None
    assert _due_ids(redis_client) == []


def test_a_claim_with_nothing_due_moves_nothing_and_names_what_comes_next(
    app: Celery, redis_client: redis.Redis
) -> None:
    now = redis_ms(redis_client)
    _put(redis_client, {"later": (now + 60_000) * 1024})
    claimed = store_for(app).claim(0, limit=10, lease_ms=LEASE_MS)
    assert claimed.entries == []
    assert claimed.next_due_ms == now + 60_000
    assert claimed.next_lease_ms is None
    assert redis_client.get(SHARD0.tags) is None
    assert _due_ids(redis_client) == ["later"]


@pytest.mark.parametrize("key", ["msg", "tags"])
def test_a_key_of_another_type_refuses_the_claim_before_anything_moves(
    app: Celery, redis_client: redis.Redis, key: str
) -> None:
    now = redis_ms(redis_client)
    _put(redis_client, {"a": (now - 10) * 1024})
    if key == "msg":
        redis_client.delete(SHARD0.msg)
        redis_client.set(SHARD0.msg, "something else wrote this")
    else:
        redis_client.set(SHARD0.tags, "something else wrote this")
    with pytest.raises(StoreRefusedError, match="WRONGTYPE celery-zdelay"):
        store_for(app).claim(0, limit=10, lease_ms=LEASE_MS)
    assert _due_ids(redis_client) == ["a"]
    assert redis_client.zcard(SHARD0.lease) == 0
