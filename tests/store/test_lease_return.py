"""A lease ends by going back to the due set at the entry's own due score: given back or expired.

Pins the lines of ``store/lua/unclaim.lua`` and ``store/lua/recover.lua``
(see docs/mutation.rst) on a private Redis, no worker or companion.

``unclaim.lua``, through :meth:`Store.unclaim`: each id the claim still
owns leaves the lease set and the leased hash and is due again at the
score it was leased with; an id leased by another claim, not leased, or
whose lease was recovered meanwhile stays where it is and is not counted;
the answer is the number given back.

``recover.lua``, through :meth:`Store.claim` (which runs it first) and
through the script itself (its answer, which no caller reads, is the
number recovered): each lease that expired by Redis-now goes back due at
its own score, the earliest expiry first and at most *limit* of them; a
live lease stays; a lease whose leased record is missing or unreadable is
due now rather than lost.

Both: a key of another type refuses the call before anything moves.
"""

from __future__ import annotations

import pytest
import redis
from celery import Celery

from celery_zdelay.parking import store_for
from celery_zdelay.store import Store
from tests.support.clock import redis_ms
from tests.support.keys import SHARD0, refused_while_written_over
from tests.support.store import claim_parked

pytestmark = pytest.mark.timeout(60)

HOUR = 3_600_000


def _zset(client: redis.Redis, key: str) -> dict[str, int]:
    return {m.decode(): int(s) for m, s in client.zrange(key, 0, -1, withscores=True)}


def _expire(client: redis.Redis, expiries: dict[str, int]) -> None:
    """Make leases end at *expiries* (ms), as if their companion had stalled that long ago."""
    assert client.zadd(SHARD0.lease, expiries, xx=True, ch=True) == len(expiries)


def _recover(store: Store, limit: int) -> int:
    """Run recover.lua alone, as Store.claim does before each claim, and return its answer."""
    keys = store.keys(0)
    return int(
        store.scripts.recover(
            keys=[keys.lease, keys.leased, keys.due], args=[limit], client=store.client
        )
    )


# -- unclaim.lua -------------------------------------------------------------------------


def test_each_entry_given_back_is_due_again_at_its_own_score_and_leaves_the_lease(
    app: Celery, redis_client: redis.Redis
) -> None:
    token, scores = claim_parked(app, ["a", "b", "c"])

    assert store_for(app).unclaim(0, token, ["a", "b"]) == 2

    assert _zset(redis_client, SHARD0.due) == {"a": scores["a"], "b": scores["b"]}
    assert list(_zset(redis_client, SHARD0.lease)) == ["c"]
    assert redis_client.hkeys(SHARD0.leased) == [b"c"]
    assert redis_client.hget(SHARD0.leased, "c") == f"{scores['c']} {token}".encode()
    assert redis_client.hlen(SHARD0.msg) == 3

    # The last one alone (the first id of its call)
    assert store_for(app).unclaim(0, token, ["c"]) == 1
    assert _zset(redis_client, SHARD0.due) == scores
    assert redis_client.zcard(SHARD0.lease) == redis_client.hlen(SHARD0.leased) == 0


def test_an_id_given_back_twice_in_one_call_counts_once(
    app: Celery, redis_client: redis.Redis
) -> None:
    token, scores = claim_parked(app, ["a", "b"])
    assert store_for(app).unclaim(0, token, ["a", "a"]) == 1
    assert _zset(redis_client, SHARD0.due) == {"a": scores["a"]}
    assert list(_zset(redis_client, SHARD0.lease)) == ["b"]


def test_only_the_claim_that_leased_an_entry_gives_it_back(
    app: Celery, redis_client: redis.Redis
) -> None:
    token, scores = claim_parked(app, ["mine", "also-mine"])
    other_token, _ = claim_parked(app, ["theirs"])
    store = store_for(app)
    leased = redis_client.hgetall(SHARD0.leased)
    lease = _zset(redis_client, SHARD0.lease)

    assert store.unclaim(0, token, ["theirs", "nowhere"]) == 0
    assert store.unclaim(0, other_token, ["mine"]) == 0
    assert store.unclaim(0, token + 1_000, ["mine", "also-mine"]) == 0
    assert redis_client.hgetall(SHARD0.leased) == leased
    assert _zset(redis_client, SHARD0.lease) == lease
    assert redis_client.zcard(SHARD0.due) == 0

    assert store.unclaim(0, token, ["theirs", "nowhere", "mine"]) == 1
    assert _zset(redis_client, SHARD0.due) == {"mine": scores["mine"]}
    assert redis_client.hexists(SHARD0.leased, "theirs")
    assert redis_client.zscore(SHARD0.lease, "theirs") is not None


def test_an_entry_whose_lease_was_recovered_is_not_given_back_by_its_old_claim(
    app: Celery, redis_client: redis.Redis
) -> None:
    # recover.lua took the lease away (it expired): the entry is due again,
    # and may be leased to a new claim by now; the old claim's unclaim is late
    token, _ = claim_parked(app, ["a"])
    redis_client.zrem(SHARD0.lease, "a")

    assert store_for(app).unclaim(0, token, ["a"]) == 0
    assert redis_client.zcard(SHARD0.due) == 0
    assert redis_client.hexists(SHARD0.leased, "a")


