"""A companion that takes over a dead one's shards keeps them.

The rule, checked look by look rather than by the pace of a loaded machine:
a dead companion's heartbeat still counts it as live for up to 30 s, so the
survivor's fair share stays half of the shards; the dead one's shards, once
their owner keys expire, are taken as orphans beyond that share, and must
not be handed back to nobody at the next look (each shard so dropped waits
unreleased for a check interval, again and again, until the heartbeat ages
out: with the default 60 s ``zdelay_lease_seconds`` that is 10 s at a time).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from celery_zdelay.companion.ownership import ORPHAN_KEEP_SECONDS, ShardOwnership
from celery_zdelay.config import get_config
from celery_zdelay.store import Store
from tests.conftest import AppFactory
from tests.support.keys import keys_of

pytestmark = pytest.mark.timeout(60)

SHARDS = 8
SURVIVOR, DEAD = "survivor", "dead"
#: Live companions by their heartbeats: the dead one's is still fresh.
LIVE = 2


@pytest.fixture
def store(make_test_app: AppFactory) -> Iterator[Store]:
    """The store of an app with SHARDS shards and shard leases on."""
    app = make_test_app(conf={"zdelay_shards": SHARDS, "zdelay_shard_leases": True})
    store = Store(get_config(app))
    yield store
    store.close()


def _owners(client: redis.Redis) -> list[str | None]:
    values = [client.get(keys_of(s).owner) for s in range(SHARDS)]
    return [v.decode() if v else None for v in values]


def _look(ownership: ShardOwnership, live: int = LIVE) -> None:
    """One of the survivor's periodic looks, now rather than a check interval later."""
    ownership._next_check = 0.0
    ownership.maybe_renew(live)


@pytest.mark.parametrize("expiry", ["together", "staggered"])
def test_shards_taken_from_a_dead_companion_stay_owned_at_every_later_look(
    store: Store, redis_client: redis.Redis, expiry: str
) -> None:
    """Catches, in ``ShardOwnership.maybe_renew``, giving up every shard above
    the share, orphans included (the code before this test)::

        shared = [s for s in ... if not self._kept(s, live_companions)]
        ->  shared = sorted(self.owned, reverse=True)

    The shards then flap: all owned at one look, the surplus dropped at the
    next ("together"), or a steady two unowned at every look when the dead
    one's leases expire at different times ("staggered").
    """
    survivor = ShardOwnership(store, SURVIVOR, range(SHARDS), lease_ms=60_000)
    # Given the survivor owning its half, the other half owned by a
    # companion that was just SIGKILLed (its heartbeat still fresh),
    for shard in range(SHARDS):
        if shard % 2:
            assert store.own(shard, SURVIVOR, "acquire", lease_ms=60_000)
            survivor.owned.add(shard)
    dead = [s for s in range(SHARDS) if s % 2 == 0]
    # when the dead one's owner keys expire, together or one pair after the other,
    later = [] if expiry == "together" else dead[2:]
    for shard in later:
        assert store.own(shard, DEAD, "acquire", lease_ms=60_000)
    _look(survivor)
    _look(survivor)
    for shard in later:
        redis_client.delete(keys_of(shard).owner)
    # then within a few looks the survivor owns every shard,
    for _ in range(3):
        _look(survivor)
    assert _owners(redis_client) == [SURVIVOR] * SHARDS
    # and at every later look it still does (no shard handed back to nobody).
    for look in range(10):
        _look(survivor)
        assert _owners(redis_client) == [SURVIVOR] * SHARDS, f"look {look}"
        assert survivor.shards() == list(range(SHARDS))


@pytest.mark.parametrize("dead_forgotten", [False, True], ids=["dead-counted", "dead-forgotten"])
def test_orphans_are_shared_out_again_when_a_companion_joins(
    store: Store, redis_client: redis.Redis, dead_forgotten: bool
) -> None:
    # Keeping orphans must not keep a newcomer without shards: when another
    # companion starts (its heartbeat raises the live count), the survivor
    # gives its surplus up, and the newcomer takes its share; also when the
    # dead companion's heartbeat aged out before the newcomer came.
    survivor = ShardOwnership(store, SURVIVOR, range(SHARDS), lease_ms=60_000)
    for shard in range(SHARDS):
        if shard % 2:
            assert store.own(shard, SURVIVOR, "acquire", lease_ms=60_000)
            survivor.owned.add(shard)
    for _ in range(3):
        _look(survivor)
    assert survivor.shards() == list(range(SHARDS))
    live = LIVE
    if dead_forgotten:
        live = 1
        _look(survivor, live=live)
        assert survivor.shards() == list(range(SHARDS))

    newcomer = ShardOwnership(store, "newcomer", range(SHARDS), lease_ms=60_000)
    for _ in range(3):
        _look(survivor, live=live + 1)
        _look(newcomer, live=live + 1)
    owners = _owners(redis_client)
    assert None not in owners
    assert owners.count("newcomer") >= 2
    assert owners.count(SURVIVOR) <= 6


