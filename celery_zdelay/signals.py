"""Signals the companion sends, in the style of Celery's own.

Connect a receiver to react to releases and dead letters (metrics, alerts,
audit logs)::

    from celery_zdelay.signals import task_dead_lettered

    @task_dead_lettered.connect
    def alert(sender, task_id, reason, **kwargs):
        ...

Receivers run in the companion process, inside its release loop: keep them
quick. An exception in a receiver is logged and does not stop the companion.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = [
    "batch_claimed",
    "batch_released",
    "companion_started",
    "companion_stopped",
    "control_changed",
    "task_dead_lettered",
    "tasks_cancelled",
    "tasks_held",
    "tasks_parked",
    "tasks_rescheduled",
    "tasks_stale",
]

#: Sent when a companion starts releasing. Sender: the
#: :class:`~celery_zdelay.companion.Companion`.
companion_started = Signal(name="zdelay_companion_started")

#: Sent when a companion stops. Sender: the companion.
companion_stopped = Signal(name="zdelay_companion_stopped")

#: Sent after each claim call. Sender: the companion. Arguments: ``shard``,
#: ``claimed`` (entries the call took), ``seconds`` (its duration).
batch_claimed = Signal(name="zdelay_batch_claimed")

#: Sent when entries reached the broker. Sender: the companion. Arguments:
#: ``shard``; ``path``, ``"handoff"`` (atomic Lua push into a Redis broker) or
#: ``"publish"`` (kombu, confirmed by the broker); ``count``; ``lateness_ms``,
#: a list with each entry's release time minus its due time; ``task_ids``,
#: the ids released (for the handoff, which moves them in Lua, ``None`` unless
#: it named them: with ``zdelay_audit_log``, or near a periodic occurrence);
#: ``headers``, each released message's headers as published (``None`` for
#: the handoff, which does not read the messages it moves).
batch_released = Signal(name="zdelay_batch_released")

#: Sent when an entry moved to the dead-letter set. Sender: the companion.
#: Arguments: ``shard``, ``task_id``, ``reason`` (text), ``due_ms``.
task_dead_lettered = Signal(name="zdelay_task_dead_lettered")

#: Sent when a companion found entries stale: claimed later than their
#: ``max_late`` after their due time (:mod:`celery_zdelay.stale`). Sender: the
#: companion. Arguments: ``shard``; ``outcome``, what ``zdelay_on_stale`` did:
#: ``"dead"`` (dead-lettered with reason ``"stale"``; ``task_dead_lettered``
#: is sent for each too), ``"drop"`` (cancelled; ``tasks_cancelled`` is sent
#: too) or ``"run"`` (published anyway: sent once the broker took them);
#: ``task_ids``; ``lateness_ms``, how late each was when it was claimed
#: (Redis clock).
tasks_stale = Signal(name="zdelay_tasks_stale")

#: Sent when a rate limit or a pause held entries back (parked in Redis until
#: it allows them). Sender: the companion. Arguments: ``shard``; ``control``,
#: the control name (``"queue:emails"``, ``"task:proj.sms"``); ``reason``,
#: ``"rate_limit"``, ``"concurrency"`` or ``"pause"``; ``count``.
tasks_held = Signal(name="zdelay_tasks_held")

#: Sent after parked tasks were cancelled, whoever cancelled them (Python,
#: the CLI, the dashboard, or a keyed call whose ``on_key="replace"`` or
#: ``"debounce"`` took the parked task out, or a companion that dropped a
#: stale task: ``zdelay_on_stale = "drop"``). Sent in the process that
#: cancelled. Sender: the Celery app. Arguments: ``task_ids``, the ids that
#: were still parked and now never run (for a canvas, its result id too);
#: ``by``, who cancelled where known (``"cli:alice"``,
#: ``"dashboard:alice"``) or None. celery-zdelay's own receivers record each
#: id as ``REVOKED`` in the result backend (:mod:`celery_zdelay.revocation`)
#: and send Celery's ``task-revoked`` event (:mod:`celery_zdelay.events`).
tasks_cancelled = Signal(name="zdelay_tasks_cancelled")

#: Sent after messages were parked, in the process that parked them (after
#: a :func:`celery_zdelay.batch` block, when it parks). Never sent for a call
#: that was not parked. Sender: the Celery app. Arguments: ``messages``, the
#: parked :class:`~celery_zdelay.entry.TaskMessage` objects (headers as
#: parked), and ``due_ms``, each one's due time in ms on the Redis clock.
tasks_parked = Signal(name="zdelay_tasks_parked")

#: Sent after parked tasks were moved to a new due time, whoever moved them
#: (Python, the CLI, the dashboard), in the process that moved them. Sender:
#: the Celery app. Arguments: ``task_ids``, the ids moved; ``due_ms``, each
#: one's new due time in ms on the Redis clock; ``by``, who moved them where
#: known, or None. celery-zdelay's own receiver sends Celery's ``task-sent``
#: event again with the new ``eta`` (:mod:`celery_zdelay.events`).
tasks_rescheduled = Signal(name="zdelay_tasks_rescheduled")

#: Sent after a rate limit or a pause was set, changed or removed, whoever
#: changed it (Python, the CLI, the dashboard), in the process that changed
#: it, not in the companions. Sender: the Celery app. Arguments: ``name``,
#: the control (``"queue:emails"``, ``"task:proj.sms"``); ``change``, what
#: changed, as the audit line says it (``"Paused queue:emails (since
#: 2026-...)"``); ``by``, who changed it where known (``"cli:alice"``,
#: ``"dashboard:alice"``) or None. Not sent for a resume of a name that was
#: not paused. The Django mount of the dashboard writes an admin
#: ``LogEntry`` from it (:mod:`celery_zdelay.web.django`).
control_changed = Signal(name="zdelay_control_changed")
