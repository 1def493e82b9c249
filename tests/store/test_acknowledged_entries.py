"""An acknowledged entry is forgotten only by the claim that owns it, and nothing else goes.

Pins each line of ``store/lua/ack.lua`` (see docs/mutation.rst), through
:meth:`Store.ack` on a private Redis: the entries a claim acknowledges
leave the lease set, the leased hash and the message hash together; an
entry leased by another claim, or not acknowledged, stays in flight; the
template an acknowledged entry used loses one reference, and goes with its
last.
"""

from __future__ import annotations

import pytest
import redis
from celery import Celery

from celery_zdelay.errors import StoreRefusedError
from celery_zdelay.parking import store_for
from celery_zdelay.store.redis_keys import shard_keys

pytestmark = pytest.mark.timeout(60)

KEYS = shard_keys("zdelay", 0)
LEASE_MS = 60_000


def _park_and_claim(app: Celery, ids: list[str]) -> int:
    for task_id in ids:
        app.tasks["tests.record"].apply_delayed((task_id,), countdown=0, task_id=task_id)
    claimed = store_for(app).claim(0, limit=len(ids), lease_ms=LEASE_MS)
    assert sorted(e.task_id for e in claimed.entries) == sorted(ids)
    return claimed.token


def _template_counts(client: redis.Redis) -> dict[bytes, bytes]:
    return {k: v for k, v in client.hgetall(KEYS.templates).items() if k.startswith(b"#")}


def test_acknowledged_entries_are_forgotten_and_only_those(
    app: Celery, redis_client: redis.Redis
) -> None:
    token = _park_and_claim(app, ["a", "b", "c"])
    assert store_for(app).ack(0, token, ["a", "b"]) == 2
    for gone in (b"a", b"b"):
        assert redis_client.zscore(KEYS.lease, gone) is None
        assert not redis_client.hexists(KEYS.leased, gone)
        assert not redis_client.hexists(KEYS.msg, gone)
    assert redis_client.zscore(KEYS.lease, "c") is not None
    assert redis_client.hexists(KEYS.leased, "c")
    assert redis_client.hexists(KEYS.msg, "c")
    # The template "c" still uses is kept, counted once.
    assert list(_template_counts(redis_client).values()) == [b"1"]


def test_another_claims_token_acknowledges_nothing(app: Celery, redis_client: redis.Redis) -> None:
    token = _park_and_claim(app, ["a", "b"])
    assert store_for(app).ack(0, token + 1, ["a", "b"]) == 0
    assert store_for(app).ack(0, token - 1, ["a"]) == 0
    assert redis_client.zcard(KEYS.lease) == 2
    assert redis_client.hlen(KEYS.msg) == 2
    assert list(_template_counts(redis_client).values()) == [b"2"]
    # An id that was never leased counts for nothing either.
    assert store_for(app).ack(0, token, ["a", "never-parked"]) == 1


def test_an_id_acknowledged_twice_in_one_call_counts_once_and_keeps_a_shared_template(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given a and b in flight, sharing one template (counted twice)
    token = _park_and_claim(app, ["a", "b"])
    # When one call acknowledges a twice
    assert store_for(app).ack(0, token, ["a", "a"]) == 1
    # Then b's template stays, counted once, and one release is recorded
    assert list(_template_counts(redis_client).values()) == [b"1"]
    assert redis_client.hexists(KEYS.msg, "b")


def test_the_last_acknowledgement_of_a_template_deletes_it(
    app: Celery, redis_client: redis.Redis
) -> None:
    token = _park_and_claim(app, ["a", "b"])
    assert redis_client.hlen(KEYS.templates) == 2  # the template and its count
    assert store_for(app).ack(0, token, ["a"]) == 1
    assert list(_template_counts(redis_client).values()) == [b"1"]
    assert store_for(app).ack(0, token, ["b"]) == 1
    assert redis_client.hlen(KEYS.templates) == 0


def test_a_key_of_another_type_is_refused_with_the_fix_before_anything_is_forgotten(
    app: Celery, redis_client: redis.Redis
) -> None:
    token = _park_and_claim(app, ["a"])
    redis_client.delete(KEYS.msg)
    redis_client.set(KEYS.msg, "something else wrote this")
    with pytest.raises(StoreRefusedError, match=r"holds a string, not a hash"):
        store_for(app).ack(0, token, ["a"])
    assert redis_client.zscore(KEYS.lease, "a") is not None
    assert redis_client.hexists(KEYS.leased, "a")
