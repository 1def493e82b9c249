"""An acknowledged entry gives up its key and leaves its tags; the others keep theirs.

Pins the key-and-tag lines of ``store/lua/ack.lua`` that mutation testing
found unguarded (see docs/mutation.rst): when the broker has accepted a
keyed, tagged entry, :meth:`Store.ack` removes its record, its key's owner
and its tag members in the same script, so the key is free at once and the
tag lists only what is still parked or in flight. Through real parking on a
private Redis; no worker or companion is needed.
"""

from __future__ import annotations

import pytest
import redis
from celery import Celery

from celery_zdelay.parking import store_for
from celery_zdelay.store.marks import check_marks, key_owner, tagged_ids
from celery_zdelay.store.redis_keys import shard_keys

pytestmark = pytest.mark.timeout(60)

KEYS = shard_keys("zdelay", 0)
LEASE_MS = 60_000


def test_an_acknowledged_entry_gives_up_its_key_and_leaves_its_tags(
    app: Celery, redis_client: redis.Redis
) -> None:
    record = app.tasks["tests.record"]
    done = record.apply_delayed(("done",), countdown=0, key="order:1", tags=["shop", "eu"])
    kept = record.apply_delayed(("kept",), countdown=0, key="order:2", tags=["shop"])
    store = store_for(app)
    claimed = store.claim(0, limit=10, lease_ms=LEASE_MS)
    assert sorted(e.task_id for e in claimed.entries) == sorted([done.id, kept.id])

    assert store.ack(0, claimed.token, [done.id]) == 1

    assert key_owner(store, "order:1") is None
    assert key_owner(store, "order:2") == (kept.id, None)
    assert tagged_ids(store, "shop") == [kept.id]
    assert tagged_ids(store, "eu") == []
    assert set(redis_client.hkeys(KEYS.marks)) == {f"i:{kept.id}".encode(), b"k:order:2"}
    assert check_marks(store) == []
    # The key is free: the next call under it parks a new task.
    again = record.apply_delayed(("again",), countdown=3600, key="order:1")
    assert again.id != done.id
    assert key_owner(store, "order:1") == (again.id, None)


def test_an_ack_by_another_claim_keeps_the_key_and_the_tags(
    app: Celery, redis_client: redis.Redis
) -> None:
    record = app.tasks["tests.record"]
    parked = record.apply_delayed(("p",), countdown=0, key="order:3", tags=["shop"])
    store = store_for(app)
    claimed = store.claim(0, limit=10, lease_ms=LEASE_MS)

    assert store.ack(0, claimed.token + 1, [parked.id]) == 0

    assert key_owner(store, "order:3") == (parked.id, None)
    assert tagged_ids(store, "shop") == [parked.id]
    assert check_marks(store) == []
