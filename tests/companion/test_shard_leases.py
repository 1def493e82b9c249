"""Shard ownership leases: companions split the shards; the shards of a
companion that dies are taken over as orphans once its leases expire, and
those of one that stops are given up at once."""

from __future__ import annotations

import time

import pytest
import redis

from celery_zdelay.config import get_config
from celery_zdelay.store import Store, admin
from celery_zdelay.store.redis_keys import shard_keys
from tests.conftest import AppFactory
from tests.helpers import Runs, wait_for

pytestmark = pytest.mark.timeout(120)

SHARDS = 8
LEASE_SECONDS = 2


def _owners(client: redis.Redis) -> list[str | None]:
    values = [client.get(shard_keys("zdelay", s).owner) for s in range(SHARDS)]
    return [v.decode() if v else None for v in values]


def test_companions_split_the_shards_and_take_over_from_a_dead_one(
    make_test_app: AppFactory, redis_client: redis.Redis, worker, companion, runs: Runs
) -> None:
    app = make_test_app(
        conf={
            "zdelay_shards": SHARDS,
            "zdelay_shard_leases": True,
            "zdelay_lease_seconds": LEASE_SECONDS,
        }
    )
    first, second = companion(app), companion(app)

    # Given two companions, each owns half of the shards
    def split_evenly() -> bool:
        owners = _owners(redis_client)
        return None not in owners and sorted(owners.count(o) for o in set(owners)) == [4, 4]

    wait_for(split_evenly, timeout=30, message=lambda: f"an even split: {_owners(redis_client)}")
    assert "now owns shards" in first.log()

    # When one is SIGKILLed, the other owns every shard: it takes a shard
    # left unowned at two of its looks (a sixth of a lease apart) once the
    # dead one's owner keys (half a lease) expire, under one lease period on
    # an idle machine. A loaded one may starve the survivor for seconds, so
    # the wait allows ten periods and the check below is the rule, not the pace:
    first.kill()

    def survivor_owns_all() -> bool:
        return all(f":{second.pid}:" in (owner or "") for owner in _owners(redis_client))

    wait_for(
        survivor_owns_all,
        timeout=10 * LEASE_SECONDS,
        message=lambda: f"the survivor owning every shard: {_owners(redis_client)}",
    )
    # and keeps them at its later looks (every third of a second here),
    # although its share is still half (test_shard_takeover.py has the rule
    # look by look),
    kept_until = time.monotonic() + LEASE_SECONDS
    while time.monotonic() < kept_until:
        assert survivor_owns_all(), f"a shard was handed back: {_owners(redis_client)}"
        time.sleep(0.05)
    # the dead companion still counts as alive (its heartbeat is younger than
    # 30 s), so its shards were taken as orphans, not shared out again after
    # it was forgotten
    store = Store(get_config(app))
    try:
        (dead,) = [c for c in admin.companions(store) if f":{first.pid}:" in c.id]
        assert dead.alive
    finally:
        store.close()

    # Then tasks on every shard run
    worker(app)
    ids = {app.tasks["tests.record"].apply_delayed((i,), countdown=0.1).id for i in range(200)}
    runs.wait_for_count(200)
    assert set(runs.ids()) == ids
    assert runs.duplicates() == {}


def test_a_companion_stopped_gives_its_shards_up_at_once(
    make_test_app: AppFactory, redis_client: redis.Redis, companion
) -> None:
    # Given two companions splitting 8 shards, with leases that would take
    # 30 s to expire on their own (half of a 60 s zdelay_lease_seconds)
    app = make_test_app(
        conf={"zdelay_shards": SHARDS, "zdelay_shard_leases": True, "zdelay_lease_seconds": 60}
    )
    leaving, staying = companion(app), companion(app)
    wait_for(
        lambda: None not in _owners(redis_client) and len(set(_owners(redis_client))) == 2,
        timeout=60,
        message=lambda: f"two owners: {_owners(redis_client)}",
    )

    # When one is stopped (SIGTERM)
    assert leaving.terminate() == 0
    stopped_at = time.monotonic()

    # Then none of its leases is left, and the other owns every shard long
    # before those leases would have expired
    assert not any(f":{leaving.pid}:" in (owner or "") for owner in _owners(redis_client))
    wait_for(
        lambda: all(f":{staying.pid}:" in (owner or "") for owner in _owners(redis_client)),
        timeout=25,
        message=lambda: f"the other owning every shard: {_owners(redis_client)}",
    )
    assert time.monotonic() - stopped_at < 30
