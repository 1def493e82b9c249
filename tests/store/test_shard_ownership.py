"""A shard has at most one owner: own.lua acquires only what is free, renews only its own.

Pins each line of ``store/lua/own.lua`` (see docs/mutation.rst), calling
the script through :meth:`Store.own` on a private Redis: the lease's length
is the one asked for, a companion never takes or gives up another's shard,
and giving up a shard is immediate.
"""

from __future__ import annotations

import pytest
import redis
from celery import Celery

from celery_zdelay.parking import store_for
from celery_zdelay.store.redis_keys import shard_keys

pytestmark = pytest.mark.timeout(60)

LEASE_MS = 60_000


def test_a_free_shard_is_acquired_for_the_lease_asked_and_no_longer(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    owner_key = shard_keys("zdelay", 0).owner
    assert store.own(0, "alpha", "acquire", lease_ms=LEASE_MS) is True
    assert store.owner(0) == "alpha"
    assert 0 < redis_client.pttl(owner_key) <= LEASE_MS
    assert redis_client.pttl(owner_key) > LEASE_MS - 10_000


def test_an_owned_shard_is_neither_acquired_nor_renewed_by_another(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    assert store.own(0, "alpha", "acquire", lease_ms=LEASE_MS)
    assert store.own(0, "beta", "acquire", lease_ms=LEASE_MS) is False
    assert store.own(0, "beta", "renew", lease_ms=LEASE_MS) is False
    assert store.owner(0) == "alpha"


def test_a_renewal_extends_only_the_owners_lease_and_never_takes_a_free_shard(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    owner_key = shard_keys("zdelay", 0).owner
    # Renewing is for a shard one holds: a free one stays free.
    assert store.own(0, "alpha", "renew", lease_ms=LEASE_MS) is False
    assert store.owner(0) is None
    assert store.own(0, "alpha", "acquire", lease_ms=1_000)
    assert store.own(0, "alpha", "renew", lease_ms=LEASE_MS) is True
    assert redis_client.pttl(owner_key) > 1_000
    # Acquiring again what one owns is a renewal, not a refusal.
    assert store.own(0, "alpha", "acquire", lease_ms=LEASE_MS) is True


def test_giving_up_frees_only_ones_own_shard_at_once(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    assert store.own(0, "alpha", "acquire", lease_ms=LEASE_MS)
    assert store.own(0, "beta", "release", lease_ms=LEASE_MS) is False
    assert store.owner(0) == "alpha"
    assert store.own(0, "alpha", "release", lease_ms=LEASE_MS) is False
    assert store.owner(0) is None
    assert store.own(0, "beta", "acquire", lease_ms=LEASE_MS) is True


def test_the_script_replies_exactly_one_or_zero_as_its_header_says(app: Celery) -> None:
    # Store.own() reads only the truth of the reply; the script's own
    # contract (1 when owned after the call, else 0) is pinned here.
    store = store_for(app)
    owner_key = shard_keys("zdelay", 0).owner

    def own(companion: str, action: str) -> object:
        return store.scripts.own(
            keys=[owner_key], args=[companion, action, LEASE_MS], client=store.client
        )

    assert own("alpha", "acquire") == 1
    assert own("beta", "acquire") == 0
    assert own("alpha", "renew") == 1
    assert own("alpha", "release") == 0
    assert own("alpha", "renew") == 0