def test_orphans_go_to_the_other_survivor_once_the_dead_one_is_forgotten(
    store: Store, redis_client: redis.Redis
) -> None:
    # Given three companions on 8 shards (3, 3 and 2), the one with 2 dead,
    # and a survivor that took both of its shards as orphans (5 owned),
    first = ShardOwnership(store, "first", range(SHARDS), lease_ms=60_000)
    other = ShardOwnership(store, "other", range(SHARDS), lease_ms=60_000)
    for owner, shards in ((first, (0, 1, 2)), (other, (3, 4, 5))):
        for shard in shards:
            assert store.own(shard, owner.companion_id, "acquire", lease_ms=60_000)
            owner.owned.add(shard)
    for _ in range(2):
        _look(first, live=3)
    _look(other, live=3)
    assert len(first.shards()) == 5
    # when the dead one's heartbeat ages out (two live companions, a share of 4),
    for _ in range(3):
        _look(first, live=2)
        _look(other, live=2)
    # then the surplus went to the other survivor: 4 each, none unowned.
    owners = _owners(redis_client)
    assert (owners.count("first"), owners.count("other")) == (4, 4), owners


def test_shards_given_up_for_a_slow_newcomer_are_not_taken_back_before_it_looks(
    store: Store, redis_client: redis.Redis
) -> None:
    """Catches, in ``ShardOwnership.maybe_renew``, taking back as orphans the
    shards this companion gave up a look or two ago (the code before this
    test, seen in a loaded whole-suite run: one companion kept all 8 shards
    for good)::

        orphaned = shard in self._seen_unowned and shard not in self._given_up
        ->  orphaned = shard in self._seen_unowned
    """
    first = ShardOwnership(store, "first", range(SHARDS), lease_ms=60_000)
    # Given a companion that owns every shard, alone,
    _look(first, live=1)
    assert first.shards() == list(range(SHARDS))
    # when a second one starts (the live count is 2) and the first gives
    # up half, then looks twice more before the newcomer's first look,
    newcomer = ShardOwnership(store, "newcomer", range(SHARDS), lease_ms=60_000)
    for _ in range(3):
        _look(first)
    assert len(first.shards()) == SHARDS // 2
    _look(newcomer)
    # then the newcomer has its half, and both keep theirs.
    for _ in range(3):
        _look(first)
        _look(newcomer)
    owners = _owners(redis_client)
    assert (owners.count("first"), owners.count("newcomer")) == (4, 4), owners


def test_a_live_companion_whose_shards_were_taken_as_orphans_gets_them_back(
    store: Store, redis_client: redis.Redis
) -> None:
    """Catches, in ``ShardOwnership._kept``, keeping an orphan above the share
    for as long as the live count stays as it was (the code before this
    test)::

        return live_companions == taken_with and now - taken_at < ORPHAN_KEEP_SECONDS
        ->  return live_companions == taken_with
    """
    first = ShardOwnership(store, "first", range(SHARDS), lease_ms=60_000)
    clock = [1000.0]
    first.clock = lambda: clock[0]
    # Given two companions starting together, the second too slow for
    # its first look until the first has taken every shard (half as orphans),
    for _ in range(3):
        _look(first)
    assert first.shards() == list(range(SHARDS))
    second = ShardOwnership(store, "second", range(SHARDS), lease_ms=60_000)
    _look(second)
    assert second.shards() == []
    # when the second is still live (the count unchanged) after a dead
    # owner's heartbeat would have aged out of it,
    clock[0] += ORPHAN_KEEP_SECONDS - 1
    _look(first)
    assert len(first.shards()) == SHARDS
    clock[0] += 1
    # then the first gives the surplus up, and the second takes its share.
    for _ in range(3):
        _look(first)
        _look(second)
    owners = _owners(redis_client)
    assert (owners.count("first"), owners.count("second")) == (4, 4), owners
