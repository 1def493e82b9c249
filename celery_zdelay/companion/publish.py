"""The generic path: publish released messages to any broker through kombu.

A message counts as published only once the broker has accepted it: on
RabbitMQ (py-amqp) by a publisher confirm, on Redis by the reply to the push.
Confirms are collected per batch, so a batch costs one round trip, not one
per message.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from celery.utils.time import maybe_iso8601
from kombu import Connection, Producer

from ..entry import TaskMessage

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["PublishOutcome", "Publisher", "make_publisher"]

logger = logging.getLogger(__name__)

#: Longest wait for the broker, in seconds, whatever the lease: a batch given
#: up on is handed back and retried.
MAX_BROKER_WAIT = 30.0


@dataclass
class PublishOutcome:
    """Which messages of a batch the broker accepted."""

    #: Indexes (into the batch) of the messages the broker accepted.
    accepted: list[int] = field(default_factory=list)
    #: Indexes of messages refused for good, with the reason (dead-letter them).
    rejected: dict[int, str] = field(default_factory=dict)
    #: Set when the broker could not be reached: the rest should wait.
    error: BaseException | None = None


class Publisher:
    """Publishes batches of task messages to the app's broker."""

    def __init__(self, app: Celery, *, broker_wait: float = MAX_BROKER_WAIT) -> None:
        self.app = app
        #: Seconds a batch may wait on the broker (connect, send, confirm).
        #: Kept under the lease, so a stalled broker never lets the lease
        #: lapse while this companion still means to publish the batch.
        self.broker_wait = min(broker_wait, MAX_BROKER_WAIT)
        self._connection: Connection | None = None
        self._producer: Producer | None = None

    @property
    def broker_url(self) -> str:
        return str(self.app.connection_for_write().as_uri())

    def publish(self, messages: Sequence[TaskMessage]) -> PublishOutcome:
        """Publish *messages*; report which the broker accepted."""
        outcome = PublishOutcome()
        try:
            producer = self._ensure_producer()
            self._publish_batch(producer, messages, outcome)
        except Exception as exc:
            if not self._is_connection_error(exc):
                raise
            logger.warning("Broker unreachable, %d messages wait: %r", len(messages), exc)
            outcome.accepted.clear()
            outcome.error = exc
            self.close()
        return outcome

    def close(self) -> None:
        """Drop the broker connection; the next batch opens a new one."""
        connection, self._connection, self._producer = self._connection, None, None
        if connection is not None:
            try:
                connection.close()
            except Exception:  # pragma: no cover - best effort on a dead socket
                logger.debug("Closing the broker connection failed", exc_info=True)

    # -- internals ------------------------------------------------------------

    def _ensure_producer(self) -> Producer:
        if self._producer is None:
            # No AMQP heartbeats: the companion may sleep for long stretches
            # without draining events; a dead connection is replaced on error.
            connection = self.app.connection_for_write(
                heartbeat=0, connect_timeout=self.broker_wait
            )
            connection.transport_options.pop("confirm_publish", None)
            # Redis brokers: a frozen server must time out, not hang forever.
            connection.transport_options.setdefault("socket_timeout", self.broker_wait)
            connection.ensure_connection(max_retries=1)
            self._connection = connection
            self._producer = Producer(connection.default_channel, auto_declare=False)
            self._on_connect(self._producer)
        return self._producer

    def _on_connect(self, producer: Producer) -> None:
        """Prepare a new channel (subclasses enable confirms)."""

    def _publish_batch(
        self, producer: Producer, messages: Sequence[TaskMessage], outcome: PublishOutcome
    ) -> None:
        batching = getattr(producer, "batch", None)
        if batching is not None and producer.supports_batch_publish:
            # kombu >= 5.7 pipelines the batch into one round trip (Redis).
            with batching(max_size=max(len(messages), 1)):
                sent = self._publish_each(producer, messages, outcome)
            outcome.accepted.extend(sent)
            return
        outcome.accepted.extend(self._publish_each(producer, messages, outcome))

    def _publish_each(
        self, producer: Producer, messages: Sequence[TaskMessage], outcome: PublishOutcome
    ) -> list[int]:
        """Hand each message to kombu; return the indexes handed over.

        A message kombu refuses by itself (not for want of a connection) is
        rejected, so it cannot hold up the others.
        """
        sent = []
        for index, message in enumerate(messages):
            try:
                self._publish_one(producer, message)
            except Exception as exc:
                if self._is_connection_error(exc):
                    raise
                outcome.rejected[index] = f"publish refused: {type(exc).__name__}: {exc}"
                continue
            sent.append(index)
        return sent

    def _publish_one(self, producer: Producer, message: TaskMessage) -> None:
        properties = dict(message.properties)
        properties.pop("expiration", None)
        expiration = _remaining_seconds(message.headers.get("expires"))
        producer.publish(
            message.body,
            exchange=message.exchange,
            routing_key=message.routing_key,
            content_type=message.content_type,
            content_encoding=message.content_encoding,
            headers=message.headers,
            priority=message.priority,
            declare=self._declare(message, producer),
            expiration=expiration,
            retry=False,
            timeout=self.broker_wait,
            **properties,
        )

    def _declare(self, message: TaskMessage, producer: Producer) -> list[Any]:
        """Return what to declare before publishing *message*, each once per channel.

        kombu remembers what it declared, but still copies every entity to
        find out: at thousands of messages a second that was a quarter of
        the generic path's time.
        """
        declared: set[str] = producer.__dict__.setdefault("_zdelay_declared", set())
        queues = self.app.amqp.queues
        wanted = []
        for name in message.declare:
            if name in declared:
                continue
            try:
                wanted.append(queues[name])
            except KeyError:
                logger.warning(
                    "Queue %s is not configured on this companion (task_queues) and "
                    "task_create_missing_queues is off; publishing without declaring it",
                    name,
                )
            declared.add(name)
        exchange = message.exchange
        if exchange and f"exchange:{exchange}" not in declared:
            # A message sent to an exchange by name (no queue): declare it as
            # the app's queues define it, so a fresh channel knows its type.
            declared.add(f"exchange:{exchange}")
            wanted += [q.exchange for q in queues.values() if q.exchange.name == exchange][:1]
        return wanted

    def _is_connection_error(self, exc: BaseException) -> bool:
        from kombu.exceptions import OperationalError

        if isinstance(exc, (OperationalError, ConnectionError, TimeoutError, OSError)):
            return True
        connection = self._connection
        if connection is None:
            return False
        errors = connection.recoverable_connection_errors + connection.connection_errors
        return isinstance(exc, errors)


