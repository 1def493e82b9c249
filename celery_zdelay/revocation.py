"""A cancelled task ends ``REVOKED`` in the result backend, as a revoked one does.

Celery's ``revoke`` ends with the task ``REVOKED`` in the result backend. A
parked task that is cancelled never reaches a worker, so nothing in Celery
would ever record it: ``AsyncResult(id).state`` would stay ``PENDING`` for
ever. This is a receiver of :data:`celery_zdelay.signals.tasks_cancelled`, so
every way of cancelling (Python, CLI, dashboard, a keyed ``replace`` or
``debounce``, a periodic occurrence its schedule took back) records the same way; the
``task-revoked`` event is sent by :mod:`celery_zdelay.events`.

It cannot undo or fail a cancel: the cancel has happened when the signal is
sent, and Celery's signal dispatch logs a receiver's exception instead of
raising it.
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
    """Connect the result-backend receiver (idempotent)."""
    signals.tasks_cancelled.connect(
        record_revoked, weak=False, dispatch_uid="celery_zdelay.revocation.record_revoked"
    )


def record_revoked(sender: Celery, task_ids: list[str], **_: Any) -> None:
    """Store each cancelled id as ``REVOKED``, as a worker does for a revoked task."""
    backend = sender.backend
    if isinstance(backend, DisabledBackend):
        return
    for task_id in task_ids:
        backend.mark_as_revoked(task_id, REVOKE_REASON)
