"""The generic path: publish released messages to any broker through kombu.

A message counts as published only once the broker has accepted it: on
RabbitMQ by a publisher confirm, on Redis by the reply to its push. Confirms
are collected per batch, so a batch costs one round trip, not one per message.

One message the broker refuses never harms another: on RabbitMQ everything a
message needs (its queues, its exchange) is declared or checked before the
batch is published, so a channel error is blamed on the message that caused
it; on Redis each reply of the pipelined push is read on its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from celery.utils.time import maybe_iso8601
from kombu import Connection, Exchange, Producer

try:  # kombu 5.7 publishes batches, and raises this when one fails as a whole
    from kombu.exceptions import BatchPublishError as _BatchPublishError

    _BATCH_ERRORS: tuple[type[BaseException], ...] = (_BatchPublishError,)
except ImportError:  # kombu < 5.7 has no batch publishing: nothing raises it
    _BATCH_ERRORS = ()

from .._format import counted
from ..bulk_limit import DEFAULT_BULK_LIMIT, MessageTooLarge, bulk_limit, envelope_size, too_large
from ..entry import TaskMessage
from ..store.client import server_state

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "PublishOutcome",
    "Publisher",
    "make_publisher",
    "supports_confirms",
]

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
    #: Set when the broker could not be reached or did not answer: the rest
    #: (neither accepted nor rejected) should wait.
    error: BaseException | None = None


class Publisher:
    """Publishes batches of task messages to the app's broker."""

    #: Publish with AMQP's "mandatory" flag: the broker returns what no queue takes.
    mandatory = False

    def __init__(self, app: Celery, *, broker_wait: float = MAX_BROKER_WAIT) -> None:
        self.app = app
        #: Seconds a batch may wait on the broker (connect, send, confirm).
        #: Kept under the lease, so a stalled broker never lets the lease
        #: lapse while this companion still means to publish the batch.
        self.broker_wait = min(broker_wait, MAX_BROKER_WAIT)
        self._connection: Connection | None = None
        self._producer: Producer | None = None
        #: Index (into the batch) of the message being handed to kombu.
        self._current = -1

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
            unsettled = max(len(messages) - len(outcome.accepted) - len(outcome.rejected), 0)
            if self._is_connection_error(exc):
                logger.warning(
                    "Broker unreachable or silent, %s: %r",
                    counted(unsettled, "message waits", "messages wait"),
                    exc,
                )
            else:
                # Unforeseen: the messages are kept (given back), the companion runs on.
                logger.error(
                    "Publishing failed unexpectedly, %s: %r",
                    counted(unsettled, "message waits", "messages wait"),
                    exc,
                    exc_info=True,
                )
            outcome.error = exc
            self._drop()
        return outcome

    def close(self) -> None:
        """Drop the broker connection; the next batch opens a new one."""
        self._let_go(polite=True)

    # -- internals ------------------------------------------------------------

    def _drop(self) -> None:
        """Forget a broken connection without talking to the broker.

        A broker that stopped answering would not answer a polite close either.
        """
        self._let_go(polite=False)

    def _let_go(self, *, polite: bool) -> None:
        connection, self._connection, self._producer = self._connection, None, None
        if connection is not None:
            try:
                if polite:
                    connection.close()
                else:
                    connection.collect()
            except Exception:  # pragma: no cover - best effort on a dead socket
                logger.debug("Letting go of the broker connection failed", exc_info=True)

    def _ensure_producer(self) -> Producer:
        if self._producer is None:
            connection = broker_connection(self.app, self.broker_wait)
            self._connection = connection
            try:
                connection.ensure_connection(max_retries=1)
                self._producer = self._open_producer()
            except BaseException:
                # A connect or first command that failed halfway (a timeout
                # under load) may have left a socket open: close it now, not
                # whenever the garbage collector finds the connection.
                self._drop()
                raise
        return self._producer

    def _open_producer(self) -> Producer:
        assert self._connection is not None
        return Producer(self._connection.default_channel, auto_declare=False)

    def _publish_batch(
        self, producer: Producer, messages: Sequence[TaskMessage], outcome: PublishOutcome
    ) -> None:
        batching = getattr(producer, "batch", None)
        if batching is not None and producer.supports_batch_publish:
            # kombu >= 5.7 pipelines the batch into one round trip (Redis).
            with batching(max_size=_BATCH_COMMANDS):
                sent = self._publish_each(producer, messages, outcome, sent=[])
            outcome.accepted.extend(self._settle_batch(sent, outcome))
            return
        # Each publish returned once the broker had the message: those before
        # a failure count as published even when the failure ends the batch
        # (given back, they would be published again on every pass).
        self._publish_each(producer, messages, outcome, sent=outcome.accepted)

    def _settle_batch(self, sent: list[int], outcome: PublishOutcome) -> list[int]:
        """Return which of *sent* the broker took once the batch is flushed."""
        return sent

    def _publish_each(
        self,
        producer: Producer,
        messages: Sequence[TaskMessage],
        outcome: PublishOutcome,
        indexes: Sequence[int] | None = None,
        *,
        sent: list[int],
    ) -> list[int]:
        """Hand each message to kombu, adding its index to *sent* at once; return *sent*.

        A message kombu refuses by itself (not for want of a connection) is
        rejected, so it cannot hold up the others. One a Redis broker refuses
        for now (out of memory, no permission on its queue) waits, and only
        it: the others go on, as in a pipelined batch.
        """
        for index in range(len(messages)) if indexes is None else indexes:
            self._current = index
            try:
                self._publish_one(producer, messages[index])
            except Exception as exc:
                if server_state(exc) is not None:
                    if outcome.error is None:
                        logger.warning("Redis broker refused a push for now, it waits: %s", exc)
                    outcome.error = exc
                    continue
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
            mandatory=self.mandatory,
            **properties,
        )

    def _declare(self, message: TaskMessage, producer: Producer) -> list[Any]:
        """Return what to declare before publishing *message*, each once per channel.

        kombu remembers what it declared, but still copies every entity to
        find out: at thousands of messages a second that was a quarter of
        the generic path's time.
        """
        declared: set[str] = producer.__dict__.setdefault("_zdelay_declared", set())
        wanted = []
        for name, entity in self._entities(message):
            if name not in declared:
                declared.add(name)
                if entity is not None:
                    wanted.append(entity)
                elif name.startswith("queue:"):
                    _warn_undeclared(name)
        return wanted

    def _entities(self, message: TaskMessage) -> list[tuple[str, Any]]:
        """(name, entity to declare or None) for what *message* needs to exist."""
        queues = self.app.amqp.queues
        needed: list[tuple[str, Any]] = []
        for name in message.declare:
            needed.append((f"queue:{name}", queues.get(name)))
        exchange = message.exchange
        if exchange:
            # A message sent to an exchange by name (no queue): declare it as
            # the app's queues define it, so a fresh channel knows its type.
            known = [q.exchange for q in queues.values() if q.exchange.name == exchange][:1]
            needed.append((f"exchange:{exchange}", known[0] if known else None))
        return needed

    def _is_connection_error(self, exc: BaseException) -> bool:
        """Whether *exc* is the broker's state (wait and retry), not the message's."""
        from kombu.exceptions import OperationalError

        if isinstance(exc, _refused_before_sending()):
            return False
        # BatchPublishError: a pipelined push failed as a whole (its replies
        # are read one by one otherwise); what it delivered is unknown.
        uncertain = (OperationalError, *_BATCH_ERRORS, ConnectionError, TimeoutError, OSError)
        if isinstance(exc, uncertain) or server_state(exc) is not None or _is_service_outage(exc):
            return True
        connection = self._connection
        if connection is None:
            return False
        if isinstance(exc, connection.connection_errors):
            return True
        # kombu counts a virtual transport's channel errors (a Redis error
        # reply such as WRONGTYPE) as recoverable connection errors too; they
        # belong to the message that caused them.
        if isinstance(exc, connection.channel_errors):
            return False
        return isinstance(exc, connection.recoverable_connection_errors)