class AmqpConfirmPublisher(Publisher):
    """RabbitMQ through py-amqp, with publisher confirms collected per batch."""

    def _on_connect(self, producer: Producer) -> None:
        channel = producer.channel
        channel.confirm_select()
        self._published = 0
        self._acked = 0
        self._late_acks: set[int] = set()
        self._nacked: set[int] = set()
        channel.events["basic_ack"].add(self._on_ack)
        channel.events["basic_nack"].add(self._on_nack)

    def _on_ack(self, delivery_tag: int, multiple: bool) -> None:
        # Publisher sequence numbers count from 1 on the channel; "multiple"
        # confirms everything up to the tag.
        if multiple:
            self._acked = max(self._acked, delivery_tag)
        elif delivery_tag == self._acked + 1:
            self._acked = delivery_tag
        else:
            self._late_acks.add(delivery_tag)
        while self._acked + 1 in self._late_acks:
            self._late_acks.discard(self._acked + 1)
            self._acked += 1

    def _on_nack(self, delivery_tag: int, multiple: bool) -> None:
        first = self._acked + 1 if multiple else delivery_tag
        self._nacked.update(range(first, delivery_tag + 1))
        self._on_ack(delivery_tag, multiple)

    def _publish_batch(
        self, producer: Producer, messages: Sequence[TaskMessage], outcome: PublishOutcome
    ) -> None:
        first = self._published + 1
        sequence: dict[int, int] = {}  # batch index -> publisher sequence number
        for index in self._publish_each(producer, messages, outcome):
            self._published += 1
            sequence[index] = self._published
        assert self._connection is not None
        deadline = time.monotonic() + self.broker_wait
        while self._acked < self._published:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"RabbitMQ confirmed {self._acked - first + 1} of {len(sequence)} "
                    f"messages within {self.broker_wait:g}s"
                )
            self._connection.drain_events(timeout=remaining)
        # A nacked message is not accepted: it is given back and retried.
        outcome.accepted.extend(i for i, seq in sequence.items() if seq not in self._nacked)
        self._nacked.clear()


def make_publisher(app: Celery, *, lease_ms: int) -> Publisher:
    """Return the publisher for *app*'s broker, waiting at most half a lease."""
    transport = app.connection_for_write().transport
    publisher = Publisher
    if transport.driver_type == "amqp" and transport.driver_name == "amqp":
        publisher = AmqpConfirmPublisher
    return publisher(app, broker_wait=lease_ms / 2000)


def _remaining_seconds(expires: Any) -> float | None:
    """Return the seconds left until the ISO 8601 *expires*, at least 0."""
    if not expires:
        return None
    try:
        when = maybe_iso8601(expires)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    remaining: float = (when - datetime.now(timezone.utc)).total_seconds()
    return max(0.0, remaining)
