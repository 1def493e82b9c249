"""Celery events for parked work, so Flower and event consumers see it.

With Celery's own ``task_send_sent_event`` on (off by default, as in Celery:
each event costs a publish), celery-zdelay announces what it holds with the
standard event types, which Flower understands without a plugin:

- a parked task is a ``task-sent`` event with its ``eta`` (the due time),
  sent after the park succeeded, never for a call that was not parked;
- a rescheduled task is ``task-sent`` again, with its new ``eta`` (Flower
  replaces the eta of a task still pending) and ``zdelay="rescheduled"``;
- a cancelled task is ``task-revoked``, as Celery's ``revoke`` reports it
  (also one a keyed call's ``replace`` or ``debounce`` took out);
- a dead-lettered task is ``task-rejected`` (its message was refused and
  not requeued), with the reason as an extra ``reason`` field.

A released task needs nothing from here: the worker that receives it sends
``task-received``, ``task-started`` and ``task-succeeded`` as usual.

Events never delay or fail a park, a cancel or a release: they are handed to
one background thread per process, which publishes them on a connection of
its own, and dropped (with a warning) when the broker cannot take them, does
not answer within :data:`SEND_TIMEOUT_S`, or too many are waiting. Each
event type is sent by a receiver of the library's own signals.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from . import signals
from .app_state import cached, value

if TYPE_CHECKING:
    from celery import Celery
    from kombu import Connection

    from .entry import TaskMessage

__all__ = ["MAX_PENDING_EVENTS", "SEND_TIMEOUT_S", "connect_receivers", "flush"]

logger = logging.getLogger(__name__)

#: Events waiting for the sender thread; beyond this they are dropped, so a
#: broker that is down never grows a producer's memory.
MAX_PENDING_EVENTS = 10_000

#: Seconds the sender thread keeps its broker connection open when idle.
_IDLE_CLOSE_S = 2.0

#: Seconds a process waits at exit for its queued events.
_EXIT_FLUSH_S = 3.0

#: Seconds the sender thread waits on the broker, for a connect or for one
#: event, before it gives up and drops what waits: a broker that accepts
#: connections and never answers would otherwise hold the thread for ever
#: (a Redis socket has no timeout by default), and every later event with it.
SEND_TIMEOUT_S = 5.0

#: The transport options that bound each socket wait, by kombu transport.
_TIMEOUT_OPTIONS = {
    "amqp": ("read_timeout", "write_timeout"),
    "redis": ("socket_timeout", "socket_connect_timeout"),
}


def connect_receivers() -> None:
    """Connect the event receivers to celery-zdelay's signals (idempotent)."""
    signals.tasks_parked.connect(
        announce_parked, weak=False, dispatch_uid="celery_zdelay.events.parked"
    )
    signals.tasks_cancelled.connect(
        announce_cancelled, weak=False, dispatch_uid="celery_zdelay.events.cancelled"
    )
    signals.tasks_rescheduled.connect(
        announce_rescheduled, weak=False, dispatch_uid="celery_zdelay.events.rescheduled"
    )
    signals.task_dead_lettered.connect(
        announce_dead_lettered, weak=False, dispatch_uid="celery_zdelay.events.dead"
    )


def announce_parked(
    sender: Celery, messages: Sequence[TaskMessage], due_ms: Sequence[int], **_: Any
) -> None:
    """Send ``task-sent`` for each parked message, its ``eta`` the due time."""
    if not sender.conf.task_send_sent_event:
        return
    for message, ms in zip(messages, due_ms, strict=True):
        headers = message.headers
        _sender_for(sender).put(
            "task-sent",
            {
                "uuid": message.task_id,
                "root_id": headers.get("root_id"),
                "parent_id": headers.get("parent_id"),
                "name": message.task_name,
                "args": headers.get("argsrepr"),
                "kwargs": headers.get("kwargsrepr"),
                "retries": headers.get("retries"),
                "eta": _iso(ms),
                "expires": headers.get("expires"),
                "queue": message.routing_key,
                "exchange": message.exchange,
                "routing_key": message.routing_key,
                "zdelay": "parked",
            },
        )


def announce_rescheduled(
    sender: Celery, task_ids: Sequence[str], due_ms: Sequence[int], **_: Any
) -> None:
    """Send ``task-sent`` again for each moved id, its ``eta`` the new due time.

    Only the id and the new eta: an event consumer (Flower) keeps what the
    first ``task-sent`` told of the task and takes the new eta over it.
    """
    if not sender.conf.task_send_sent_event:
        return
    for task_id, ms in zip(task_ids, due_ms, strict=True):
        _sender_for(sender).put(
            "task-sent", {"uuid": task_id, "eta": _iso(ms), "zdelay": "rescheduled"}
        )


