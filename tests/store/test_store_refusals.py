"""A store that answers but refuses to park: the producer hears celery-zdelay's error.

Out of memory or a read-only replica is not a lost connection, and a raw
redis-py ``ResponseError`` tells a producer neither that nothing was parked
nor what to fix. Each refusal raises :class:`celery_zdelay.StoreRefusedError`
(a ``ZDelayError``) and leaves nothing written.
"""

from __future__ import annotations

import pytest

import celery_zdelay
from celery_zdelay import StoreRefusedError, ZDelayError
from celery_zdelay.testing import RedisServer
from tests.conftest import AppFactory
from tests.helpers import wait_for
from tests.support.keys import SHARD0

pytestmark = pytest.mark.timeout(60)


def test_a_store_out_of_memory_refuses_the_park_with_the_fix_and_writes_nothing(
    make_test_app: AppFactory,
) -> None:
    with RedisServer(maxmemory_policy="noeviction") as server:
        app = make_test_app(conf={"zdelay_redis_url": f"{server.url}/0"})
        add = app.tasks["tests.add"]
        add.apply_delayed((1, 1), countdown=600)  # scripts loaded, one entry parked
        client = server.client()
        keys_before = client.dbsize()
        # Given Redis has reached maxmemory under noeviction
        client.config_set("maxmemory", int(client.info("memory")["used_memory"]) // 2)

        # When a task is parked, the producer gets celery-zdelay's error naming the fix
        with pytest.raises(StoreRefusedError, match="out of memory") as refused:
            add.apply_delayed((2, 2), countdown=600)
        assert isinstance(refused.value, ZDelayError)
        assert "Raise maxmemory" in str(refused.value)
        assert "nothing was written" in str(refused.value)

        # ... and nothing of it was written
        client.config_set("maxmemory", 0)
        assert client.dbsize() == keys_before
        assert client.zcard(SHARD0.due) == 1


def test_a_read_only_replica_refuses_the_park_and_names_the_primary(
    make_test_app: AppFactory,
) -> None:
    with RedisServer() as primary, RedisServer() as replica:
        primary_app = make_test_app(conf={"zdelay_redis_url": f"{primary.url}/0"})
        primary_app.tasks["tests.add"].apply_delayed((1, 1), countdown=600)
        # Given zdelay_redis_url points at a replica of the store
        replica.client().replicaof("127.0.0.1", primary.port)
        wait_for(lambda: replica.client().dbsize() == primary.client().dbsize() > 0)
        app = make_test_app(conf={"zdelay_redis_url": f"{replica.url}/0"})

        # When a task is parked there, the producer hears where to point the URL
        with pytest.raises(StoreRefusedError, match="read-only replica") as refused:
            app.tasks["tests.add"].apply_delayed((2, 2), countdown=600)
        assert "Point zdelay_redis_url at the primary" in str(refused.value)

        # ... and the primary still holds only the first entry
        assert primary.client().zcard(SHARD0.due) == 1


def test_a_task_over_the_store_bulk_limit_is_refused_as_too_large_not_unreachable(
    make_test_app: AppFactory,
) -> None:
    # Given a store that takes values of at most 1 MiB (Redis closes the
    # connection on a longer one, which reads as an unreachable server)
    limit = 1024 * 1024
    with RedisServer() as server:
        client = server.client()
        client.config_set("proto-max-bulk-len", limit)
        app = make_test_app(conf={"zdelay_redis_url": f"{server.url}/0"})
        add = app.tasks["tests.add"]
        add.apply_delayed((1, 1), countdown=600)

        # When a task with an argument over it is parked, among others
        def park_both() -> None:
            with celery_zdelay.batch(app):
                add.apply_delayed((2, 2), countdown=600)
                add.apply_delayed(("x" * limit, ""), countdown=600)

        with pytest.raises(StoreRefusedError, match="proto-max-bulk-len") as refused:
            park_both()

        # Then the producer hears the size and the fix, and nothing was written
        assert "takes values of at most 1048576 bytes" in str(refused.value)
        assert "nothing was written" in str(refused.value)
        assert client.zcard(SHARD0.due) == 1
