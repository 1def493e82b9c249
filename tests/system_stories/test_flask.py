"""The Flask pattern of the documentation, run as its users run it.

``docs/examples/flask`` is an app factory with Celery and celery-zdelay: a
shop whose unpaid orders are cancelled after ``ORDER_TIMEOUT`` seconds. Given
that app on a real Redis, with ``celery -A make_celery worker`` and ``celery
-A make_celery zdelay`` running, an order left unpaid is cancelled by a task
parked when it was created, and paying an order cancels its parked task.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis
from flask import Flask
from flask.testing import FlaskClient

from celery_zdelay.testing import RedisServer
from tests.helpers import wait_for
from tests.project import close_app
from tests.support.keys import SHARD0

pytestmark = pytest.mark.timeout(90)

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "flask"
DUE = SHARD0.due


@pytest.fixture
def shop_env(redis_server: RedisServer, tmp_path: Path) -> dict[str, str]:
    """The environment both the web app and its Celery processes read."""
    return {
        "FLASK_DATABASE": str(tmp_path / "shop.sqlite3"),
        "FLASK_ORDER_TIMEOUT": "2",
        "FLASK_CELERY__broker_url": f"{redis_server.url}/0",
        "FLASK_CELERY__result_backend": f"{redis_server.url}/1",
    }


@pytest.fixture
def shop(shop_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The example's module; its create_app() reads the FLASK_* environment."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    for name, value in shop_env.items():
        monkeypatch.setenv(name, value)
    # Imported once per process: its @shared_task registers with every app
    # finalized afterwards, and a second import would register it twice.
    return importlib.import_module("shop")


@pytest.fixture
def flask_app(shop: ModuleType) -> Iterator[Flask]:
    app: Flask = shop.create_app()
    # Shared tasks resolve against the current app; this test run has many.
    app.extensions["celery"].set_current()
    yield app
    close_app(app.extensions["celery"])


@pytest.fixture
def client(flask_app: Flask) -> FlaskClient:
    return flask_app.test_client()


@pytest.fixture
def celery_cli(shop_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """Start ``celery -A make_celery <args>`` in the example's directory."""
    started: list[subprocess.Popen[bytes]] = []

    def start(*args: str, ready: str) -> Path:
        log_path = tmp_path / f"celery-{len(started)}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "make_celery", *args],
                cwd=EXAMPLE,
                env={**os.environ, **shop_env, "PYTHONPATH": str(EXAMPLE), "C_FORCE_ROOT": "1"},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        started.append(process)

        def is_ready() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"celery {args[0]} exited:\n{log_path.read_text()[-3000:]}")
            return ready in log_path.read_text(errors="replace")

        wait_for(is_ready, timeout=30, message=lambda: log_path.read_text()[-3000:])
        return log_path

    yield start
    for process in started:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def _status(client: FlaskClient, order_id: int) -> str:
    body: dict[str, Any] = client.get(f"/orders/{order_id}").get_json()
    return str(body["status"])


def test_an_unpaid_order_is_cancelled_and_a_paid_one_keeps_its_payment(
    client: FlaskClient,
    celery_cli: Callable[..., Path],
    redis_client: redis.Redis,
) -> None:
    celery_cli(
        "worker",
        "-P",
        "solo",
        "-l",
        "INFO",
        "--without-gossip",
        "--without-mingle",
        ready=" ready.",
    )
    celery_cli("zdelay", "-l", "INFO", ready=" started: ")

    unpaid = client.post("/orders").get_json()
    paid = client.post("/orders").get_json()

    assert redis_client.zscore(DUE, unpaid["timer"]) is not None
    assert client.post(f"/orders/{paid['id']}/pay").get_json() == {
        "id": paid["id"],
        "status": "paid",
        "timer_cancelled": True,
    }
    assert redis_client.zscore(DUE, paid["timer"]) is None
    wait_for(
        lambda: _status(client, unpaid["id"]) == "cancelled",
        timeout=30,
        message="the unpaid order to be cancelled",
    )
    assert _status(client, paid["id"]) == "paid"


def test_a_task_runs_at_once_under_task_always_eager(
    shop: ModuleType, redis_client: redis.Redis
) -> None:
    app = shop.create_app({"ORDER_TIMEOUT": 1800})
    celery_app = app.extensions["celery"]
    celery_app.set_current()
    celery_app.conf.task_always_eager = True
    try:
        client = app.test_client()
        order = client.post("/orders").get_json()
        assert _status(client, order["id"]) == "cancelled"
        assert redis_client.zcard(DUE) == 0
    finally:
        close_app(celery_app)
