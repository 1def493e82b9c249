"""Shard ownership leases: companions split the shards, and the shards of a
companion that dies are taken over within one lease period."""

from __future__ import annotations

import pytest
import redis

from celery_zdelay.store.keys import shard_keys
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

    # When one is SIGKILLed, the other owns every shard within one lease period
    # (plus a second of slack for a loaded machine).
    first.kill()
    wait_for(
        lambda: all(f":{second.pid}:" in (owner or "") for owner in _owners(redis_client)),
        timeout=LEASE_SECONDS + 1,
        message=lambda: f"the survivor owning every shard: {_owners(redis_client)}",
    )

    # Then tasks on every shard run
    worker(app)
    ids = {app.tasks["tests.record"].apply_delayed((i,), countdown=0.1).id for i in range(200)}
    runs.wait_for_count(200)
    assert set(runs.ids()) == ids
    assert runs.duplicates() == {}