@pytest.mark.parametrize(
    ("key", "kind"),
    [(SHARD0.lease, "zset"), (SHARD0.leased, "hash"), (SHARD0.due, "zset")],
    ids=["lease", "leased", "due"],
)
def test_a_key_of_another_type_refuses_the_unclaim_before_anything_moves(
    app: Celery, redis_client: redis.Redis, key: str, kind: str
) -> None:
    token, _ = claim_parked(app, ["a"])
    with refused_while_written_over(redis_client, key, kind):
        store_for(app).unclaim(0, token, ["a"])

    assert redis_client.zscore(SHARD0.lease, "a") is not None
    assert redis_client.hexists(SHARD0.leased, "a")
    assert redis_client.zcard(SHARD0.due) == 0


# -- recover.lua -------------------------------------------------------------------------


def test_expired_leases_go_back_due_at_their_own_score_and_live_ones_stay(
    app: Celery, redis_client: redis.Redis
) -> None:
    token, scores = claim_parked(app, ["a", "b", "c", "d"])
    now = redis_ms(redis_client)
    _expire(redis_client, {"a": now - 2_000, "b": now - 1_000})
    live = {k: v for k, v in _zset(redis_client, SHARD0.lease).items() if k in ("c", "d")}

    assert _recover(store_for(app), 100) == 2

    assert _zset(redis_client, SHARD0.due) == {"a": scores["a"], "b": scores["b"]}
    assert _zset(redis_client, SHARD0.lease) == live
    assert sorted(redis_client.hkeys(SHARD0.leased)) == [b"c", b"d"]
    assert redis_client.hget(SHARD0.leased, "d") == f"{scores['d']} {token}".encode()
    assert redis_client.hlen(SHARD0.msg) == 4

    # One expired lease alone is recovered too; then there is nothing to do
    _expire(redis_client, {"c": now - 500})
    assert _recover(store_for(app), 100) == 1
    assert _zset(redis_client, SHARD0.due)["c"] == scores["c"]
    assert _recover(store_for(app), 100) == 0
    assert list(_zset(redis_client, SHARD0.lease)) == ["d"]
    assert len(_zset(redis_client, SHARD0.due)) == 3


def test_at_most_limit_expired_leases_are_recovered_the_earliest_expired_first(
    app: Celery, redis_client: redis.Redis
) -> None:
    _, scores = claim_parked(app, ["a", "b", "c"])
    now = redis_ms(redis_client)
    # Expiry order is not due order: "c" expired first
    _expire(redis_client, {"c": now - 3_000, "a": now - 2_000, "b": now - 1_000})

    assert _recover(store_for(app), 2) == 2

    assert _zset(redis_client, SHARD0.due) == {"c": scores["c"], "a": scores["a"]}
    assert list(_zset(redis_client, SHARD0.lease)) == ["b"]
    assert redis_client.hkeys(SHARD0.leased) == [b"b"]


def test_an_expired_lease_whose_record_is_missing_or_unreadable_is_due_now(
    app: Celery, redis_client: redis.Redis
) -> None:
    claim_parked(app, ["gone", "garbled"])
    redis_client.hdel(SHARD0.leased, "gone")
    redis_client.hset(SHARD0.leased, "garbled", "not-a-score 7")
    before = redis_ms(redis_client)
    _expire(redis_client, {"gone": before - 2_000, "garbled": before - 1_000})

    assert _recover(store_for(app), 100) == 2

    after = redis_ms(redis_client)
    due = _zset(redis_client, SHARD0.due)
    assert sorted(due) == ["garbled", "gone"]
    for score in due.values():
        assert score % 1024 == 0
        assert before <= score // 1024 <= after
    assert redis_client.zcard(SHARD0.lease) == redis_client.hlen(SHARD0.leased) == 0


def test_a_claim_recovers_expired_leases_first_and_leases_them_again_under_its_token(
    app: Celery, redis_client: redis.Redis
) -> None:
    old_token, scores = claim_parked(app, ["a", "b"])
    _expire(redis_client, {"a": redis_ms(redis_client) - 1_000})
    store = store_for(app)

    claimed = store.claim(0, limit=10, lease_ms=HOUR)

    assert [(e.task_id, e.score) for e in claimed.entries] == [("a", scores["a"])]
    assert claimed.token > old_token
    assert redis_client.hget(SHARD0.leased, "a") == f"{scores['a']} {claimed.token}".encode()
    # The stalled claim no longer owns it
    assert store.unclaim(0, old_token, ["a", "b"]) == 1
    assert _zset(redis_client, SHARD0.due) == {"b": scores["b"]}


@pytest.mark.parametrize(
    ("key", "kind"),
    [(SHARD0.lease, "zset"), (SHARD0.leased, "hash"), (SHARD0.due, "zset")],
    ids=["lease", "leased", "due"],
)
def test_a_key_of_another_type_refuses_the_recovery_before_anything_moves(
    app: Celery, redis_client: redis.Redis, key: str, kind: str
) -> None:
    claim_parked(app, ["a"])
    _expire(redis_client, {"a": redis_ms(redis_client) - 1_000})
    # Through the claim: its recovery runs first, and refuses first
    with refused_while_written_over(redis_client, key, kind):
        store_for(app).claim(0, limit=10, lease_ms=HOUR)

    assert redis_client.zscore(SHARD0.lease, "a") is not None
    assert redis_client.hexists(SHARD0.leased, "a")
    assert redis_client.zcard(SHARD0.due) == 0
