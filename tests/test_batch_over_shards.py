"""A batch spread over several shards of one Redis: each entry lands on its
shard, every one runs, and a batch that cannot be parked whole parks nothing.

``celery_zdelay.batch()`` and ``apply_delayed_many`` park one batch per
call; with ``zdelay_shards > 1`` on one Redis server the shards' parts go in
one MULTI/EXEC, a path single-shard tests never take.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import redis
from celery import Celery

import celery_zdelay
from celery_zdelay.config import get_config
from celery_zdelay.errors import StoreRefusedError
from celery_zdelay.store import Store
from tests.conftest import AppFactory
from tests.helpers import Runs

pytestmark = pytest.mark.timeout(90)

SHARDS = 8


def _parked_by_shard(store: Store) -> dict[int, set[str]]:
    return {
        shard: {m.decode() for m in store.client.zrange(store.keys(shard).due, 0, -1)}
        for shard in range(SHARDS)
    }


def test_a_batch_over_several_shards_parks_each_entry_on_its_shard_and_all_run(
    make_test_app: AppFactory, worker, companion, runs: Runs
) -> None:
    app = make_test_app(conf={"zdelay_shards": SHARDS})
    store = Store(get_config(app))
    record = app.tasks["tests.record"]
    try:
        # Given 200 calls parked in one batch, due in 2 s, on a store of 8 shards
        with celery_zdelay.batch(app):
            ids = [record.apply_delayed((i,), countdown=2).id for i in range(200)]

        # Then each entry sits on the shard its id hashes to, with its payload
        expected: dict[int, set[str]] = defaultdict(set)
        for task_id in ids:
            expected[store.shard_of(task_id)].add(task_id)
        assert _parked_by_shard(store) == {s: expected[s] for s in range(SHARDS)}
        # (200 random ids leave one of 8 shards empty about once in 10^11 runs)
        assert all(expected[s] for s in range(SHARDS))
        for shard in range(SHARDS):
            assert store.client.hlen(store.keys(shard).msg) == len(expected[shard])

        # When they fall due, with a companion and a worker running
        worker(app)
        companion(app)

        # Then every one runs once, and every shard is empty
        runs.wait_for_ids(set(ids))
        assert runs.duplicates() == {}
        assert _parked_by_shard(store) == {s: set() for s in range(SHARDS)}
    finally:
        store.close()


#: Calls in the batch that one shard refuses: enough that one of them lands
#: on that shard. With 40, none did in about 1 run in 200 ((7/8)**40: seen
#: once in a whole-suite run, "DID NOT RAISE"); with 400, 1 in 10**23.
BATCH = 400


def _park_batch(app: Celery, bulk: str) -> None:
    record = app.tasks["tests.record"]
    if bulk == "batch":
        with celery_zdelay.batch(app):
            for i in range(BATCH):
                record.apply_delayed((i,), countdown=600)
    else:
        record.apply_delayed_many([(i,) for i in range(BATCH)], countdown=600)


@pytest.mark.parametrize("bulk", ["batch", "apply_delayed_many"])
def test_a_batch_that_one_shard_cannot_take_parks_nothing_on_the_others(
    make_test_app: AppFactory, redis_client: redis.Redis, bulk: str
) -> None:
    app = make_test_app(conf={"zdelay_shards": SHARDS})
    store = Store(get_config(app))
    try:
        # Given another program wrote a string where shard 2 keeps its due set
        redis_client.set(store.keys(2).due, "not a zset")

        # When a batch of 400 calls, spread over every shard, is parked
        with pytest.raises(StoreRefusedError) as refused:
            _park_batch(app, bulk)

        # Then the producer hears why and how to fix it, and nothing was
        # parked: not on shard 2, and not on the shards that could take theirs
        assert f"celery-zdelay key {store.keys(2).due} holds a string, not a zset" in str(
            refused.value
        )
        assert "give celery-zdelay its own zdelay_key_prefix or database" in str(refused.value)
        for shard in set(range(SHARDS)) - {2}:
            assert store.client.zcard(store.keys(shard).due) == 0
            assert store.client.hlen(store.keys(shard).msg) == 0
    finally:
        store.close()
