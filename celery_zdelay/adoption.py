"""Adopt ETA tasks sent the native way: take them from their broker queue into the store.

Before a project switched to celery-zdelay, ``apply_async(countdown=...)``
and ``eta=`` sent ETA messages to the broker, and workers took them and hold
them in memory, unacknowledged, until they are due. A stopped worker gives
them back to the queue (RabbitMQ at once; kombu's Redis transport on a warm
shutdown, or ``visibility_timeout`` after it took them). With the workers
of a queue stopped, :func:`adopt` reads every message waiting in it through
kombu, holding each unacknowledged, and:

- parks each Celery task message whose ``eta`` is ahead as the very message
  Celery sent (same id, headers, body, properties, exchange and routing
  key: released to where it was going; its ``eta`` header moves to
  ``zdelay_eta``, as transparent mode moves it, so the worker runs it when
  released and the task still sees its ETA), then acknowledges it;
- gives every other message back to the queue as it was (no ``eta``, an
  ``eta`` passed, not a Celery task message, an ``eta`` it cannot read):
  never dropped.

Exactly once: parking goes through ``adopt_once.lua``
(:mod:`celery_zdelay.store.adopted`), which remembers each adopted message
in the step that parks it. A run killed between the park and the
acknowledgement leaves the message in the queue, and the broker gives it
back; the next run acknowledges that copy without parking it again, and
drops (acknowledges) a copy whose ``eta`` passed meanwhile rather than give
it back to run a second time: its parked copy runs, or ran.

On the Redis broker a killed consumer's messages stay unacknowledged in the
broker until ``visibility_timeout`` after they were taken; a run first gives
back those of its queue that waited that long (kombu's rule, which every
worker applies), and reports the others.

The message bodies are never decoded: the ``eta`` of Celery's task protocol
2 is a header. (Protocol 1 messages carry it in the body, and celery-zdelay
parks protocol 2 only: they go back to the queue.)

Celery's native delayed delivery (RabbitMQ quorum queues, Celery >= 5.5)
keeps ETA tasks out of the workers, in 28 delay queues of RabbitMQ
(``celery_delayed_27`` .. ``celery_delayed_0``) that pass each message down
by their message TTLs to the ``celery_delayed_delivery`` exchange, which
routes it to its queue. With *delayed_delivery*, :func:`adopt` reads those
queues too, from level 27 down (a message only ever moves down, so none
slips past the scan), and parks each message with an ``eta`` ahead as
Celery publishes it without delayed delivery: to its queue's exchange and
routing key (its routing key is the delay's bits, then the queue's). One
delayed for a queue the app does not name goes back, left to RabbitMQ: a
virtual host's delay queues hold every app's. The headers RabbitMQ added
(``x-death``, ``x-delivery-count``...) are left out. No worker consumes
the delay queues, so their workers need not be stopped.

celery-redis-plus (a kombu transport for Redis) keeps a message delayed more
than a minute in a sorted set of the broker's Redis, and hands it to a
worker a minute before it is due. With *redis_plus*, :func:`adopt` reads
every message of its queues that no consumer took (delayed, or waiting in
its queue with an ``eta``; :mod:`celery_zdelay.redis_plus`), parks each
with an ``eta`` ahead as it was sent (to its exchange and routing key),
then takes it out of celery-redis-plus, in one script that first checks
that no consumer popped it meanwhile; reading takes nothing, so nothing is
given back.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis
from kombu import Connection
from kombu.compression import compress
from kombu.exceptions import OperationalError

from . import redis_plus, signals
from .app_state import store_for
from .entry import TaskMessage
from .errors import (
    BrokerUnavailableError,
    ConfigurationError,
    QueueInUseError,
    QueueNotFoundError,
    ZDelayError,
)
from .parking import park_requests
from .redis_plus import RedisPlusBroker
from .schedule import Due, due_from
from .store import Store
from .store.adopted import (
    ADOPTED,
    ADOPTED_BEFORE,
    ID_TAKEN,
    Adoption,
    adopt_once,
    adopted_among,
    forget,
)
from .store.client import sanitize_url
from .store.headers import ETA_HEADER

if TYPE_CHECKING:
    from celery import Celery
    from kombu.message import Message

__all__ = [
    "BAD_ETA",
    "DELAY_QUEUES",
    "ETA_PASSED",
    "ID_PARKED",
    "INSPECT_TIMEOUT_S",
    "NOT_A_TASK",
    "NO_ETA",
    "OTHER_QUEUE",
    "REASONS",
    "REFUSED",
    "TAKEN_MEANWHILE",
    "UNDECODABLE",
    "AdoptReport",
    "QueueReport",
    "adopt",
    "fingerprint",
]

logger = logging.getLogger(__name__)

#: Why a message went back to its queue, as reports and ``--json`` name it.
NO_ETA = "no_eta"
ETA_PASSED = "eta_passed"
BAD_ETA = "bad_eta"
NOT_A_TASK = "not_a_task"
UNDECODABLE = "undecodable"
ID_PARKED = "id_parked"
REFUSED = "refused"
OTHER_QUEUE = "other_queue"
TAKEN_MEANWHILE = "taken_meanwhile"
#: Each reason, for people.
REASONS = {
    NO_ETA: "no eta (runs at once)",
    ETA_PASSED: "eta passed (runs at once)",
    BAD_ETA: "eta unreadable",
    NOT_A_TASK: "not a Celery task message of protocol 2",
    UNDECODABLE: "body not decompressable",
    ID_PARKED: "another entry is parked under its id",
    REFUSED: "refused by the store's rules (see the log)",
    OTHER_QUEUE: "delayed for a queue the app does not name (left to RabbitMQ)",
    TAKEN_MEANWHILE: "taken by a consumer while adopt parked it (its parked copy withdrawn)",
}

#: The levels of Celery's native delayed delivery (kombu >= 5.5,
#: ``kombu.transport.native_delayed_delivery``: not imported, so that this
#: module loads with the older kombu this package supports too).
_DELAY_LEVELS = 28
#: The delay queues of Celery's native delayed delivery, in the order read:
#: the longest delays first, as messages move from one to the next shorter.
DELAY_QUEUES = tuple(f"celery_delayed_{level}" for level in range(_DELAY_LEVELS - 1, -1, -1))

#: The delay's bits at the head of a delayed message's routing key (kombu's
#: calculate_routing_key: one "0." or "1." per level).
_DELAY_BITS = re.compile(rf"^(?:[01]\.){{{_DELAY_LEVELS}}}")

#: Seconds to wait for the workers' answer to "which queues do you consume?".
INSPECT_TIMEOUT_S = 2.0
#: Messages parked per round trip to the store, then acknowledged together.
_BATCH = 500
#: How long to wait for the broker to count the messages given back as
#: waiting again: this, and this much more per message.
_GIVE_BACK_WAIT_S = 30.0
_GIVE_BACK_WAIT_PER_MESSAGE_S = 0.01
#: Headers RabbitMQ adds to a message it dead-lettered (each step down the
#: delay queues) or delivered again (quorum queues): not the message's own.
_BROKER_HEADERS = frozenset(
    {
        "x-death",
        "x-delivery-count",
        "x-first-death-exchange",
        "x-first-death-queue",
        "x-first-death-reason",
        "x-last-death-exchange",
        "x-last-death-queue",
        "x-last-death-reason",
    }
)
#: Properties a transport adds to what Celery's producer set: not the message's own
#: (celery-redis-plus copies the eta into ``eta``, epoch seconds).
_TRANSPORT_PROPERTIES = frozenset(
    {
        "eta",
        "delivery_info",
        "delivery_tag",
        "body_encoding",
        "priority",
        "content_type",
        "content_encoding",
        "application_headers",
    }
)


@dataclass
class QueueReport:
    """What :func:`adopt` did with one queue (or, in a dry run, would do)."""

    queue: str
    #: Messages waiting in the queue when its turn came (the broker's count).
    waiting: int = 0
    #: Messages read (at most :attr:`waiting`: later ones are left for a next run).
    read: int = 0
    #: Parked and acknowledged (dry run: would be).
    adopted: int = 0
    #: Copies of messages an earlier run parked: acknowledged, not parked again.
    adopted_before: int = 0
    #: Given back to the queue as they were, by reason (:data:`REASONS`).
    put_back: Counter[str] = field(default_factory=Counter)
    #: The latest due time (epoch ms) among those adopted.
    latest_eta_ms: int | None = None
    #: Redis broker: messages of the queue a consumer took and never
    #: acknowledged, given back by this run because ``visibility_timeout``
    #: passed since (kombu's own rule, which every worker applies).
    restored: int = 0
    #: Redis broker: such messages still unacknowledged when the run ended
    #: (taken by a consumer that runs, or by one killed less than
    #: ``visibility_timeout`` ago); None on other brokers.
    unacked: int | None = None
    #: When the first of :attr:`unacked` may be given back (epoch ms).
    unacked_back_ms: int | None = None

    @property
    def put_back_total(self) -> int:
        return sum(self.put_back.values())


@dataclass
class AdoptReport:
    """What :func:`adopt` did, queue by queue."""

    #: The broker's URL, without its password.
    broker: str
    dry_run: bool
    queues: list[QueueReport]
    #: The Redis clock when the report was made (ms).
    now_ms: int


def adopt(
    app: Celery,
    queues: Sequence[str],
    *,
    dry_run: bool = False,
    force: bool = False,
    inspect_timeout: float = INSPECT_TIMEOUT_S,
    delayed_delivery: bool = False,
    redis_plus: bool = False,
) -> AdoptReport:
    """Move the ETA task messages waiting in *queues* into the store of *app*; report what moved.

    Run it with the workers of *queues* stopped. With *dry_run*, every
    message read goes back to its queue and nothing is parked. *force* skips
    the check that no worker consumes the queues. With *delayed_delivery*,
    the delay queues of Celery's native delayed delivery on RabbitMQ
    (:data:`DELAY_QUEUES`, see the module docstring) are read too, after
    *queues* (which may then be empty); no worker consumes those. With
    *redis_plus*, so are the messages waiting in celery-redis-plus's keys of
    the broker's Redis (:mod:`celery_zdelay.redis_plus`), last.

    Raises:
        ConfigurationError: the store is not configured (nothing is read).
        QueueNotFoundError: a queue is unknown to the broker and to *app*, or
            with *delayed_delivery*, the broker has no delay queue, or with
            *redis_plus*, no queue of celery-redis-plus.
        QueueInUseError: a worker consumes one of *queues*, or with
            *redis_plus* one of celery-redis-plus's (without *force*).
        BrokerUnavailableError: the broker cannot be reached, or was lost midway.
        StoreRefusedError: the store's user may not run the parking script
            (nothing is read).
        StoreUnavailableError: the store was lost midway. Either way, what was
            taken and not parked goes back to its queue, and a next run adopts
            what this one did not, once each.
    """
    store = store_for(app)
    # The store answers, and lets this user park, before anything is taken.
    if not dry_run:
        store.ensure_allowed(store.keys(0).due, "adopt_once")
    store.time_ms()
    names = list(dict.fromkeys(queues))
    connection = app.connection_for_write()
    broker = sanitize_url(connection.as_uri(include_password=True))
    reports = []
    try:
        if names or delayed_delivery or not redis_plus:
            errors = _kombu_errors(connection)
            with _broker_errors(broker, errors, started=False):
                connection.ensure_connection(max_retries=1)
                found = {name: _declared(app, connection, name) for name in names}
                if not force:
                    _refuse_if_consumed(app, found, inspect_timeout)
                delays = _delay_queues(connection, broker) if delayed_delivery else []
            for name in names:
                with _broker_errors(broker, errors, started=True):
                    reports.append(_QueueRun(app, store, connection, name, dry_run=dry_run).run())
            for name in delays:
                with _broker_errors(broker, errors, started=True):
                    run = _QueueRun(app, store, connection, name, dry_run=dry_run, delay=True)
                    reports.append(run.run())
    finally:
        connection.release()
    if redis_plus:
        reports += _adopt_redis_plus(
            app, store, dry_run=dry_run, force=force, timeout=inspect_timeout
        )
    return AdoptReport(broker=broker, dry_run=dry_run, queues=reports, now_ms=store.time_ms())


def _adopt_redis_plus(
    app: Celery, store: Store, *, dry_run: bool, force: bool, timeout: float
) -> list[QueueReport]:
    """Adopt the messages waiting in celery-redis-plus's keys of the broker's Redis, by queue."""
    source = RedisPlusBroker.of(app, channel=_Settled())
    broker = sanitize_url(source.url)
    errors = (redis.ConnectionError, redis.TimeoutError)
    try:
        with _broker_errors(broker, errors, started=False):
            queues = source.queues()
            if not queues:
                raise QueueNotFoundError(
                    f"The broker {broker} holds no queue of celery-redis-plus ("
                    f"{redis_plus.INDEX_PREFIX}<queue> keys"
                    + (f" under the global_keyprefix {source.prefix!r}" if source.prefix else "")
                    + "): nothing waits there, or the broker_url or global_keyprefix is not the "
                    "one the project had with celery-redis-plus. Nothing was taken."
                )
            if not force:
                _refuse_if_redis_plus_consumed(app, source, queues, timeout)
        reports = []
        for queue in queues:
            with _broker_errors(broker, errors, started=True):
                reports.append(_RedisPlusRun(app, store, source, queue, dry_run=dry_run).run())
        return reports
    finally:
        source.close()


def fingerprint(message: TaskMessage) -> str:
    """Return what a redelivery of *message* cannot change, hashed.

    Its id, its retry count, its ``eta`` and its body: a broker that gives a
    message back may add headers of its own (kombu's Redis transport adds
    ``redelivered``), and a retry of the task carries the same id with
    another count and ``eta``.
    """
    digest = hashlib.sha256()
    for part in (
        message.task_id,
        str(message.headers.get("retries", "")),
        str(message.headers.get(ETA_HEADER) or message.headers.get("eta")),
    ):
        digest.update(part.encode("utf-8", "surrogatepass") + b"\0")
    digest.update(message.body)
    return digest.hexdigest()[:32]


# -- one queue ----------------------------------------------------------------


@dataclass
class _Declared:
    """A queue as the broker declares it."""

    messages: int
    consumers: int


class _Run:
    """Adopt the ETA messages ahead among those read from one queue; count the others.

    A subclass reads the messages (its ``run``) and says how one leaves its
    queue (:meth:`_acknowledge`).
    """

    def __init__(
        self,
        app: Celery,
        store: Store,
        queue: str,
        *,
        dry_run: bool,
        delay: bool = False,
        report_as: str | None = None,
    ) -> None:
        self.app = app
        self.store = store
        self.dry_run = dry_run
        #: The queue the messages were sent to.
        self.queue = queue
        #: A delay queue of native delayed delivery (see the module docstring).
        self.delay = delay
        self.report = QueueReport(report_as or queue)
        #: Every message read and not acknowledged, in the order read: what
        #: goes back when the run ends (or fails).
        self.taken: list[Message] = []
        #: Read, due ahead, not yet parked: (message, its task message, due).
        self.pending: list[tuple[Message, TaskMessage, Due]] = []
        #: Read, with an eta passed: (message, its task message). Put back,
        #: unless it is a copy of one adopted before (the parked one runs).
        self.passed: list[tuple[Message, TaskMessage]] = []

    def _acknowledge(self, messages: list[Message]) -> list[Message]:
        """Take *messages* out of their queue for good; return those it no longer held.

        A broker queue holds what this run read until it acknowledges it.
        """
        for message in messages:
            message.ack()
        return []

    def _sort(self, message: Message, now_ms: int) -> None:
        """Count *message* as put back, with its reason, or queue it to be looked at."""
        verdict = _classify(self.app, message, self.queue, delay=self.delay)
        if isinstance(verdict, str):
            self.report.put_back[verdict] += 1
            return
        task_message, due = verdict
        if due.ms > now_ms:
            self.pending.append((message, task_message, due))
        else:
            self.passed.append((message, task_message))

    def _adopt(self) -> None:
        """Park the pending messages, then acknowledge those parked now or before."""
        self._drop_copies()
        pending, self.pending = self.pending, []
        if not pending:
            return
        report = self.report
        adoptions: list[tuple[Message, Adoption]] = []
        for message, task_message, due in pending:
            try:
                (request,) = park_requests(self.app, [task_message], [due])
            except ConfigurationError as exc:
                logger.warning(
                    "Task %s[%s] goes back to queue %s: %s",
                    task_message.task_name,
                    task_message.task_id,
                    report.queue,
                    exc,
                    extra={"task_id": task_message.task_id},
                )
                report.put_back[REFUSED] += 1
                continue
            if request.mark is not None:
                # A key or tags in celery-zdelay's own headers: no native ETA message has them.
                report.put_back[REFUSED] += 1
                continue
            adoptions.append((message, Adoption(request, fingerprint(task_message))))
        if self.dry_run:
            prints = [(a.request.task_id, a.fingerprint) for _, a in adoptions]
            outcomes = [answer or ADOPTED for answer in adopted_among(self.store, prints)]
        else:
            outcomes = adopt_once(self.store, [adoption for _, adoption in adoptions])
        parked: list[tuple[TaskMessage, int]] = []
        for (_, adoption), outcome in zip(adoptions, outcomes, strict=True):
            if outcome == ID_TAKEN:
                report.put_back[ID_PARKED] += 1
            elif outcome == ADOPTED_BEFORE:
                report.adopted_before += 1
            else:
                report.adopted += 1
                due_ms = adoption.request.due.ms
                latest = report.latest_eta_ms
                report.latest_eta_ms = due_ms if latest is None else max(latest, due_ms)
                assert adoption.request.message is not None
                parked.append((adoption.request.message, due_ms))
        if self.dry_run:
            return
        if parked:
            # Parked and not yet acknowledged: receivers (metrics, Celery's
            # task-sent event) learn of what the store holds.
            signals.tasks_parked.send(
                sender=self.app,
                messages=[message for message, _ in parked],
                due_ms=[due_ms for _, due_ms in parked],
            )
        kept = [
            (message, adoption)
            for (message, adoption), outcome in zip(adoptions, outcomes, strict=True)
            if outcome != ID_TAKEN
        ]
        lost = self._acknowledge([message for message, _ in kept])
        if lost:
            self._withdraw([adoption for message, adoption in kept if message in lost])
        self.taken = [message for message in self.taken if not message.acknowledged]

    def _withdraw(self, adoptions: list[Adoption]) -> None:
        """Take back the parked copies of messages a consumer took while this run parked them.

        The record goes first: killed between the two steps, the run leaves
        a copy parked that a next run would not take for one adopted before
        (a duplicate at worst, never a message dropped as a copy).
        """
        report = self.report
        forget(self.store, adoptions)
        ids = [adoption.request.task_id for adoption in adoptions]
        for task_id, withdrawn in zip(
            ids, self.store.cancel(ids, how="withdrawn", by="adopt"), strict=True
        ):
            report.adopted -= 1
            report.put_back[TAKEN_MEANWHILE] += 1
            if withdrawn:
                logger.warning(
                    "Task %s was taken by a consumer of queue %s while adopt parked it: "
                    "left to that consumer, its parked copy withdrawn.",
                    task_id,
                    self.queue,
                    extra={"task_id": task_id},
                )
            else:
                logger.error(
                    "Task %s was taken by a consumer of queue %s while adopt parked it, and "
                    "its parked copy was released already: it may run twice.",
                    task_id,
                    self.queue,
                    extra={"task_id": task_id},
                )

    def _drop_copies(self) -> None:
        """Acknowledge the messages with an eta passed that are copies of ones adopted before.

        A run killed after parking and before acknowledging leaves the message
        in the queue; by the next run its eta may have passed, and its parked
        copy may have run: put back, it would run a second time.
        """
        passed, self.passed = self.passed, []
        if not passed:
            return
        found = adopted_among(self.store, [(m.task_id, fingerprint(m)) for _, m in passed])
        copies = []
        for (message, _), answer in zip(passed, found, strict=True):
            if answer == ADOPTED_BEFORE:
                self.report.adopted_before += 1
                copies.append(message)
            else:
                self.report.put_back[ETA_PASSED] += 1
        if copies and not self.dry_run:
            for message in self._acknowledge(copies):
                # Its parked copy ran or runs now: nothing left to withdraw.
                logger.warning(
                    "A copy of task %s adopted before was taken by a consumer of queue %s "
                    "during this run: it may run twice.",
                    message.headers.get("id"),
                    self.queue,
                )
        self.taken = [message for message in self.taken if not message.acknowledged]


class _QueueRun(_Run):
    """Read one broker queue once: adopt the ETA messages ahead, give back the others."""

    def __init__(
        self,
        app: Celery,
        store: Store,
        connection: Connection,
        name: str,
        *,
        dry_run: bool,
        delay: bool = False,
    ) -> None:
        super().__init__(app, store, name, dry_run=dry_run, delay=delay)
        self.connection = connection

    def run(self) -> QueueReport:
        report = self.report
        channel = self.connection.channel()
        try:
            redis_unacked = _RedisUnacked.of(self.app, channel, report.queue)
            if redis_unacked is not None:
                report.restored = redis_unacked.restore_visible()
            report.waiting = _declared(self.app, self.connection, report.queue).messages
            now_ms = self.store.time_ms()
            try:
                # Only what waited when the turn came: a message sent meanwhile
                # is left for the next run, and none is read twice.
                for _ in range(report.waiting):
                    message = _get(channel, report.queue)
                    if message is None:
                        break
                    report.read += 1
                    self.taken.append(message)
                    self._sort(message, now_ms)
                    if len(self.pending) + len(self.passed) >= _BATCH:
                        self._adopt()
                self._adopt()
            finally:
                self._give_back(channel)
            if redis_unacked is not None:
                report.unacked, report.unacked_back_ms = redis_unacked.left()
        finally:
            channel.close()
        return report

    def _give_back(self, channel: Any) -> None:
        """Give every message taken and not acknowledged back to its queue, in reading order.

        kombu's Redis transport puts a rejected message at the end of the
        list read last: rejected in reading order, they keep their order.
        RabbitMQ puts each back where it was.
        """
        taken, self.taken = self.taken, []
        self.pending, self.passed = [], []
        given = 0
        for message in taken:
            if not message.acknowledged:
                message.reject(requeue=True)
                given += 1
        if given and not self.delay:
            # (A delay queue passes what it takes back on when its TTL is up:
            # its count says nothing of what this run gave back.)
            self._wait_taken_back(channel, given)

    def _wait_taken_back(self, channel: Any, given: int) -> None:
        """Wait until the queue counts the *given* messages as waiting again.

        RabbitMQ answers nothing to a reject, and puts the messages back in
        its own time (seconds for thousands): a run that starts next would
        count, and read, only those back by then. kombu's Redis transport
        puts each back before its reject returns.
        """
        name = self.report.queue
        deadline = time.monotonic() + _GIVE_BACK_WAIT_S + given * _GIVE_BACK_WAIT_PER_MESSAGE_S
        while True:
            _, waiting, _ = channel.queue_declare(queue=name, passive=True)
            if waiting >= given:
                return
            if time.monotonic() > deadline:
                logger.warning(
                    "Queue %s counts %s of the %s messages given back so far; the broker "
                    "is still taking them back.",
                    name,
                    waiting,
                    given,
                )
                return
            time.sleep(0.1)


class _RedisPlusRun(_Run):
    """Read the messages of one queue waiting in celery-redis-plus's keys; adopt the ETA ones ahead.

    Reading takes nothing: a message leaves celery-redis-plus only once its
    copy is parked, and only if no consumer popped it meanwhile
    (:meth:`RedisPlusBroker.take`). A run killed anywhere loses nothing: the
    next finds the message still there, and its record of adoption, and
    takes it out without parking it again. A worker of celery-redis-plus
    racing the run keeps what it popped, and the parked copy is withdrawn.
    """

    def __init__(
        self, app: Celery, store: Store, source: RedisPlusBroker, queue: str, *, dry_run: bool
    ) -> None:
        report_as = redis_plus.INDEX_PREFIX + queue
        super().__init__(app, store, queue, dry_run=dry_run, report_as=report_as)
        self.source = source

    def run(self) -> QueueReport:
        report = self.report
        # Only what waited when the turn came: the index as it is now.
        tags = self.source.tags(self.queue)
        now_ms = self.store.time_ms()
        delivered: list[int] = []
        for start in range(0, len(tags), _BATCH):
            for waiting in self.source.read(self.queue, tags[start : start + _BATCH]):
                if waiting.message is None:
                    # A consumer holds it: given back to the queue at next_ms,
                    # unless that consumer acknowledges it.
                    delivered.append(waiting.next_ms)
                    continue
                report.waiting += 1
                report.read += 1
                self.taken.append(waiting.message)
                self._sort(waiting.message, now_ms)
            self._adopt()
        # Read, never taken: nothing goes back.
        self.taken = []
        report.unacked, report.unacked_back_ms = len(delivered), min(delivered, default=None)
        return report

    def _acknowledge(self, messages: list[Message]) -> list[Message]:
        gone = self.source.take(self.queue, [str(m.delivery_tag) for m in messages])
        for message, taken in zip(messages, gone, strict=True):
            if taken:
                message.ack()
        return [message for message, taken in zip(messages, gone, strict=True) if not taken]


class _Settled:
    """The channel of a message read from celery-redis-plus.

    Its ack only marks it done: :meth:`RedisPlusBroker.take` removed it.
    """

    no_ack_consumers = None

    def basic_ack(self, delivery_tag: Any, multiple: bool = False) -> None:
        pass


def _get(channel: Any, queue: str) -> Message | None:
    """Take the next message of *queue*, unacknowledged, as kombu reads it (None: empty).

    Not ``kombu.Queue.get``, which raises for a message it cannot
    decompress: such a message goes back to its queue like any other.
    """
    raw = channel.basic_get(queue=queue, no_ack=False)
    if raw is None:
        return None
    to_python = getattr(channel, "message_to_python", None)
    message: Message = to_python(raw) if to_python is not None else raw
    return message


def _classify(
    app: Celery, message: Message, queue: str, *, delay: bool = False
) -> str | tuple[TaskMessage, Due]:
    """Return why *message* goes back, or what would park it and when it is due.

    *delay*: *queue* is a delay queue of native delayed delivery.
    """
    headers = message.headers
    if not isinstance(headers, dict) or "task" not in headers or "id" not in headers:
        return NOT_A_TASK
    if message.errors:
        return UNDECODABLE
    eta = headers.get("eta")
    if eta is None:
        return NO_ETA
    route = None
    if delay:
        route = _undelayed(app, str((message.delivery_info or {}).get("routing_key")))
        if route is None:
            return OTHER_QUEUE
    try:
        due = due_from(eta=eta)
    except ConfigurationError:
        return BAD_ETA
    return _task_message(app, message, queue, eta, route=route), due


def _task_message(
    app: Celery,
    message: Message,
    queue: str,
    eta: Any,
    *,
    route: tuple[str, str, list[str]] | None = None,
) -> TaskMessage:
    """Return *message* as the producer had it: what a capture of Celery's send would hold.

    From a delay queue, bound for where it goes without the delay: *route*
    (exchange, routing key, queues; see :func:`_undelayed`).
    """
    body = message.body
    if isinstance(body, str):
        body = body.encode("utf-8")
    if compression := message.headers.get("compression"):
        # kombu hands the body decompressed; compressed again as Celery's
        # producer compressed it (kombu's own function: the same bytes).
        body, _ = compress(body, compression)
    properties = message.properties or {}
    delivery = message.delivery_info or {}
    if route is not None:
        exchange, routing_key, declare = route
    else:
        exchange = str(delivery.get("exchange") or "")
        routing_key = str(delivery.get("routing_key") or queue)
        declare = [queue] if queue in app.amqp.queues else []
    headers = {k: v for k, v in message.headers.items() if k not in _BROKER_HEADERS}
    # The companion releases it when due: the worker runs it at once, and
    # puts this back into request.eta (celery_zdelay.worker.restore_eta).
    # park_requests clears the eta header.
    headers[ETA_HEADER] = eta
    return TaskMessage(
        body=bytes(body),
        content_type=message.content_type,
        content_encoding=message.content_encoding,
        headers=headers,
        # Scalars only: a property a transport decoded into an object (an
        # AMQP timestamp) would not survive the entry's JSON; Celery sets none.
        properties={
            key: value
            for key, value in properties.items()
            if key not in _TRANSPORT_PROPERTIES and isinstance(value, (str, int, float, type(None)))
        },
        priority=int(properties.get("priority") or 0),
        exchange=exchange,
        routing_key=routing_key,
        declare=declare,
    )


def _undelayed(app: Celery, routing_key: str) -> tuple[str, str, list[str]] | None:
    """Where a message of a delay queue goes without the delay: (exchange, routing key, queues).

    Its *routing_key* is the delay's bits, then its queue's routing key: the
    app's queue of that key (or name), with its exchange and routing key, as
    Celery publishes a task without delayed delivery. None for a key no
    queue of the app has: another app's message (a virtual host's delay
    queues hold every queue's), left to RabbitMQ.
    """
    key = _DELAY_BITS.sub("", routing_key, count=1)
    for name, declared in app.amqp.queues.items():
        if key in (declared.routing_key, name) and declared.exchange is not None:
            return str(declared.exchange.name), key, [name]
    return None


# -- the broker ---------------------------------------------------------------


def _declared(app: Celery, connection: Connection, name: str) -> _Declared:
    """Return what the broker says of queue *name* (a passive declare, which creates nothing).

    kombu's Redis transport knows a queue only while its list holds a
    message: a queue of the app's is taken as empty then.
    """
    channel = connection.channel()
    try:
        _, messages, consumers = channel.queue_declare(queue=name, passive=True)
        return _Declared(int(messages), int(consumers or 0))
    except connection.channel_errors as exc:
        if name in app.amqp.queues or _bound_on_redis(channel, name):
            return _Declared(0, 0)
        known = ", ".join(sorted(app.amqp.queues)) or "none"
        raise QueueNotFoundError(
            f"No queue named {name!r} on the broker "
            f"{sanitize_url(connection.as_uri(include_password=True))} ({exc}), and the "
            f"app names no such queue (its queues: {known}). Check the name: celery -A proj "
            "inspect active_queues lists what running workers consume. Nothing was taken "
            "from any queue."
        ) from None
    finally:
        # A refused passive declare closes the channel on RabbitMQ already.
        try:
            channel.close()
        except connection.connection_errors + connection.channel_errors:
            pass


def _delay_queues(connection: Connection, broker: str) -> list[str]:
    """Return the delay queues of native delayed delivery the broker has, longest delay first.

    Raises:
        QueueNotFoundError: it has none (not RabbitMQ, or no worker of
            Celery >= 5.5 with quorum queues ever declared them).
    """
    found = []
    for name in DELAY_QUEUES:
        channel = connection.channel()
        try:
            channel.queue_declare(queue=name, passive=True)
            found.append(name)
        except connection.channel_errors:
            pass
        finally:
            # A refused passive declare closes the channel on RabbitMQ already.
            try:
                channel.close()
            except connection.connection_errors + connection.channel_errors:
                pass
    if not found:
        raise QueueNotFoundError(
            f"The broker {broker} has none of the delay queues of Celery's native delayed "
            f"delivery ({DELAY_QUEUES[-1]} to {DELAY_QUEUES[0]}): they exist on RabbitMQ "
            "once a worker of Celery 5.5 or later has run with quorum queues. Leave out "
            "--delayed-delivery. Nothing was taken from any queue."
        )
    return found


def _bound_on_redis(channel: Any, name: str) -> bool:
    """Whether kombu's Redis transport has *name* bound to the exchange of its name (a
    queue some worker declared, empty now)."""
    get_table = getattr(channel, "get_table", None)
    if get_table is None or not hasattr(channel, "unacked_key"):
        return False
    return any(binding[-1] == name for binding in get_table(name))


def _refuse_if_redis_plus_consumed(
    app: Celery, source: RedisPlusBroker, queues: list[str], timeout: float
) -> None:
    """Raise :class:`QueueInUseError` when a worker of celery-redis-plus seems to consume.

    Its idle workers wait in BZMPOP, which the broker lists; its workers
    answer Celery's remote control only on its own transport (it carries
    broadcasts in Redis streams), so they are asked only when *app* has it.
    """
    waiting = source.consumers()
    problems = []
    if waiting:
        problems.append(
            f"{waiting} client(s) of the broker wait for messages in BZMPOP, as the "
            "workers of celery-redis-plus do"
        )
    transport = str(app.conf.broker_transport or app.conf.broker_url or "")
    asked = transport.startswith(("celery_redis_plus", "valkey"))
    found = {queue: _Declared(0, 0) for queue in queues}
    _refuse_if_consumed(app, found, timeout, problems=problems, inspect=asked)


def _refuse_if_consumed(
    app: Celery,
    found: dict[str, _Declared],
    timeout: float,
    *,
    problems: Sequence[str] = (),
    inspect: bool = True,
) -> None:
    """Raise :class:`QueueInUseError` when a worker consumes one of the queues in *found*.

    *problems*: what else was found consuming; *inspect*: ask the workers.
    """
    problems = [*problems] + [
        f"RabbitMQ counts {declared.consumers} consumer(s) of queue {name!r}"
        for name, declared in found.items()
        if declared.consumers
    ]
    replies = (app.control.inspect(timeout=timeout).active_queues() or {}) if inspect else {}
    for worker, consumed in sorted(replies.items()):
        for queue in consumed or []:
            name = queue.get("name") if isinstance(queue, dict) else None
            if name in found:
                problems.append(f"worker {worker} consumes queue {name!r}")
    if problems:
        raise QueueInUseError(
            "zdelay adopt takes messages out of a queue only while no worker consumes it "
            "(a running worker holds the ETA tasks it took, in memory): "
            + "; ".join(problems)
            + ". Stop those workers (celery -A proj control shutdown, or your process "
            "supervisor) and run adopt again; --force skips this check. Nothing was "
            "taken from any queue."
        )


def _kombu_errors(connection: Connection) -> tuple[type[BaseException], ...]:
    """The errors of *connection* that say the broker is out of reach."""
    # kombu's Redis transport counts KeyError among its connection errors:
    # a KeyError here is a defect, not an outage.
    return tuple(
        error
        for error in (*connection.connection_errors, *connection.channel_errors)
        if error is not KeyError
    )


@contextmanager
def _broker_errors(
    broker: str, errors: tuple[type[BaseException], ...], *, started: bool
) -> Iterator[None]:
    """Translate the broker's connection *errors* into :class:`BrokerUnavailableError`."""
    try:
        yield
    except ZDelayError:
        raise
    except (OperationalError, *errors) as exc:
        if not started:
            raise BrokerUnavailableError(
                f"The broker {broker} could not be reached ({exc!r}): nothing was taken "
                "from any queue."
            ) from exc
        raise BrokerUnavailableError(
            f"The broker {broker} was lost during zdelay adopt ({exc!r}). What was parked "
            "is in the store; what was taken and not acknowledged goes back to its queue "
            "(RabbitMQ: at once; Redis: visibility_timeout after it was taken). Run adopt "
            "again: a message parked already is not parked twice."
        ) from exc


