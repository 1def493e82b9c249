"""A held entry leaves the lease for its control's held set with its due score, if its claim has it.

Pins the lines of ``store/lua/hold.lua`` (see docs/mutation.rst) through
:meth:`ControlStore.hold` on a private Redis, no worker or companion: each
id this claim leases moves from the lease set and the leased hash into the
control's held set, scored by its due score, and the control is named in
the shard's lanes set in the same step; ids leased by another claim, or not
leased at all, stay where they are and are not counted; an id given
twice is counted once; a call that holds
nothing names no lane; and a key of another type refuses the call before
anything moves.
"""

from __future__ import annotations

import pytest
import redis
from celery import Celery

from celery_zdelay.parking import store_for
from celery_zdelay.store.control import ControlStore
from celery_zdelay.store.redis_keys import held_set_key, lanes_key
from tests.support.keys import PREFIX, SHARD0, refused_while_written_over
from tests.support.store import claim_parked

pytestmark = pytest.mark.timeout(60)

HOUR = 3_600_000
CONTROL = "queue:emails"
HELD = held_set_key(PREFIX, 0, CONTROL)
LANES = lanes_key(PREFIX, 0)


def test_each_entry_this_claim_leases_moves_to_the_held_set_with_its_due_score(
    app: Celery, redis_client: redis.Redis
) -> None:
    token, scores = claim_parked(app, ["a", "b", "c"])

    assert ControlStore(store_for(app)).hold(0, token, CONTROL, ["a", "b", "c"]) == 3

    held = {m.decode(): int(s) for m, s in redis_client.zrange(HELD, 0, -1, withscores=True)}
    assert held == scores
    assert redis_client.smembers(LANES) == {CONTROL.encode()}
    assert redis_client.zcard(SHARD0.lease) == redis_client.hlen(SHARD0.leased) == 0
    assert redis_client.hlen(SHARD0.msg) == 3


def test_entries_another_claim_leases_or_none_leases_stay_where_they_are(
    app: Celery, redis_client: redis.Redis
) -> None:
    token, scores = claim_parked(app, ["mine", "also-mine"])
    other_token, _ = claim_parked(app, ["theirs"])
    control = ControlStore(store_for(app))

    assert control.hold(0, token, CONTROL, ["theirs", "nowhere", "mine"]) == 1

    assert [m.decode() for m in redis_client.zrange(HELD, 0, -1)] == ["mine"]
    assert redis_client.hget(SHARD0.leased, "theirs") is not None
    assert redis_client.zscore(SHARD0.lease, "theirs") is not None
    assert (
        redis_client.hget(SHARD0.leased, "also-mine") == f"{scores['also-mine']} {token}".encode()
    )

    # Nothing held: no lane named
    redis_client.delete(LANES)
    assert control.hold(0, token, "queue:other", ["theirs", "nowhere"]) == 0
    assert not redis_client.exists(LANES)
    assert not redis_client.exists(held_set_key(PREFIX, 0, "queue:other"))
    assert control.hold(0, other_token, "queue:other", ["theirs"]) == 1
    assert redis_client.smembers(LANES) == {b"queue:other"}


def test_an_id_given_twice_in_one_call_is_held_and_counted_once(
    app: Celery, redis_client: redis.Redis
) -> None:
    # The count is what the companion reports as held (tasks_held, the
    # pass's totals): an id named twice is one entry
    token, scores = claim_parked(app, ["a", "b"])

    assert ControlStore(store_for(app)).hold(0, token, CONTROL, ["a", "b", "a"]) == 2

    held = {m.decode(): int(s) for m, s in redis_client.zrange(HELD, 0, -1, withscores=True)}
    assert held == scores


def test_an_entry_whose_lease_is_gone_is_not_held(app: Celery, redis_client: redis.Redis) -> None:
    # The leased hash still names the claim, but the lease itself was
    # recovered (expired): the entry is due again, not this claim's to hold
    token, _ = claim_parked(app, ["a"])
    redis_client.zrem(SHARD0.lease, "a")

    assert ControlStore(store_for(app)).hold(0, token, CONTROL, ["a"]) == 0
    assert not redis_client.exists(HELD)


@pytest.mark.parametrize(
    ("key", "kind"),
    [(SHARD0.lease, "zset"), (SHARD0.leased, "hash"), (HELD, "zset"), (LANES, "set")],
    ids=["lease", "leased", "held", "lanes"],
)
def test_a_key_of_another_type_refuses_the_hold_before_anything_moves(
    app: Celery, redis_client: redis.Redis, key: str, kind: str
) -> None:
    token, _ = claim_parked(app, ["a"])
    with refused_while_written_over(redis_client, key, kind):
        ControlStore(store_for(app)).hold(0, token, CONTROL, ["a"])

    assert redis_client.zscore(SHARD0.lease, "a") is not None
    assert redis_client.hexists(SHARD0.leased, "a")
    assert not redis_client.exists(HELD)
