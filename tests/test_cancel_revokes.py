"""A cancel is a revoke wherever Celery users look.

Given a parked task, when it is cancelled (from Python or the CLI), then its
result says REVOKED as Celery's own ``revoke`` leaves it, the application's
receivers of ``tasks_cancelled`` hear of it (with who cancelled), and with
``task_send_sent_event`` a ``task-revoked`` event reaches the event exchange,
where Flower reads it. A result backend that is down fails no cancel.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.result import AsyncResult
from click.testing import CliRunner

import celery_zdelay
from celery_zdelay import signals
from celery_zdelay.cli import zdelay
from celery_zdelay.revocation import REVOKE_REASON
from tests.conftest import AppFactory

pytestmark = pytest.mark.timeout(60)


@contextlib.contextmanager
def _cancellations() -> Iterator[list[dict[str, Any]]]:
    heard: list[dict[str, Any]] = []

    def receiver(sender: Celery, task_ids: list[str], by: str | None, **_: Any) -> None:
        heard.append({"app": sender, "task_ids": list(task_ids), "by": by})

    signals.tasks_cancelled.connect(receiver, weak=False)
    try:
        yield heard
    finally:
        signals.tasks_cancelled.disconnect(receiver)


def test_a_cancelled_task_ends_revoked_in_the_result_backend(app: Celery) -> None:
    # Breaks if: record_revoked is not connected, or returns before writing.
    parked = app.tasks["tests.record"].apply_delayed((1,), countdown=3600)
    kept = app.tasks["tests.record"].apply_delayed((2,), countdown=3600)
    assert AsyncResult(parked.id, app=app).state == "PENDING"

    assert celery_zdelay.cancel(parked.id, app=app) is True

    result = AsyncResult(parked.id, app=app)
    assert result.state == "REVOKED"
    assert REVOKE_REASON in str(result.result)
    # Only what was cancelled: the other parked task is untouched.
    assert AsyncResult(kept.id, app=app).state == "PENDING"


def test_an_id_that_was_not_parked_is_not_marked(app: Celery) -> None:
    unknown = str(uuid.uuid4())
    with _cancellations() as heard:
        assert celery_zdelay.cancel(unknown, app=app) is False
    assert heard == []
    assert AsyncResult(unknown, app=app).state == "PENDING"


def test_receivers_hear_every_cancel_with_who_cancelled(app: Celery) -> None:
    record = app.tasks["tests.record"]
    one = record.apply_delayed(("one",), countdown=3600)
    many = [record.apply_delayed((n,), countdown=3600, queue="bulk") for n in range(3)]

    with _cancellations() as heard:
        celery_zdelay.cancel(one.id, app=app, by="support:alice")
        assert celery_zdelay.cancel_matching(queue="bulk", app=app) == 3

    assert heard[0] == {"app": app, "task_ids": [one.id], "by": "support:alice"}
    assert sorted(heard[1]["task_ids"]) == sorted(r.id for r in many)
    assert heard[1]["by"] is None
    assert all(AsyncResult(r.id, app=app).state == "REVOKED" for r in many)


def test_a_cancelled_chain_revokes_its_result_id_too(app: Celery) -> None:
    record = app.tasks["tests.record"]
    chained = celery_zdelay.apply_delayed(record.s(1) | record.si(2), countdown=3600, app=app)

    with _cancellations() as heard:
        assert celery_zdelay.cancel(chained.id, app=app) is True

    (event,) = heard
    # The chain's last task is the result the caller holds: it never runs either.
    assert chained.id in event["task_ids"]
    assert len(event["task_ids"]) == 2
    assert all(AsyncResult(i, app=app).state == "REVOKED" for i in event["task_ids"])


def test_a_cancel_from_the_cli_names_the_user(app: Celery) -> None:
    parked = app.tasks["tests.record"].apply_delayed((1,), countdown=3600)
    with _cancellations() as heard:
        outcome = CliRunner().invoke(zdelay, ["cancel", parked.id], obj=_cli_context(app))
    assert outcome.exit_code == 0, outcome.output
    (event,) = heard
    assert event["task_ids"] == [parked.id]
    assert event["by"] is not None
    assert event["by"].startswith("cli")


def test_a_task_revoked_event_is_sent_when_the_app_sends_task_events(
    make_test_app: AppFactory,
) -> None:
    # Breaks if: send_revoked_events ignores task_send_sent_event or is not connected.
    app = make_test_app(conf={"task_send_sent_event": True})
    parked = app.tasks["tests.record"].apply_delayed((1,), countdown=3600)
    with _Events(app) as events:
        assert celery_zdelay.cancel(parked.id, app=app) is True
        events.wait_for(lambda: events.of_type("task-revoked"), what="task-revoked")
    (event,) = events.of_type("task-revoked")
    assert event["uuid"] == parked.id
    assert event["terminated"] is False


def test_no_revoked_event_without_task_events(app: Celery) -> None:
    parked = app.tasks["tests.record"].apply_delayed((1,), countdown=3600)
    with _Events(app) as events:
        assert celery_zdelay.cancel(parked.id, app=app) is True
        # A second marker sent after the cancel: once it is back, anything
        # the cancel sent would be back too.
        events.seen.clear()
        events.wait_for(lambda: events._send_marker() and events._marked(), what="marker")
    assert events.of_type("task-revoked") == []


def test_a_result_backend_that_is_down_fails_no_cancel(
    app: Celery, make_test_app: AppFactory
) -> None:
    parked_id = app.tasks["tests.record"].apply_delayed((1,), countdown=3600).id
    # The same store and broker, but a result backend on a port that answers
    # nothing, without retries so that the test does not wait on them.
    cancelling = make_test_app(
        conf={
            "result_backend": "redis://127.0.0.1:1/0",
            "result_backend_transport_options": {"retry_policy": {"max_retries": 0}},
        }
    )
    with _cancellations() as heard:
        assert celery_zdelay.cancel(parked_id, app=cancelling) is True
    assert celery_zdelay.lookup(parked_id, app=app) is None
    assert heard[0]["task_ids"] == [parked_id]


def _cli_context(app: Celery) -> Any:
    from celery.bin.base import CLIContext

    return CLIContext(app=app, no_color=True, workdir=None, quiet=True)


class _Events:
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

    def __enter__(self) -> _Events:
        self._thread.start()
        # Subscribed once a marker sent now comes back: events sent after it
        # cannot be missed.
        self.wait_for(lambda: self._send_marker() and self._marked(), what="marker")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._receiver is not None:
            self._receiver.should_stop = True
        self._thread.join(timeout=5)

    def _send_marker(self) -> bool:
        with self.app.events.default_dispatcher() as dispatcher:
            dispatcher.send("task-marker", uuid="marker")
        return True

    def _marked(self) -> bool:
        return any(e.get("type") == "task-marker" for e in self.seen)

    def of_type(self, type_: str) -> list[dict[str, Any]]:
        return [e for e in self.seen if e.get("type") == type_]

    def wait_for(self, condition: Any, *, what: str, timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} event within {timeout_s} s: {self.seen}")
            time.sleep(0.05)
