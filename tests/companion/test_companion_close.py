"""A companion that made its own store closes that store's connections when it closes.

A companion made in a with block (tests, an app that embeds one) or run
until stopped used to leave its store's Redis connections open until the
garbage collector found them (``ResourceWarning: unclosed socket`` in the
test runs, about 26 a run). The store is private here: every connection
to it is counted, against a real Redis server.
"""

from __future__ import annotations

import threading

import pytest
import redis

from celery_zdelay.companion import Companion
from celery_zdelay.parking import store_for
from celery_zdelay.store import Store
from celery_zdelay.testing import RedisServer
from tests.conftest import AppFactory
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(60)


def _connected(watcher: redis.Redis) -> int:
    """Connections to the server, the watcher's own left out."""
    return len(watcher.client_list()) - 1


def test_a_companion_closes_the_store_it_made_after_a_with_block_and_after_run(
    make_test_app: AppFactory,
) -> None:
    with RedisServer() as server, redis.Redis.from_url(server.url) as watcher:
        # Given an app whose store is a private Redis, a task parked (the
        # producer's own connection stays: it is the app's)
        app = make_test_app(conf={"zdelay_redis_url": f"{server.url}/0"})
        app.tasks["tests.record"].apply_delayed((1,), countdown=0)
        before = _connected(watcher)

        # When a companion releases it in a with block
        with Companion(app) as companion:
            companion.release_due()
            assert _connected(watcher) > before

        # Then its connections to the store are closed (mutant: close()
        # leaves the store alone, as before: one stays open)
        wait_for(lambda: _connected(watcher) == before, timeout=10)

        # And when a companion runs until stopped, the same
        running = Companion(app)
        thread = threading.Thread(target=running.run, daemon=True)
        thread.start()
        wait_for(lambda: _connected(watcher) > before, timeout=10)
        running.stop()
        thread.join(timeout=30)
        assert not thread.is_alive()
        wait_for(lambda: _connected(watcher) == before, timeout=10)


def test_a_store_the_caller_gave_stays_open(make_test_app: AppFactory) -> None:
    with RedisServer() as server, redis.Redis.from_url(server.url) as watcher:
        app = make_test_app(conf={"zdelay_redis_url": f"{server.url}/0"})
        store = store_for(app)
        store.client.ping()
        before = _connected(watcher)

        with Companion(app, store=store) as companion:
            companion.release_due()

        # The caller's store keeps its connection: closing it is the caller's
        assert _connected(watcher) == before


def test_a_store_given_a_client_leaves_the_pool_it_shares_to_its_other_users(
    make_test_app: AppFactory,
) -> None:
    with RedisServer() as server, redis.Redis.from_url(server.url) as watcher:
        # Given a client sharing its pool with another, which holds a connection
        app = make_test_app(conf={"zdelay_redis_url": f"{server.url}/0"})
        pool = redis.ConnectionPool.from_url(f"{server.url}/0")
        other = redis.Redis(connection_pool=pool, single_connection_client=True)
        other.ping()
        store = Store(store_for(app).config, client=redis.Redis(connection_pool=pool))
        store.client.ping()
        with_other = _connected(watcher)

        # When the store closes
        store.close()

        # Then the other user's connection stays open (mutant: the store
        # disconnects the pool it was given, every connection of it)
        assert _connected(watcher) == with_other
        other.close()
        pool.disconnect()