def _refused_before_sending() -> tuple[type[BaseException], ...]:
    """Errors a client library raises about a message before sending anything.

    kombu counts every botocore error as a connection error, but botocore's
    parameter check (an SQS ``MessageGroupId`` that is not a string) is the
    message's fault: waited for, it would block its shard forever, and the
    messages published before it in the batch would be published again on
    every pass.
    """
    try:
        from botocore.exceptions import ParamValidationError  # type: ignore[import-untyped]
    except ImportError:
        return ()
    return (ParamValidationError,)


#: AWS error codes that describe the service's state, not the request
#: (SQS throttling a FIFO queue, a service in trouble).
_AWS_TRANSIENT_CODES = frozenset(
    {
        "RequestThrottled",
        "Throttling",
        "ThrottlingException",
        "ServiceUnavailable",
        "InternalError",
        "InternalFailure",
        "KMS.ThrottlingException",
    }
)


def _is_service_outage(exc: BaseException) -> bool:
    """Whether *exc* is an AWS service error the message should wait out.

    botocore raises ``ClientError`` for every error response, the message's
    (``InvalidParameterValue``: too large, a bad attribute) and the
    service's (throttled, HTTP 5xx) alike, after its own retries. Only the
    first kind is dead-lettered; the second waits, as for an unreachable broker.
    """
    try:
        from botocore.exceptions import ClientError
    except ImportError:
        return False
    response = getattr(exc, "response", None)
    if not isinstance(exc, ClientError) or not isinstance(response, dict):
        return False
    code = str((response.get("Error") or {}).get("Code", ""))
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return code in _AWS_TRANSIENT_CODES or (isinstance(status, int) and status >= 500)


#: Commands buffered before kombu flushes a Redis publish batch: more than a
#: batch ever holds, so a batch is one round trip.
_BATCH_COMMANDS = 1 << 30