def announce_cancelled(sender: Celery, task_ids: Sequence[str], **_: Any) -> None:
    """Send ``task-revoked`` for each cancelled id."""
    if not sender.conf.task_send_sent_event:
        return
    for task_id in task_ids:
        _sender_for(sender).put(
            "task-revoked",
            {"uuid": task_id, "terminated": False, "signum": None, "expired": False},
        )


def announce_dead_lettered(sender: Any, task_id: str, reason: str, **_: Any) -> None:
    """Send ``task-rejected`` for an entry the companion dead-lettered."""
    app = getattr(sender, "app", None)
    if app is None or not app.conf.task_send_sent_event:
        return
    _sender_for(app).put("task-rejected", {"uuid": task_id, "requeue": False, "reason": reason})


def _iso(ms: int) -> str:
    """A due time in ms as the ISO 8601 UTC text Celery events carry."""
    return datetime.fromtimestamp(ms / 1000, timezone.utc).isoformat()


def flush(app: Celery, timeout_s: float = 5.0) -> bool:
    """Wait until the events of *app* handed over so far were sent or dropped.

    Return False on timeout. It runs at exit too (up to 3 s), so a short
    process (``zdelay cancel``) does not leave its events unsent.
    """
    sender: _Sender | None = value(app, "event_sender")
    if sender is None or sender.pid != os.getpid():
        return True
    return sender.flush(timeout_s)


def _sender_for(app: Celery) -> _Sender:
    # A forked process (a prefork web server) has no thread of its parent.
    return cached(
        app, "event_sender", lambda: _Sender(app), valid=lambda sender: sender.pid == os.getpid()
    )


def _bounded(connection: Connection) -> Connection:
    """Make *connection* give up on a broker silent for :data:`SEND_TIMEOUT_S`.

    Only the events' own connection: the app's broker options stay as they
    are for its tasks. A transport without such options (SQS over HTTP) keeps
    its own timeouts, still off the callers' threads.
    """
    for option in _TIMEOUT_OPTIONS.get(connection.transport.driver_type, ()):
        connection.transport_options[option] = SEND_TIMEOUT_S
    return connection


class _Sender:
    """One thread per app and process that publishes queued events."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.pid = os.getpid()
        self.pending: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue(MAX_PENDING_EVENTS)
        self._dropped = 0
        self._thread = threading.Thread(target=self._run, name="zdelay-events", daemon=True)
        self._thread.start()
        # A short process (``zdelay cancel``, a script) sends what it queued
        # before it exits, within a bound.
        atexit.register(self.flush, _EXIT_FLUSH_S)

    def put(self, type_: str, fields: dict[str, Any]) -> None:
        try:
            self.pending.put_nowait((type_, fields))
        except queue.Full:
            self._drop(type_, fields.get("uuid"), "too many events waiting")

    def flush(self, timeout_s: float) -> bool:
        done = threading.Event()
        # A sentinel queued behind every event handed over so far.
        self.pending.put(("", {"flushed": done}))
        return done.wait(timeout_s)

    def _run(self) -> None:
        while True:
            item = self.pending.get()
            try:
                self._send_until_idle(item)
            except Exception as exc:  # the broker is gone: drop, never raise
                self._drop(item[0], item[1].get("uuid"), repr(exc))
                # What waits now would meet the same broker: drop it too,
                # rather than try a connect per event.
                self._drop_pending(repr(exc))

    def _drop_pending(self, why: str) -> None:
        while True:
            try:
                item = self.pending.get_nowait()
            except queue.Empty:
                return
            if not self._flushed(item):
                self._drop(item[0], item[1].get("uuid"), why)

    def _send_until_idle(self, item: tuple[str, dict[str, Any]]) -> None:
        if self._flushed(item):
            return
        with _bounded(self.app.connection_for_write(connect_timeout=SEND_TIMEOUT_S)) as connection:
            # One connect, no retry: what waits meanwhile is dropped if it fails.
            connection.ensure_connection(max_retries=0)
            dispatcher = self.app.events.Dispatcher(connection, buffer_while_offline=False)
            try:
                while True:
                    type_, fields = item
                    if not self._flushed(item):
                        dispatcher.send(type_, **fields)
                    try:
                        item = self.pending.get(timeout=_IDLE_CLOSE_S)
                    except queue.Empty:
                        return
            finally:
                dispatcher.close()

    @staticmethod
    def _flushed(item: tuple[str, dict[str, Any]]) -> bool:
        marker = item[1].get("flushed") if not item[0] else None
        if isinstance(marker, threading.Event):
            marker.set()
            return True
        return False

    def _drop(self, type_: str, task_id: Any, why: str) -> None:
        self._dropped += 1
        # One line per power of two dropped: a broker outage does not flood the log.
        if self._dropped & (self._dropped - 1) == 0:
            logger.warning(
                "Celery event %s for %s not sent (%s); %d dropped so far. Parking and "
                "releasing are not affected; check the broker connection.",
                type_,
                task_id,
                why,
                self._dropped,
                extra={"task_id": task_id},
            )
