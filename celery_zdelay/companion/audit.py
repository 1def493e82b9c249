"""The audit trail of releases (``zdelay_audit_log``): a receiver of the companion's signals.

One INFO line per task on the ``celery_zdelay.audit`` logger, as the
steering calls (cancel, reschedule, limits) write theirs. The companion
itself only sends ``batch_released`` and ``task_dead_lettered``; these
receivers turn them into lines, as :mod:`.metrics` turns them into counters.
"""

from __future__ import annotations

import logging
from typing import Any

from .. import signals

__all__ = ["audit", "connect"]

#: The opt-in audit trail (zdelay_audit_log): one INFO line per task.
audit = logging.getLogger("celery_zdelay.audit")


def connect(sender: Any) -> None:
    """Write the audit lines of companion *sender*'s releases and dead letters."""
    signals.batch_released.connect(_on_released, sender=sender, weak=False)
    signals.task_dead_lettered.connect(_on_dead_lettered, sender=sender, weak=False)


def disconnect(sender: Any) -> None:
    signals.batch_released.disconnect(_on_released, sender=sender)
    signals.task_dead_lettered.disconnect(_on_dead_lettered, sender=sender)


def _on_released(
    path: str, lateness_ms: list[int], task_ids: list[str] | None = None, **kwargs: Any
) -> None:
    # The handoff names what it moves whenever the audit log is on.
    for task_id, late_ms in zip(task_ids or (), lateness_ms, strict=False):
        audit.info(
            "Released %s (%s) %d ms after due", task_id, path, late_ms, extra={"task_id": task_id}
        )


def _on_dead_lettered(task_id: str, reason: str, **kwargs: Any) -> None:
    audit.info("Dead-lettered %s: %s", task_id, reason, extra={"task_id": task_id})
