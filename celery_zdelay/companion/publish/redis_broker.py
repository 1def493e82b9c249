"""The Redis broker's publisher: each reply of the pipelined push read on its own.

On Redis a message counts as published once the reply to its push says so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kombu import Producer

from ...bulk_limit import DEFAULT_BULK_LIMIT, MessageTooLarge, bulk_limit, envelope_size, too_large
from ...entry import TaskMessage
from ...store.client import server_state
from .generic import MAX_BROKER_WAIT, Publisher, PublishOutcome

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["RedisPublisher"]

logger = logging.getLogger(__name__)


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
                outcome.rejected[index] = f"publish refused: {type(error).__name__}: {error}"
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