class RedisPublisher(Publisher):
    """A Redis broker through kombu, each reply of the pipelined push read on its own.

    kombu's publish batch raises on the first error reply of the pipeline,
    after Redis ran every command: without the replies one bad queue (a key
    of another type) would leave the whole batch "uncertain" on every pass.
    """

    def __init__(self, app: Celery, *, broker_wait: float = MAX_BROKER_WAIT) -> None:
        super().__init__(app, broker_wait=broker_wait)
        self._batch: Any = None
        self._bulk_limit = DEFAULT_BULK_LIMIT

    def _open_producer(self) -> Producer:
        producer = super()._open_producer()
        channel = producer.channel
        self._bulk_limit = bulk_limit(channel.client)
        if getattr(channel, "create_publish_batch", None) is not None:
            # kombu's seam for batches: ours keeps the replies it gets.
            def create_publish_batch(max_size: int) -> Any:
                self._batch = _reply_keeping_batch(channel, max_size, lambda: self._current)
                return self._batch

            channel.create_publish_batch = create_publish_batch
        return producer

    def _publish_one(self, producer: Producer, message: TaskMessage) -> None:
        # Sent, a value over the limit closes the connection: the batch would
        # fail on every pass, holding back whatever is due after it.
        limit = self._bulk_limit
        reason = too_large(envelope_size(message.envelope_head, message.body, limit), limit)
        if reason is not None:
            raise MessageTooLarge(reason)
        super()._publish_one(producer, message)

    def _settle_batch(self, sent: list[int], outcome: PublishOutcome) -> list[int]:
        batch, self._batch = self._batch, None
        failures: dict[int, Exception] = batch.failures if batch is not None else {}
        for index, error in failures.items():
            if server_state(error) is not None:
                # Not pushed; the server, not the message, is at fault: it waits.
                logger.warning("Redis broker refused a push for now, it waits: %s", error)
                outcome.error = error
            else:
                outcome.rejected[index] = f"refused by Redis: {type(error).__name__}: {error}"
        return [index for index in sent if index not in failures]


def _reply_keeping_batch(channel: Any, max_size: int, owner: Callable[[], int]) -> Any:
    """Return a kombu Redis publish batch that keeps each command's reply.

    Each command is tagged with the message (*owner()*) it was issued for;
    replies that are errors land in ``failures`` by message instead of failing
    the batch. Connection failures still raise.
    """
    from kombu.transport.redis import PublishBatch

    class ReplyKeepingBatch(PublishBatch):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(channel, max_size)
            self.owners: list[int] = []
            self.failures: dict[int, Exception] = {}
            kept: Any = getattr(self, "pipeline")  # noqa: B009 - kombu is untyped
            self.pipeline = _ReplyKeepingPipeline(kept, self)

        def add(self, name: str, *args: Any) -> None:
            super().add(name, *args)
            self.owners.append(owner())

    return ReplyKeepingBatch()


class _ReplyKeepingPipeline:
    """A redis-py pipeline whose ``execute`` hands error replies to the batch."""

    def __init__(self, pipeline: Any, batch: Any) -> None:
        self._pipeline = pipeline
        self._batch = batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipeline, name)

    def execute(self) -> list[Any]:
        replies: list[Any] = self._pipeline.execute(raise_on_error=False)
        batch = self._batch
        # Commands of a message still being routed are not in this flush.
        owners, batch.owners = batch.owners[: len(replies)], batch.owners[len(replies) :]
        for index, reply in zip(owners, replies, strict=True):
            if isinstance(reply, Exception):
                batch.failures.setdefault(index, reply)
        return replies


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
            _warn_undeclared(name)

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
        elif delivery_tag == self.acked + 1:
            self.acked = delivery_tag
        else:
            self._late.add(delivery_tag)
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


def broker_connection(app: Celery, wait: float) -> Connection:
    """Return a connection to *app*'s broker (not yet open) that waits at most *wait* s.

    The connect, and on Redis every reply, time out after *wait*: a broker
    that accepts connections but does not answer must not hang the companion.
    """
    # No AMQP heartbeats: the companion may sleep for long stretches
    # without draining events; a dead connection is replaced on error.
    connection = app.connection_for_write(heartbeat=0, connect_timeout=wait)
    # The transport's own confirm_publish waits for each message's
    # confirm in turn; the confirm publisher collects them per batch.
    connection.transport_options.pop("confirm_publish", None)
    if connection.transport.driver_type == "redis":
        # Only Redis transports take this option: others (SQLAlchemy) pass
        # what they do not know on, and fail on it.
        connection.transport_options.setdefault("socket_timeout", wait)
    return connection


def make_publisher(app: Celery, *, lease_ms: int) -> Publisher:
    """Return the publisher for *app*'s broker, waiting at most half a lease.

    Chosen by what the transport can do, not by its name: a transport whose
    channels confirm publishes gets the confirm publisher.
    """
    transport = app.connection_for_write().transport
    publisher: type[Publisher] = Publisher
    if supports_confirms(transport):
        publisher = ConfirmPublisher
    elif transport.driver_type == "redis":
        publisher = RedisPublisher
    return publisher(app, broker_wait=lease_ms / 2000)


def _warn_undeclared(name: str) -> None:
    logger.warning(
        "Queue %s is not configured on this companion (task_queues) and "
        "task_create_missing_queues is off; publishing without declaring it",
        name.removeprefix("queue:"),
    )


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
