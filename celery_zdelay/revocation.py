"""A cancel is a revoke wherever Celery users look.

Celery's ``revoke`` ends with the task ``REVOKED`` in the result backend and a
``task-revoked`` event that Flower shows. A parked task that is cancelled
never reaches a worker, so nothing in Celery would ever say so: without these
receivers ``AsyncResult(id).state`` stays ``PENDING`` for ever. Both are
receivers of :data:`celery_zdelay.signals.tasks_cancelled`, so every way of
cancelling (Python, CLI, dashboard) reports the same way, and an application
can connect its own receiver beside them.

Neither can undo or fail a cancel: it has happened when the signal is sent,
and Celery's signal dispatch logs a receiver's exception instead of raising it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from celery.backends.base import DisabledBackend

from . import signals

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["REVOKE_REASON", "connect_receivers"]

logger = logging.getLogger(__name__)

#: The reason stored with the ``REVOKED`` state (``TaskRevokedError``'s text).
REVOKE_REASON = "cancelled before release (celery-zdelay)"


def connect_receivers() -> None:
    """Connect the result-backend and event receivers (once; idempotent)."""
    signals.tasks_cancelled.connect(
        record_revoked, weak=False, dispatch_uid="celery_zdelay.revocation.record_revoked"
    )
    signals.tasks_cancelled.connect(
        send_revoked_events, weak=False, dispatch_uid="celery_zdelay.revocation.send_events"
    )


def record_revoked(sender: Celery, task_ids: list[str], **_: Any) -> None:
    """Store each cancelled id as ``REVOKED``, as a worker does for a revoked task."""
    backend = sender.backend
    if isinstance(backend, DisabledBackend):
        return
    for task_id in task_ids:
        backend.mark_as_revoked(task_id, REVOKE_REASON)


def send_revoked_events(sender: Celery, task_ids: list[str], **_: Any) -> None:
    """Send Celery's ``task-revoked`` event per id, when the app sends task events.

    Gated by Celery's own ``task_send_sent_event``, the setting that makes
    producers announce tasks (and celery-zdelay announce parked ones).
    """
    if not task_ids or not sender.conf.task_send_sent_event:
        return
    with sender.events.default_dispatcher() as dispatcher:
        for task_id in task_ids:
            dispatcher.send(
                "task-revoked", uuid=task_id, terminated=False, signum=None, expired=False
            )