@dataclass
class _RedisUnacked:
    """The messages of one queue that kombu's Redis transport holds as unacknowledged.

    kombu keeps every message a consumer took and has not acknowledged in
    one hash of the broker (``unacked_key``, indexed by the time it was
    taken), and gives it back to its queue ``visibility_timeout`` after
    that: on a warm shutdown the worker gives its own back at once. A
    killed worker, or a killed adopt run, leaves them there.
    """

    channel: Any
    queue: str

    @classmethod
    def of(cls, app: Celery, channel: Any, queue: str) -> _RedisUnacked | None:
        """The unacknowledged messages of *queue*, when *channel* is kombu's Redis transport."""
        if not all(
            hasattr(channel, name)
            for name in ("unacked_key", "unacked_index_key", "visibility_timeout", "qos")
        ):
            return None
        declared = app.amqp.queues.get(queue)
        if declared is not None and declared.exchange is not None and declared.exchange.name:
            # kombu's Redis transport keeps exchange types in the process: the
            # app's exchange of the queue (topic, fanout) is matched as such.
            declared.exchange(channel).declare()
        return cls(channel, queue)

    def _mine(self) -> Iterator[tuple[str, float]]:
        """Yield (delivery tag, time taken) of each unacknowledged message of the queue."""
        client = self.channel.client
        index = client.zrange(self.channel.unacked_index_key, 0, -1, withscores=True)
        for start in range(0, len(index), 1000):
            chunk = index[start : start + 1000]
            tags = [tag for tag, _ in chunk]
            for (tag, taken), raw in zip(
                chunk, client.hmget(self.channel.unacked_key, tags), strict=True
            ):
                if raw is None:
                    continue
                try:
                    _, exchange, routing_key = json.loads(raw)
                except ValueError:
                    continue
                if self._routes_here(exchange, routing_key):
                    yield (tag.decode() if isinstance(tag, bytes) else str(tag)), float(taken)

    def _routes_here(self, exchange: str, routing_key: str) -> bool:
        if not exchange:
            return bool(routing_key == self.queue)
        table = self.channel.get_table(exchange)
        routed = self.channel.typeof(exchange).lookup(table, exchange, routing_key, None)
        return self.queue in routed

    def restore_visible(self) -> int:
        """Give back those taken more than ``visibility_timeout`` ago; return how many."""
        # kombu stamps each with this host's clock, and compares with it.
        ceiling = time.time() - float(self.channel.visibility_timeout)
        restored = 0
        for tag, taken in list(self._mine()):
            if taken <= ceiling:
                self.channel.qos.restore_by_tag(tag)
                restored += 1
        return restored

    def left(self) -> tuple[int, int | None]:
        """Return how many are still unacknowledged, and when the first may come back (ms)."""
        taken = [taken for _, taken in self._mine()]
        if not taken:
            return 0, None
        return len(taken), round((min(taken) + float(self.channel.visibility_timeout)) * 1000)
