"""Capture the exact messages Celery publishes, without publishing them.

``apply_async`` accepts a ``producer=``: Celery builds the message, routes
it, runs ``before_task_publish`` (so tracing headers are added), serializes
and compresses it, and hands it to that producer. :class:`CapturingProducer`
is a kombu producer that keeps what it is handed instead of sending it, so
the parked message is Celery's own, not a copy of Celery's logic. (Chains
and chords do not pass ``producer=`` on to the tasks they publish first, so
:func:`capture` also routes the app's ``producer_or_acquire`` to it.)

Celery's send path sends ``after_task_publish`` right after the producer
takes the message. A captured message is not published, and may never be
parked (the store refuses it, a ``batch()`` block raises, a transaction
rolls back), so that signal is silenced for each message the capturing
producer takes: its arguments stay with the message
(:class:`CapturedMessage`), and :func:`announce_parked` sends it once the
store has parked it. ``before_task_publish`` runs where Celery runs it: its
receivers may change the headers, and the parked message has their changes.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from celery import signals
from kombu import Connection, Producer, Queue

from .app_state import cached, set_value, value
from .entry import TaskMessage
from .errors import ConfigurationError

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["CapturedMessage", "CapturingProducer", "announce_parked", "capture"]

R = TypeVar("R")


@dataclass
class CapturedMessage(TaskMessage):
    """A task message taken by a :class:`CapturingProducer`, with its silenced signal."""

    #: The arguments of the ``after_task_publish`` Celery sent for it, kept
    #: until it is parked (:func:`announce_parked`); None once sent.
    announcement: dict[str, Any] | None = field(default=None, repr=False, compare=False)


class CapturingProducer(Producer):  # type: ignore[misc]
    """A kombu producer that records messages instead of sending them.

    It never connects to the broker, unless a result backend asks for its
    channel (the RPC backend declares its reply queue on it).
    """

    def __init__(self, connection: Connection, event_exchange: str | Callable[[], str]) -> None:
        super().__init__(None, auto_declare=False)
        # kombu's name for "the connection this producer belongs to".
        self.__connection__ = connection
        #: The events exchange, or a function that reads it: looked up only
        #: for a message sent to a named exchange (a task message on the
        #: default exchange, the common case, is never an event).
        self._event_exchange = event_exchange
        #: Task messages captured, in publish order.
        self.messages: list[CapturedMessage] = []

    def _get_channel(self) -> Any:
        if self._channel is None:  # type: ignore[has-type]
            self._channel = self.__connection__.default_channel
        return super()._get_channel()

    channel = property(_get_channel, Producer._set_channel)

    def publish(self, body: Any, routing_key: Any = None, *args: Any, **kwargs: Any) -> Any:
        taken = len(self.messages)
        result = super().publish(body, routing_key, *args, **kwargs)
        if len(self.messages) > taken:
            message = self.messages[-1]
            # What Celery's send path passes to after_task_publish, which it
            # sends next, for this message: that send is silenced
            # (_silence_after_publish) and made by announce_parked instead.
            message.announcement = {
                "sender": message.task_name,
                "body": body,
                "headers": kwargs.get("headers"),
                "exchange": kwargs.get("exchange"),
                "routing_key": routing_key,
            }
            _silenced.set(message.task_name)
        return result

    def _events_exchange(self) -> str:
        if callable(self._event_exchange):
            self._event_exchange = self._event_exchange()
        return self._event_exchange

    def _publish(
        self,
        body: bytes | str,
        priority: int | None,
        content_type: str,
        content_encoding: str,
        headers: dict[str, Any],
        properties: dict[str, Any],
        routing_key: str,
        mandatory: bool,
        immediate: bool,
        exchange: str,
        declare: list[Any],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        is_task = "id" in headers and "task" in headers
        # A task message on the default exchange is no event: the setting
        # is read only for the others.
        if (exchange or not is_task) and exchange == self._events_exchange():
            # A task-sent event (task_send_sent_event): it would describe a
            # publish that has not happened, so it is not parked or sent.
            return
        if not is_task:
            raise ConfigurationError(
                "celery-zdelay parks task protocol 2 messages only; "
                "remove task_protocol = 1 from the Celery configuration."
            )
        if isinstance(body, str):
            # kombu's json serializer returns text; transports send it as UTF-8.
            body = body.encode("utf-8")
        self.messages.append(
            CapturedMessage(
                body=body,
                content_type=content_type,
                content_encoding=content_encoding,
                headers=headers,
                properties={k: v for k, v in properties.items() if k != "delivery_info"},
                priority=int(priority or 0),
                exchange=exchange,
                routing_key=routing_key,
                declare=[entity.name for entity in declare if isinstance(entity, Queue)],
            )
        )


def capture(app: Celery, send: Callable[[CapturingProducer], R]) -> tuple[R, list[TaskMessage]]:
    """Run *send* with a capturing producer; return its result and the messages.

    *send* calls Celery's own publishing API with ``producer=`` set, e.g.
    ``lambda p: task.apply_async(args, producer=p)``. Serialization errors
    (``kombu.exceptions.EncodeError``) propagate before anything is parked.

    Not every canvas passes ``producer=`` on: a chain (and a chord) publishes
    its first tasks with a producer from ``app.producer_or_acquire()``. So
    while *send* runs, that method of *app* hands out the capturing producer
    too, in this thread or task only.
    """
    producer = CapturingProducer(_lazy_connection(app), lambda: str(app.conf.event_exchange))
    _route_acquired_producers(app)
    _silence_after_publish()
    token = _capturing.set((app, producer))
    silenced = _silenced.set(None)
    try:
        result = send(producer)
    finally:
        _silenced.reset(silenced)
        _capturing.reset(token)
    return result, list(producer.messages)


def announce_parked(messages: Iterable[TaskMessage | None]) -> None:
    """Send ``after_task_publish`` for captured *messages* the store has parked, once each.

    Call it only after the park succeeded: receivers (audit rows, "scheduled"
    flags, metrics, traces) learn of a task that is parked, never of one that
    is not. A receiver's error is logged by Celery and changes nothing.
    """
    for message in messages:
        if isinstance(message, CapturedMessage) and message.announcement is not None:
            announcement, message.announcement = message.announcement, None
            signals.after_task_publish.send(**announcement)


#: The task name whose next ``after_task_publish`` is silenced: the message
#: a capturing producer just took, in this thread or task.
_silenced: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "celery_zdelay_silenced_signal", default=None
)
_silencing = threading.Lock()


def _silence_after_publish() -> None:
    """Make ``after_task_publish`` skip the message a capturing producer just took.

    Celery's sender binds ``after_task_publish.send`` when an app first
    builds it, so the signal's own receiver lookup is the one place that
    sees every send, whenever the app was made. Every other send (a real
    publish, another thread) reaches every receiver as before.
    """
    signal = signals.after_task_publish
    if getattr(signal, "_zdelay_silences", False):
        return
    with _silencing:
        if getattr(signal, "_zdelay_silences", False):
            return
        live_receivers = signal._live_receivers

        def _live_receivers(sender: Any) -> Any:
            if sender is not None and _silenced.get() == sender:
                _silenced.set(None)
                return []
            return live_receivers(sender)

        signal._live_receivers = _live_receivers
        signal._zdelay_silences = True


#: The app being captured in this context, and its capturing producer.
_capturing: contextvars.ContextVar[tuple[Any, CapturingProducer] | None] = contextvars.ContextVar(
    "celery_zdelay_capturing", default=None
)


def _route_acquired_producers(app: Celery) -> None:
    """Make ``app.producer_or_acquire`` return the capturing producer during a capture."""
    if value(app, "routes_producers"):
        return
    acquire = app.producer_or_acquire

    def producer_or_acquire(producer: Any = None) -> Any:
        current = _capturing.get()
        if current is not None and current[0] is app:
            return contextlib.nullcontext(current[1])
        return acquire(producer)

    # An attribute of this app only: other apps, and this app outside a
    # capture, acquire producers from the pool as before.
    app.producer_or_acquire = producer_or_acquire
    set_value(app, "routes_producers", True)


def _lazy_connection(app: Celery) -> Connection:
    # One kombu Connection per app, never connected by capturing: creating a
    # kombu Connection is not free, and producers may park while the broker
    # itself is down.
    connection: Connection = cached(app, "capture_connection", app.connection_for_write)
    return connection
