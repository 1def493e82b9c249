"""The publisher for brokers with publisher confirms (RabbitMQ).

A message counts as published only once the broker acked it. Confirms are
collected per batch, so a batch costs one round trip, not one per message.
Everything a message needs (its queues, its exchange) is declared or checked
before the batch is published, so a channel error is blamed on the message
that caused it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from kombu import Exchange, Producer

from ...entry import TaskMessage
from .generic import MAX_BROKER_WAIT, Publisher, PublishOutcome, warn_undeclared

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["ConfirmPublisher", "Confirms", "supports_confirms"]

logger = logging.getLogger(__name__)


class ConfirmPublisher(Publisher):
    """A broker with publisher confirms (RabbitMQ): nothing counts before its ack.

    Before a batch is published, what each message needs is declared (its
    queues) or checked to exist (an exchange it names); a channel error there
    names its message, which is rejected, and a new channel takes over. Then
    the batch is published and its confirms awaited: a nack gives the message
    back to the store; no answer within the broker wait gives back every
    unconfirmed message of the batch.

    Messages go out "mandatory": RabbitMQ acks, and drops, a message that no
    queue is bound for, but returns a mandatory one first. A returned message
    is given back and its queues declared again on the next pass (someone
    deleted one); returned again, or with no queue of the app's to declare,
    it is dead-lettered as unroutable.
    """

    mandatory = True

    def __init__(self, app: Celery, *, broker_wait: float = MAX_BROKER_WAIT) -> None:
        super().__init__(app, broker_wait=broker_wait)
        #: Entity names declared or found on the broker since this connection opened.
        self._present: set[str] = set()
        #: Task id -> why, for messages the broker returned in the batch in hand.
        self._returned: dict[str, str] = {}
        #: Task ids returned in an earlier batch, given back to be published again.
        self._returned_before: set[str] = set()

    def _ensure_producer(self) -> Producer:
        if self._producer is None:
            self._present.clear()
        return super()._ensure_producer()

    def _open_producer(self) -> Producer:
        assert self._connection is not None
        channel = self._connection.channel()
        channel.confirm_select()
        self._confirms = Confirms()
        channel.events["basic_ack"].add(self._confirms.on_ack)
        channel.events["basic_nack"].add(self._confirms.on_nack)
        channel.events["basic_return"].add(self._on_return)
        return Producer(channel, auto_declare=False)

    def _on_return(self, exc: Exception, exchange: str, routing_key: str, message: Any) -> None:
        # RabbitMQ sends the return before the message's ack.
        task_id = str((getattr(message, "headers", None) or {}).get("id", ""))
        self._returned[task_id] = (
            f"unroutable: RabbitMQ returned it ({exc}): no queue is bound for routing key "
            f"{routing_key!r} on exchange {exchange!r}. Declare the queue (task_queues) or "
            "fix the task's route, then requeue this entry"
        )

    def _reopen_channel(self) -> Producer:
        """Replace a channel the broker closed (the connection stays)."""
        old = self._producer
        self._producer = None
        if old is not None:
            try:
                old.channel.close()
            except Exception:
                logger.debug("Closing a failed channel failed", exc_info=True)
        self._producer = self._open_producer()
        return self._producer

    def _declare(self, message: TaskMessage, producer: Producer) -> list[Any]:
        return []  # done by _prepare, message by message, before the batch

    def _publish_batch(
        self, producer: Producer, messages: Sequence[TaskMessage], outcome: PublishOutcome
    ) -> None:
        producer, ready = self._prepare(producer, messages, outcome)
        confirms = self._confirms
        sequence: dict[int, int] = {}  # batch index -> publisher sequence number
        try:
            with self._batched_io():
                for index in self._publish_each(producer, messages, outcome, ready, sent=[]):
                    sequence[index] = confirms.next()
            self._await_confirms(len(sequence))
        except Exception as exc:
            if self._is_channel_error(exc):
                # Everything was checked first, so this is a race (an exchange
                # deleted meanwhile): what was confirmed is kept, the rest is
                # given back, unpublished for all this companion can tell.
                exc = TimeoutError(f"RabbitMQ closed the channel mid-batch: {exc!r}")
            raise exc from None
        finally:
            # Only what the broker acked counts; a nacked message is given back.
            for index, seq in sequence.items():
                if not confirms.accepted(seq):
                    continue
                if not self._note_returned(messages[index], index, outcome):
                    outcome.accepted.append(index)
            confirms.forget_settled()
            self._returned.clear()

    def _note_returned(self, message: TaskMessage, index: int, outcome: PublishOutcome) -> bool:
        """Whether the broker returned *message*: then give it back, or reject it."""
        task_id = message.task_id
        why = self._returned.get(task_id)
        if why is None:
            self._returned_before.discard(task_id)
            return False
        queues = [f"queue:{name}" for name in message.declare]
        if task_id in self._returned_before or not queues:
            self._returned_before.discard(task_id)
            outcome.rejected[index] = why
        else:
            # Its queue was deleted since this channel declared it: declare
            # it again on the next pass, and publish the message then.
            logger.warning("RabbitMQ returned %s, its queue is gone: declaring it again", task_id)
            self._present.difference_update(queues)
            self._returned_before.add(task_id)
        return True

    def _prepare(
        self, producer: Producer, messages: Sequence[TaskMessage], outcome: PublishOutcome
    ) -> tuple[Producer, list[int]]:
        """Declare or check what each message needs; return the ready indexes."""
        ready = []
        missing: dict[str, str] = {}  # entity name -> why, for this batch only
        for index, message in enumerate(messages):
            refusal = None
            for name, entity in self._entities(message):
                if name in self._present:
                    continue
                if name not in missing:
                    try:
                        self._make_present(producer, name, entity, message)
                    except Exception as exc:
                        if not self._is_channel_error(exc):
                            raise
                        missing[name] = f"refused by the broker: {type(exc).__name__}: {exc}"
                        producer = self._reopen_channel()
                    else:
                        self._present.add(name)
                        continue
                refusal = missing[name]
                break
            if refusal is None:
                ready.append(index)
            else:
                outcome.rejected[index] = refusal
        return producer, ready

    def _make_present(
        self, producer: Producer, name: str, entity: Any, message: TaskMessage
    ) -> None:
        channel = producer.channel
        if entity is not None:
            entity.bind(channel).declare()
        elif name.startswith("exchange:"):
            # Not ours to declare (its type is unknown here): only check that
            # it exists, so a message to a missing one fails alone.
            Exchange(message.exchange, passive=True).bind(channel).declare()
        else:
            warn_undeclared(name)

    @contextmanager
    def _batched_io(self) -> Iterator[None]:
        """Send the batch's frames in one write, and look for news once per batch.

        py-amqp writes each publish with its own ``sendall`` and, before each,
        polls the socket for a ``connection.blocked`` notice (a read that
        times out at once): two system calls a message, the larger part of
        the confirmed path's time on a busy host. Here the frames are copied
        (py-amqp reuses its frame buffer) and sent together, and the poll is
        skipped while they are collected: nothing the broker says can change
        a batch that has not left yet, and a blocked broker is noticed by its
        missing confirms. If py-amqp lacks what this relies on, frames go out
        one by one as before.
        """
        assert self._connection is not None
        amqp_connection: Any = self._connection.connection
        transport: Any = getattr(amqp_connection, "transport", None)
        send = getattr(transport, "_write", None)
        properties = getattr(amqp_connection, "client_properties", None)
        if send is None or not isinstance(properties, dict):
            yield
            return
        frames: list[bytes] = []
        transport._write = lambda data: frames.append(bytes(data))
        # A per-connection copy: py-amqp shares the capabilities dict between connections.
        capabilities = {**properties.get("capabilities", {}), "connection.blocked": False}
        amqp_connection.client_properties = {**properties, "capabilities": capabilities}
        try:
            yield
        finally:
            transport._write = send
            amqp_connection.client_properties = properties
            if frames:
                send(b"".join(frames))

    def _await_confirms(self, count: int) -> None:
        assert self._connection is not None
        deadline = time.monotonic() + self.broker_wait
        confirms = self._confirms
        first = confirms.published - count
        while not confirms.settled():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"RabbitMQ confirmed {max(confirms.acked - first, 0)} of {count} "
                    f"messages within {self.broker_wait:g}s"
                )
            try:
                self._connection.drain_events(timeout=remaining)
            except TimeoutError:
                continue

    def _is_channel_error(self, exc: BaseException) -> bool:
        connection = self._connection
        return connection is not None and isinstance(exc, connection.channel_errors)


class Confirms:
    """The publisher confirms of one channel: what the broker acked or nacked.

    Publisher sequence numbers count from 1 on the channel. An ack or nack
    with "multiple" answers for every message up to its tag that has no
    answer yet; one without it, for its own tag only, possibly out of order.
    """

    def __init__(self) -> None:
        #: Sequence number of the last message published on the channel.
        self.published = 0
        #: Every message up to this one has its answer (ack or nack).
        self.acked = 0
        self._late: set[int] = set()  # answered alone, beyond self.acked
        self._nacked: set[int] = set()

    def next(self) -> int:
        """Count one more published message; return its sequence number."""
        self.published += 1
        return self.published

    def on_ack(self, delivery_tag: int, multiple: bool) -> None:
        if multiple:
            self.acked = max(self.acked, delivery_tag)
        else:
            self._late.add(delivery_tag)  # counted below once no tag before it is missing
        while self.acked + 1 in self._late:
            self._late.discard(self.acked + 1)
            self.acked += 1

    def on_nack(self, delivery_tag: int, multiple: bool) -> None:
        first = self.acked + 1 if multiple else delivery_tag
        # A "multiple" nack covers what has no answer yet, not what was acked alone.
        self._nacked.update(t for t in range(first, delivery_tag + 1) if t not in self._late)
        self.on_ack(delivery_tag, multiple)

    def settled(self) -> bool:
        """Whether every published message has its answer."""
        return self.acked >= self.published

    def accepted(self, sequence: int) -> bool:
        """Whether the broker acked message *sequence* (not nacked, not unanswered)."""
        answered = sequence <= self.acked or sequence in self._late
        return answered and sequence not in self._nacked

    def forget_settled(self) -> None:
        """Drop the answers up to :attr:`acked`, once their batch is accounted for."""
        self._nacked = {t for t in self._nacked if t > self.acked}
        self._late = {t for t in self._late if t > self.acked}


def supports_confirms(transport: Any) -> bool:
    """Whether *transport*'s channels can confirm publishes (RabbitMQ's extension)."""
    channel_class = getattr(getattr(transport, "Connection", None), "Channel", None)
    return callable(getattr(channel_class, "confirm_select", None))
