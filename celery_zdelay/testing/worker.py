"""Run released task messages in the test process, the way a worker runs them.

Under ``task_always_eager`` nothing runs a worker, so :class:`InProcessWorker`
does its part: it takes the messages the companion released from the test's
broker (a key prefix of its own on the test Redis), wraps each in the task's
own ``Request`` class exactly as Celery's worker strategy does, and calls
``Request.execute()``, which is what a solo-pool worker runs: revocation and
expiry checks, ``task_prerun``/``task_postrun`` signals, result storage,
callbacks and chains, retries. Nothing here rebuilds a message or decodes
arguments itself: the task sees what a worker would have received.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery import signals, states
from celery.utils.imports import symbol_by_name
from kombu import Connection

if TYPE_CHECKING:
    from celery import Celery
    from kombu.message import Message

__all__ = ["InProcessWorker", "Outcome"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """How one run of a released task ended."""

    #: Celery state: SUCCESS, FAILURE, RETRY, REVOKED (expired), IGNORED...
    state: str
    #: The return value, or the exception the task raised.
    result: Any


class InProcessWorker:
    """Consumes the app's queues on the test broker and runs what it takes."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        #: Shown as the worker's host name in ``task.request.hostname``.
        self.hostname = f"zdelay-testing@{socket.gethostname()}"
        self._connection: Connection | None = None

    def close(self) -> None:
        """Close the broker connection."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    def fetch(self) -> dict[str, Message]:
        """Take every message waiting in the app's queues, by task id.

        The messages are not acknowledged yet: :meth:`run` acknowledges each
        as the worker would, and :meth:`give_back` returns the others.
        """
        if self._connection is None:
            # The app's broker was pointed at the test Redis when the test began.
            self._connection = self.app.connection_for_write()
        channel = self._connection.default_channel
        accept = self.app.conf.accept_content
        taken: dict[str, Message] = {}
        for queue in list(self.app.amqp.queues.values()):
            bound = queue.bind(channel)
            while True:
                message = bound.get(no_ack=False, accept=accept)
                if message is None:
                    break
                taken[str(message.headers.get("id"))] = message
        return taken

    def give_back(self, messages: dict[str, Message]) -> None:
        """Return messages :meth:`fetch` took but the test did not release."""
        for message in messages.values():
            message.reject(requeue=True)

    def run(self, message: Message) -> Outcome:
        """Run *message* as a worker's strategy and a solo pool would.

        Raises:
            celery.exceptions.NotRegistered: the app has no task of that name
                (a worker would log and discard the message).
        """
        headers = message.headers
        try:
            task = self.app.tasks[headers["task"]]
        except KeyError:
            message.reject(requeue=False)
            raise
        request_cls = symbol_by_name(task.Request)
        request = request_cls(
            message,
            on_ack=message.ack_log_error,
            on_reject=message.reject_log_error,
            app=self.app,
            hostname=self.hostname,
            eventer=None,
            task=task,
            connection_errors=self._connection.connection_errors if self._connection else (),
            body=message.body,
            headers=headers,
            decoded=False,
            utc=self.app.uses_utc_timezone(),
        )
        task_id = request.id
        seen: list[Outcome] = []

        def on_postrun(task_id: str, state: str, retval: Any, **_: Any) -> None:
            if task_id == request.id and not seen:
                seen.append(Outcome(state, retval))

        def on_revoked(request: Any, expired: bool = False, **_: Any) -> None:
            if getattr(request, "id", None) == task_id and not seen:
                seen.append(Outcome(states.REVOKED, "expired" if expired else "revoked"))

        signals.task_postrun.connect(on_postrun, weak=False)
        signals.task_revoked.connect(on_revoked, weak=False)
        try:
            request.execute()
        finally:
            signals.task_postrun.disconnect(on_postrun)
            signals.task_revoked.disconnect(on_revoked)
        # Request.execute returns without running only for a revoked task.
        return seen[0] if seen else Outcome(states.REVOKED, "revoked")
