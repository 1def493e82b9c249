"""Fixtures: a private Redis per test session, the test app, workers and companions."""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection, Queue

from celery_zdelay.config import get_config
from celery_zdelay.store import Store
from celery_zdelay.testing import RedisServer
from tests.helpers import (
    CeleryProcess,
    Runs,
    start_companion,
    start_worker,
    stop_all,
    unavailable,
)
from tests.project import close_app, make_app
from tests.servers import LocalCluster
from tests.support.store import Stock, stock

#: Fixtures kept in the module of their concern: ``browser``, ``page`` and
#: ``viewport``; ``django_db``.
pytest_plugins = [
    "tests.support.browser",
    "tests.support.django",
    "tests.support.django_beat",
    "tests.support.layers",
    "tests.support.long_first",
]

#: Shared RabbitMQ of the machine (CI has it; local runs skip without it).
RABBITMQ_URL = os.environ.get("ZDELAY_TEST_RABBITMQ", "amqp://guest:guest@127.0.0.1:5672//")

BROKER_DB, BACKEND_DB, RECORD_DB = 0, 1, 2


def pytest_collection_finish(session: pytest.Session) -> None:
    """Keep what collection built out of the tests' garbage collections.

    Every test module with what it imports (Django, Playwright, Hypothesis,
    OpenTelemetry: about 186,000 objects) lives for the whole session, and
    each full collection (one per :func:`make_test_app` teardown) read it all
    again: 61 % of the test processes' CPU samples in a whole-suite run. Frozen, it
    is never collected; what the tests allocate still is.
    """
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A private redis-server for this test session (one per xdist worker)."""
    with RedisServer() as server:
        yield server


@pytest.fixture(autouse=True)
def _clean_redis(request: pytest.FixtureRequest) -> None:
    if "redis_server" in request.fixturenames:
        server: RedisServer = request.getfixturevalue("redis_server")
        if server.running:
            server.client().flushall()


@pytest.fixture
def broker_server() -> Iterator[RedisServer]:
    """A second private Redis as the broker: releases take the generic path."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def broker_client(broker_server: RedisServer) -> Iterator[redis.Redis]:
    """A client of :func:`broker_server`'s database 0, where kombu's lists live."""
    client = broker_server.client(0)
    yield client
    client.close()


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    """A private 3-master Redis Cluster."""
    with LocalCluster() as local_cluster:
        yield local_cluster


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis_server.client(BROKER_DB)
    yield client
    client.close()


@pytest.fixture
def runs(redis_server: RedisServer) -> Runs:
    return Runs(redis_server.client(RECORD_DB))


AppFactory = Callable[..., Celery]


@pytest.fixture
def make_test_app(redis_server: RedisServer) -> Iterator[AppFactory]:
    """Build the test app: Redis broker and store on the private server by default."""
    apps: list[Celery] = []

    def factory(
        *,
        broker: str | None = None,
        conf: dict[str, Any] | None = None,
        queues: list[dict[str, Any]] | None = None,
    ) -> Celery:
        settings = {"zdelay_redis_url": f"{redis_server.url}/{BROKER_DB}", **(conf or {})}
        app = make_app(
            broker or f"{redis_server.url}/{BROKER_DB}",
            f"{redis_server.url}/{BACKEND_DB}",
            f"{redis_server.url}/{RECORD_DB}",
            conf=settings,
            queues=queues,
        )
        apps.append(app)
        return app

    yield factory
    # AsyncResults unsubscribe from the result backend when collected: let
    # them do it while Redis still runs, then close every connection.
    gc.collect()
    for app in apps:
        close_app(app)


@pytest.fixture
def app(make_test_app: AppFactory) -> Celery:
    return make_test_app()


@pytest.fixture
def store(app: Celery) -> Iterator[Store]:
    """The test app's store, as the admin reads, the CLI and the dashboard open it."""
    opened = Store(get_config(app))
    yield opened
    opened.close()


@pytest.fixture
def stocked(app: Celery) -> Stock:
    """The test app's store stocked with parked, overdue, in-flight and dead entries."""
    return stock(app)


@pytest.fixture
def processes() -> Iterator[list[CeleryProcess]]:
    """Celery subprocesses started by the test; all stopped at teardown."""
    started: list[CeleryProcess] = []
    yield started
    stop_all(started)


@pytest.fixture
def worker(processes: list[CeleryProcess]) -> Callable[..., CeleryProcess]:
    def start(
        app: Celery, *queues: str, env: dict[str, str] | None = None, pool: str = "solo"
    ) -> CeleryProcess:
        process = start_worker(app, *queues, env=env, pool=pool)
        processes.append(process)
        return process

    return start


@pytest.fixture
def companion(processes: list[CeleryProcess]) -> Callable[..., CeleryProcess]:
    def start(app: Celery, *args: str, env: dict[str, str] | None = None) -> CeleryProcess:
        process = start_companion(app, *args, env=env)
        processes.append(process)
        return process

    return start


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


@dataclass(frozen=True)
class RabbitMQ:
    url: str
    #: A queue name of this test's own (and ``<queue>-b``), deleted afterwards.
    queue: str


@pytest.fixture
def rabbitmq() -> Iterator[RabbitMQ]:
    """RabbitMQ's URL and a queue name of this test's own, deleted afterwards.

    Skips when RabbitMQ is absent, except in CI (CI=true), where it fails.
    """
    with Connection(RABBITMQ_URL) as probe:
        host, port = probe.hostname or "127.0.0.1", int(probe.port or 5672)
    if not _reachable(host, port):
        unavailable(
            f"RabbitMQ not reachable on {host}:{port}",
            in_ci=f"RabbitMQ is required in CI but {host}:{port} is unreachable",
        )
    queue = f"zdelay-test-{uuid.uuid4().hex[:10]}"
    yield RabbitMQ(RABBITMQ_URL, queue)
    with Connection(RABBITMQ_URL) as connection:
        for name in (queue, f"{queue}-b"):
            with contextlib.suppress(Exception):
                Queue(name).bind(connection.default_channel).delete()
