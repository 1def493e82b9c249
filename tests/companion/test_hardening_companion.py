"""Hardening of the companion against its environment (issue 11): a store out
of memory or read-only, and a host clock that is not the Redis clock."""

from __future__ import annotations

import logging
import threading
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from celery import Celery

from celery_zdelay.companion import Companion
from celery_zdelay.store import admin
from celery_zdelay.testing import RedisServer
from tests.conftest import AppFactory
from tests.helpers import wait_for
from tests.support.logs import error_lines

pytestmark = pytest.mark.timeout(120)


@contextmanager
def running(app: Celery) -> Iterator[tuple[Companion, threading.Thread]]:
    """A companion running in a thread of this process, stopped afterwards."""
    companion = Companion(app)
    thread = threading.Thread(target=companion.run, daemon=True)
    thread.start()
    try:
        yield companion, thread
    finally:
        companion.stop()
        thread.join(timeout=30)
        companion.store.close()


def test_a_store_out_of_memory_pauses_releases_until_memory_is_freed(
    make_test_app: AppFactory, broker_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="celery_zdelay")
    with RedisServer(maxmemory_policy="noeviction") as store_server:
        app = make_test_app(
            broker=f"{broker_server.url}/0",
            conf={"zdelay_redis_url": f"{store_server.url}/0", "zdelay_lease_seconds": 1},
        )
        add = app.tasks["tests.add"]
        ids = [add.apply_delayed((i, i), countdown=0).id for i in range(20)]
        # A companion that claimed five and died: they sit in the lease set,
        # and recover.lua must put them back (its first write is a ZADD).
        with Companion(app) as dead:
            assert len(dead.store.claim(0, limit=5, lease_ms=1000).entries) == 5
        server = store_server.client()
        used = int(server.info("memory")["used_memory"])
        server.config_set("maxmemory", used // 2)

        with running(app) as (companion, thread):
            wait_for(lambda: error_lines(caplog, "out of memory") >= 3, timeout=60)
            assert thread.is_alive()
            assert broker_server.client(0).llen("celery") == 0
            health = admin.server_health(companion.store)
            assert any("out of memory" in w for w in health.warnings)

            server.config_set("maxmemory", 0)

            # The broker is not the store, so each batch is published first and
            # acked in the store after: wait for both, or the last ack races us.
            def settled() -> tuple[int, int, int, int]:
                counts = admin.counts(companion.store)
                queued = broker_server.client(0).llen("celery")
                return queued, counts.parked, counts.in_flight, counts.dead

            wait_for(
                lambda: settled() == (20, 0, 0, 0),
                timeout=60,
                message=lambda: f"20 queued, an empty store: {settled()}",
            )
            assert thread.is_alive()
    assert set(ids)


def test_a_companion_pointed_at_a_replica_waits_and_releases_once_it_is_promoted(
    make_test_app: AppFactory, broker_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="celery_zdelay")
    with RedisServer() as primary, RedisServer() as replica:
        producer = make_test_app(
            broker=f"{broker_server.url}/0", conf={"zdelay_redis_url": f"{primary.url}/0"}
        )
        add = producer.tasks["tests.add"]
        ids = [add.apply_delayed((i, i), countdown=0).id for i in range(10)]
        replica.client().replicaof("127.0.0.1", primary.port)
        wait_for(lambda: replica.client().dbsize() == primary.client().dbsize() > 0)

        app = make_test_app(
            broker=f"{broker_server.url}/0", conf={"zdelay_redis_url": f"{replica.url}/0"}
        )
        with running(app) as (companion, thread):
            wait_for(lambda: error_lines(caplog, "read-only replica") >= 3, timeout=60)
            assert thread.is_alive()
            health = admin.server_health(companion.store)
            assert any("read-only replica" in w for w in health.warnings)

            replica.client().replicaof("NO", "ONE")
            wait_for(lambda: broker_server.client(0).llen("celery") == len(ids), timeout=60)
            assert thread.is_alive()


def test_a_companion_on_a_host_40_s_behind_counts_as_alive(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery_zdelay.companion import loop

    # The companion's host clock runs 40 s behind the Redis server's.
    behind = types.SimpleNamespace(
        time=lambda: time.time() - 40,
        monotonic=time.monotonic,
        perf_counter=time.perf_counter,
        sleep=time.sleep,
    )
    monkeypatch.setattr(loop, "time", behind)
    with running(app) as (companion, _):
        wait_for(lambda: admin.companions(companion.store), message="a heartbeat")
        status = admin.status(companion.store)
        (seen,) = status.companions
        assert seen.alive
        assert abs(status.now_ms - seen.seen_ms) < 10_000
        assert status.now_ms - 10_000 < seen.started_ms <= seen.seen_ms
        assert admin.check(status, max_overdue_ms=60_000) == []


def test_an_unforeseen_store_error_is_logged_and_the_companion_carries_on(
    make_test_app: AppFactory,
    broker_server: Any,
    redis_client: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="celery_zdelay")
    app = make_test_app(broker=f"{broker_server.url}/0")
    ids = [app.tasks["tests.add"].apply_delayed((i, i), countdown=0).id for i in range(5)]
    with Companion(app) as probe:
        lease = probe.store.keys(0).lease
    redis_client.set(lease, "clobbered by someone else")  # every claim now fails

    with running(app) as (_, thread):
        wait_for(lambda: error_lines(caplog, "release pass failed unexpectedly") >= 2, timeout=60)
        assert thread.is_alive()
        redis_client.delete(lease)
        wait_for(lambda: broker_server.client(0).llen("celery") == len(ids), timeout=60)
        assert thread.is_alive()
