"""Celery task events as Flower receives them, for tests that count what was announced."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from celery import Celery

from celery_zdelay import events

__all__ = ["EventsSeen"]


class EventsSeen:
    """Task events as Flower receives them: Celery's event Receiver, in a thread."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.seen: list[dict[str, Any]] = []
        self._receiver: Any = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with self.app.connection_for_read() as connection:
            self._receiver = self.app.events.Receiver(
                connection, handlers={"*": self.seen.append}, node_id=uuid.uuid4().hex
            )
            # No timeout: the loop ends when __exit__ sets should_stop.
            for _ in self._receiver.consume(limit=None, timeout=None, safety_interval=0.2):
                pass

    def __enter__(self) -> EventsSeen:
        self._thread.start()
        # Subscribed once a marker sent now comes back: what is sent after it
        # cannot be missed.
        self.wait_for(self.marker_back, what="marker")
        self.seen.clear()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._receiver is not None:
            self._receiver.should_stop = True
        self._thread.join(timeout=5)

    def marker_back(self) -> bool:
        """Send a marker event; return whether one came back."""
        with self.app.events.default_dispatcher() as dispatcher:
            dispatcher.send("task-marker", uuid="marker")
        return bool(self.of_type("task-marker"))

    def of_type(self, type_: str) -> list[dict[str, Any]]:
        return [e for e in self.seen if e.get("type") == type_]

    def wait_for(self, condition: Any, *, what: str, timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} event within {timeout_s} s: {self.seen}")
            time.sleep(0.05)

    def settle(self) -> None:
        """Wait until everything handed to the sender thread so far went out."""
        assert events.flush(self.app)
        self.seen.clear()
        self.wait_for(self.marker_back, what="marker")
