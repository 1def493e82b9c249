"""A monitoring backend that hangs never loses, delays or fails a park or a release.

Given an events broker that accepts connections and never answers (a
loopback server that reads nothing), when tasks are parked with Celery's
``task_send_sent_event`` on, then the parks take what parking takes, a real
companion and worker release and run every task, and the events are dropped
with a warning within :data:`~celery_zdelay.events.SEND_TIMEOUT_S`; once
the broker answers again, events are sent again. Given an
OpenTelemetry exporter that never returns (behind the SDK's
``BatchSpanProcessor``) in the producer, then every task is parked at once
(the companion's side: ``test_tracing.py``).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

import celery_zdelay
from celery_zdelay import events, tracing
from celery_zdelay.testing import RedisServer
from tests.conftest import BROKER_DB, AppFactory
from tests.helpers import Runs, wait_for
from tests.project.otel import blocking_provider, trace_api_with
from tests.proxy import PausableProxy
from tests.support.events import EventsSeen

pytestmark = [pytest.mark.timeout(120), pytest.mark.timing]

#: What 20 parks may take on a loaded 2-core machine; one wait on the hanging
#: broker per park (a connect, SEND_TIMEOUT_S) would take far longer.
PARKS_BOUND_S = 2.0


class SilentServer:
    """A loopback TCP server that accepts connections and never reads or answers."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._stalled: list[socket.socket] = []
        self.accepted = threading.Event()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            self._stalled.append(client)
            self.accepted.set()

    def __enter__(self) -> SilentServer:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._listener.close()
        for client in self._stalled:
            client.close()


@pytest.fixture
def silent() -> Iterator[SilentServer]:
    with SilentServer() as server:
        yield server


def _park_timed(app: Celery, n: int) -> tuple[set[str], float]:
    record = app.tasks["tests.record"]
    started = time.monotonic()
    ids = {record.apply_delayed((i,), countdown=0.5).id for i in range(n)}
    return ids, time.monotonic() - started


@pytest.mark.parametrize(
    "broker", ["redis://127.0.0.1:{port}/0", "amqp://guest:guest@127.0.0.1:{port}//"]
)
def test_an_events_broker_that_hangs_delays_and_fails_no_park_or_release(
    broker: str,
    silent: SilentServer,
    make_test_app: AppFactory,
    worker: Any,
    companion: Any,
    runs: Runs,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Breaks if: the event connection has no socket timeouts (a Redis socket
    # waits for ever: the sender thread hangs, events are neither sent nor
    # dropped, and flush never returns), or events are sent inline.
    # The workers' app, on the real broker, and a producer whose broker
    # (where its events go; parking needs only the store) never answers.
    app = make_test_app()
    worker(app)
    companion(app)
    producer = make_test_app(
        broker=broker.format(port=silent.port), conf={"task_send_sent_event": True}
    )
    _park_timed(producer, 1)  # builds the store and the sender thread
    assert silent.accepted.wait(10), "the event sender never connected"
    with caplog.at_level(logging.WARNING, logger="celery_zdelay.events"):
        ids, elapsed = _park_timed(producer, 20)
        assert elapsed < PARKS_BOUND_S
        # Every event is sent or dropped within the bound: one connect or
        # one wait for the broker, then what waits behind it is dropped.
        started = time.monotonic()
        assert events.flush(producer, timeout_s=2 * events.SEND_TIMEOUT_S + 5)
        waited = time.monotonic() - started
    assert waited < 2 * events.SEND_TIMEOUT_S + 5
    assert "not sent" in caplog.text
    runs.wait_for_ids(ids)


def test_events_come_back_when_a_broker_that_hung_answers_again(
    app: Celery,
    redis_server: RedisServer,
    make_test_app: AppFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Breaks if: the sender thread stayed on the connection that hung, or
    # stopped after its first failure.
    with PausableProxy("127.0.0.1", redis_server.port) as proxy, EventsSeen(app) as seen:
        producer = make_test_app(
            broker=f"redis://127.0.0.1:{proxy.port}/{BROKER_DB}",
            conf={"task_send_sent_event": True},
        )
        record = producer.tasks["tests.record"]
        proxy.pause()
        with caplog.at_level(logging.WARNING, logger="celery_zdelay.events"):
            record.apply_delayed((1,), countdown=600)
            assert events.flush(producer, timeout_s=events.SEND_TIMEOUT_S + 5)
        assert "not sent" in caplog.text
        proxy.resume()
        back = record.apply_delayed((2,), countdown=600)
        seen.wait_for(
            lambda: back.id in {e["uuid"] for e in seen.of_type("task-sent")},
            what="task-sent once the broker answers again",
        )


def test_an_exporter_that_hangs_delays_no_park(
    app: Celery, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Breaks if: the park span were exported in the caller's thread (a
    # force_flush after span.end()): each park would wait on the exporter.
    called = tmp_path / "called"
    monkeypatch.setattr(tracing, "_trace_api", trace_api_with(blocking_provider(str(called))))
    _park_timed(app, 1)
    wait_for(lambda: "export zdelay.park" in _text(called), timeout=10, message="the export")
    ids, elapsed = _park_timed(app, 20)  # while the exporter hangs
    assert elapsed < PARKS_BOUND_S
    assert all(celery_zdelay.lookup(task_id, app=app) is not None for task_id in ids)
    assert _text(called).count("export") == 1  # still hanging in the first export


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""
