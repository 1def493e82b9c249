"""The companion's signals: a receiver that raises is logged and survived.

docs/operations.rst and :mod:`celery_zdelay.signals` promise it: receivers
run inside the release loop, and one that raises must not stop releases,
dead letters, the other receivers or the companion itself.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery.utils.dispatch import Signal

from celery_zdelay import signals
from celery_zdelay.companion import Companion
from celery_zdelay.config import get_config
from celery_zdelay.store import Store
from tests.conftest import AppFactory
from tests.helpers import wait_for
from tests.support.store import put_raw

pytestmark = pytest.mark.timeout(60)

EVERY_SIGNAL = [
    signals.companion_started,
    signals.batch_claimed,
    signals.batch_released,
    signals.task_dead_lettered,
    signals.companion_stopped,
]


class Receivers:
    """A receiver that raises, then one that counts, on every signal."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {s.name: 0 for s in EVERY_SIGNAL}
        self.released = 0
        self.lock = threading.Lock()

    def raises(self, signal: Signal, **_: Any) -> None:
        raise RuntimeError(f"receiver of {signal.name} is broken")

    def counts(self, signal: Signal, count: int = 0, **_: Any) -> None:
        with self.lock:
            self.calls[signal.name] += 1
            if signal is signals.batch_released:
                self.released += count


@pytest.fixture
def receivers() -> Iterator[Receivers]:
    connected = Receivers()
    for signal in EVERY_SIGNAL:
        signal.connect(connected.raises, weak=False)
        signal.connect(connected.counts, weak=False)
    yield connected
    for signal in EVERY_SIGNAL:
        signal.disconnect(connected.raises)
        signal.disconnect(connected.counts)


@pytest.mark.parametrize("path", ["handoff", "generic"])
def test_a_receiver_that_raises_is_logged_and_the_companion_carries_on(
    make_test_app: AppFactory,
    redis_server: Any,
    receivers: Receivers,
    caplog: pytest.LogCaptureFixture,
    path: str,
) -> None:
    # Given a receiver that raises on every signal (and, after it, one that counts)
    broker_db = 0 if path == "handoff" else 3
    app = make_test_app(broker=f"{redis_server.url}/{broker_db}")
    broker: redis.Redis = redis_server.client(broker_db)
    store = Store(get_config(app))
    caplog.set_level(logging.ERROR, logger="celery_zdelay")
    record = app.tasks["tests.record"]

    # When a companion runs while 20 tasks and a damaged entry fall due
    companion = Companion(app, store=store)
    crashed: list[BaseException] = []

    def run() -> None:
        try:
            companion.run()
        except BaseException as exc:  # surfaced below
            crashed.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        ids = [record.apply_delayed((i,), countdown=0.2).id for i in range(20)]
        put_raw(store, "damaged-1", b"not a celery-zdelay payload", due_in_ms=0)

        # Then every task reaches the broker and the damaged entry is
        # dead-lettered, while the companion keeps running
        wait_for(lambda: broker.llen("celery") == len(ids), message="20 tasks in the broker")
        wait_for(
            lambda: store.client.zcard(store.keys(0).dead) == 1, message="1 dead-lettered entry"
        )
        assert thread.is_alive(), crashed
        assert store.client.zcard(store.keys(0).due) == 0
    finally:
        companion.stop()
        thread.join(timeout=30)
        store.close()

    # And it stopped when asked, not before, and not by an exception
    assert not thread.is_alive()
    assert crashed == []
    # And the receivers after the broken one saw every signal
    assert receivers.released == len(ids)
    assert all(receivers.calls.values()), receivers.calls
    # And each failure was logged, naming the signal
    failed = {
        logged.args[0]
        for logged in caplog.records
        if isinstance(logged.args, tuple) and logged.msg.startswith("celery-zdelay signal %s")
    }
    assert failed == {s.name for s in EVERY_SIGNAL}
