"""Given more entries than one command takes, each transition moves every one of them.

The transitions of ``store/lua/_transitions.lua`` remove many ids with
commands of up to 1000 arguments each (as the scripts did before them), so
a batch of 2,500 tagged entries crosses two chunk boundaries: an id left at
a boundary would stay leased, keep its payload, or keep a tag member of an
entry that is gone. Written against the mutants of the library that the
scripts' own tests let survive (see docs/mutation.rst). Through the store on
a private Redis; no worker or companion is needed.
"""

from __future__ import annotations

import pytest
import redis

from celery_zdelay.store import Store
from celery_zdelay.store.dead_reason import DeadReason
from celery_zdelay.store.marks import check_marks
from celery_zdelay.store.redis_keys import shard_keys
from tests.support.store import ids_on_shard, marked_request

pytestmark = pytest.mark.timeout(60)

KEYS = shard_keys("zdelay", 0)
LEASE_MS = 60_000
N = 2_500


def _claim_tagged(store: Store, ids: list[str]) -> int:
    now = store.time_ms()
    store.park([marked_request(i, now - 1_000, tags=("bulk",)) for i in ids])
    claimed = store.claim(0, limit=len(ids), lease_ms=LEASE_MS)
    assert len(claimed.entries) == len(ids)
    return claimed.token


def _nothing_left(client: redis.Redis) -> None:
    for key in (KEYS.due, KEYS.lease, KEYS.tagged):
        assert client.zcard(key) == 0, key
    for key in (KEYS.leased, KEYS.msg, KEYS.marks):
        assert client.hlen(key) == 0, key


def test_an_ack_of_2500_tagged_entries_leaves_no_lease_payload_mark_or_tag(
    store: Store, redis_client: redis.Redis
) -> None:
    ids = ids_on_shard(store, 0, N)
    token = _claim_tagged(store, ids)

    assert store.ack(0, token, ids) == N

    _nothing_left(redis_client)
    assert check_marks(store) == []


def test_a_cancel_of_2500_tagged_entries_leaves_no_payload_mark_or_tag(
    store: Store, redis_client: redis.Redis
) -> None:
    ids = ids_on_shard(store, 0, N)
    now = store.time_ms()
    store.park([marked_request(i, now + 3_600_000, tags=("bulk",)) for i in ids])

    assert store.cancel(ids) == [True] * N

    _nothing_left(redis_client)


def test_2500_dead_letters_keep_their_marks_and_a_purge_takes_them_all(
    store: Store, redis_client: redis.Redis
) -> None:
    ids = ids_on_shard(store, 0, N)
    token = _claim_tagged(store, ids)
    reason = DeadReason(reason="test", due_ms=0, companion="c")

    assert store.dead_letter(0, token, [(i, reason) for i in ids]) == N

    # One "d:<id>" record each, kept for a requeue; no tag lists a dead letter.
    assert redis_client.hlen(KEYS.marks) == N
    assert redis_client.zcard(KEYS.tagged) == 0
    assert redis_client.zcard(KEYS.dead) == N

    assert store.purge_dead(0, ids) == N

    assert redis_client.hlen(KEYS.marks) == 0
    assert redis_client.zcard(KEYS.dead) == 0
    assert redis_client.hlen(KEYS.dead_msg) == 0
