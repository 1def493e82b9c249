"""The generic publisher: released messages to any broker through kombu.

A message counts as published only once the broker has accepted it (see the
publishers for Redis, :mod:`.redis_broker`, and for brokers that confirm,
:mod:`.confirming`). One message the broker refuses never harms another: a
refusal that is the message's is rejected (dead-lettered), one that is the
broker's state makes the rest of the batch wait.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from celery.utils.time import maybe_iso8601
from kombu import Connection, Producer

try:  # kombu 5.7 publishes batches, and raises this when one fails as a whole
    from kombu.exceptions import BatchPublishError as _BatchPublishError

    _BATCH_ERRORS: tuple[type[BaseException], ...] = (_BatchPublishError,)
except ImportError:  # kombu < 5.7 has no batch publishing: nothing raises it
    _BATCH_ERRORS = ()

from ..._format import counted
from ...entry import TaskMessage
from ...store.client import server_state

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "MAX_BROKER_WAIT",
    "PublishOutcome",
    "Publisher",
    "broker_connection",
    "warn_undeclared",
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
    #: Index (into the batch) of the message being handed to kombu: set
    #: before each one, read only while kombu has it.
    _current: int

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
                    warn_undeclared(name)
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
            known = next((q.exchange for q in queues.values() if q.exchange.name == exchange), None)
            needed.append((f"exchange:{exchange}", known))
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


def warn_undeclared(name: str) -> None:
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
