"""Steer parked tasks: cancel, reschedule, look up, requeue and purge dead letters.

The one way every caller changes what is parked: the Python API
(re-exported by :mod:`celery_zdelay`), the command line and the dashboard
all call these functions, so each change is announced the same way (the
signals, hence REVOKED results and Celery events) and written to the audit
trail (``zdelay_audit_log``) naming who acted (*by*: ``"cli:alice"``,
``"dashboard:alice"``).

Each function takes the id the caller holds, whatever was parked: a task,
or a canvas (a chain parks its first task, a group its members, and the
result the caller got names neither; :func:`celery_zdelay.apply_delayed`
remembered which ids it parked for it). *app* defaults to
``celery.current_app``, as Celery's own API does.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import celery

from . import signals
from ._format import utc
from .app_state import store_for
from .config import get_config
from .errors import ConfigurationError
from .keys import validate_tag
from .names import validate_task_id
from .schedule import Due, due_from
from .store import Store, admin
from .store.client import store_errors
from .store.lookup import find, select
from .store.read_model import EntryState, ParkedTask
from .store.reading import ADMIN_BATCH
from .store.redis_keys import canvas_key

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "EntryState",
    "ParkedTask",
    "announce_cancelled",
    "audit_line",
    "cancel",
    "cancel_ids",
    "cancel_matching",
    "lookup",
    "purge_dead",
    "requeue_all_dead",
    "requeue_dead",
    "reschedule",
    "reschedule_ids",
    "reschedule_matching",
]

#: Logger of the opt-in audit trail (``zdelay_audit_log``): one line per task.
audit = logging.getLogger("celery_zdelay.audit")


def cancel(task_id: str, *, app: Celery | None = None, by: str | None = None) -> bool:
    """Cancel a parked task or canvas (held ones too); return whether anything was still parked.

    For a canvas parked with :func:`celery_zdelay.apply_delayed`, *task_id*
    may be the id of the result it returned (a chain's last task, a group):
    every task parked for it is cancelled. False means nothing was parked
    under the id any more: unknown, released, or being released right now.

    A cancelled task ends ``REVOKED`` in the result backend, as a revoked one
    does, and :data:`~celery_zdelay.signals.tasks_cancelled` is sent with
    *by* (who cancelled, for receivers and audit trails).
    """
    return cancel_ids([task_id], app=app, by=by)[0]


def cancel_ids(
    task_ids: Sequence[str], *, app: Celery | None = None, by: str | None = None
) -> list[bool]:
    """:func:`cancel` for many ids at once; return, per id, whether anything was parked.

    Plain task ids are cancelled in one call per shard; only the ids not
    found that way are looked up as canvas result ids.
    """
    task_ids = _checked(task_ids)
    app = _app(app)
    store = store_for(app)
    found = store.cancel(list(task_ids), by=by)
    cancelled = [task_id for task_id, done in zip(task_ids, found, strict=True) if done]
    results = list(found)
    for index, (task_id, done) in enumerate(zip(task_ids, found, strict=True)):
        if not done:
            members = _cancel_canvas(store, task_id, by)
            # The canvas's result id never runs either: report it with its members.
            cancelled += [*members, task_id] if members else []
            results[index] = bool(members)
    announce_cancelled(app, cancelled, by)
    return results


def _cancel_canvas(store: Store, result_id: str, by: str | None = None) -> list[str]:
    """Cancel what was parked for the canvas whose result id is *result_id*; return those ids."""
    members = _canvas_members(store, result_id)
    return [m for m, done in zip(members, store.cancel(members, by=by), strict=True) if done]


def reschedule(
    task_id: str,
    *,
    countdown: Any = None,
    eta: Any = None,
    app: Celery | None = None,
    by: str | None = None,
) -> bool:
    """Move a parked task or canvas to a new due time; return whether it was parked.

    *countdown* is seconds from now on the Redis clock, *eta* a datetime
    (naive means UTC); a time in the past makes it due at once. A task held
    back by a pause or a rate limit goes back into the due set at that time
    and passes the pause or limit again when due. A canvas is found by its
    result's id, as with :func:`cancel`.
    :data:`~celery_zdelay.signals.tasks_rescheduled` is sent with *by* (who
    moved it, for receivers and audit trails).
    """
    (task_id,) = _checked([task_id])
    app = _app(app)
    due = due_from(countdown, eta)
    store = store_for(app)
    moved = store.reschedule(task_id, due)
    if moved is not None:
        _rescheduled(app, [(task_id, moved)], by)
        return True
    moves = []
    for member in _canvas_members(store, task_id):
        member_ms = store.reschedule(member, due)
        if member_ms is not None:
            moves.append((member, member_ms))
    _rescheduled(app, moves, by)
    return bool(moves)


def reschedule_ids(
    task_ids: Sequence[str], due: Due, *, app: Celery | None = None, by: str | None = None
) -> list[bool]:
    """Move parked tasks (not canvases) to *due*; return, per id, whether it was parked.

    The dashboard's bulk form of :func:`reschedule`: the ids were selected
    first, so an entry moved into the selection is not moved twice.
    """
    task_ids = _checked(task_ids)
    app = _app(app)
    store = store_for(app)
    moved = []
    moves = []
    for task_id in task_ids:
        due_ms = store.reschedule(task_id, due)
        moved.append(due_ms is not None)
        if due_ms is not None:
            moves.append((task_id, due_ms))
    _rescheduled(app, moves, by)
    return moved


def lookup(task_id: str, *, app: Celery | None = None) -> ParkedTask | None:
    """Return what celery-zdelay holds under *task_id*, or None.

    The :class:`~celery_zdelay.ParkedTask` says its state (an
    :class:`~celery_zdelay.EntryState`: ``"parked"``, ``"held"`` behind a
    pause or rate limit, with ``held_by`` and ``held_reason``,
    ``"in_flight"`` or ``"dead"``), due time (``due``, an aware
    UTC datetime), task name and queue, e.g. to tell a customer "your order
    is cancelled at 10:32". For a canvas's result id it describes the first
    task parked for it (``task_id`` then names that task). None means the
    task was released (or cancelled), or never parked.
    """
    (task_id,) = _checked([task_id])
    store = store_for(_app(app))
    found = find(store, task_id)
    if found is not None:
        return found
    for member in _canvas_members(store, task_id):
        found = find(store, member)
        if found is not None:
            return found
    return None


def cancel_matching(
    *,
    task: str | None = None,
    queue: str | None = None,
    due_after: datetime | timedelta | None = None,
    due_before: datetime | timedelta | None = None,
    tag: str | None = None,
    dry_run: bool = False,
    app: Celery | None = None,
    by: str | None = None,
) -> int:
    """Cancel every parked task that matches; return how many were (or would be) cancelled.

    *task* and *queue* are names or glob patterns (``"proj.orders.*"``);
    *due_after*/*due_before* select due times in ``[after, before)``, as
    datetimes (naive means UTC) or timedeltas from now on the Redis clock;
    *tag* selects the tasks parked with that tag (``tags=[...]``), on every
    shard. At least one filter is required; several must all match. With
    *dry_run* nothing changes. Each cancelled task is reported as
    :func:`cancel` reports it.
    """
    app = _app(app)
    store = store_for(app)
    ids = _select(store, task, queue, due_after, due_before, tag)
    if dry_run:
        return len(ids)
    cancelled = 0
    how = "tag" if tag is not None else "matching"
    for start in range(0, len(ids), ADMIN_BATCH):
        chunk = ids[start : start + ADMIN_BATCH]
        found = store.cancel(chunk, how=how, by=by)
        done_ids = [t for t, done in zip(chunk, found, strict=True) if done]
        announce_cancelled(app, done_ids, by)
        cancelled += len(done_ids)
    return cancelled


def reschedule_matching(
    *,
    countdown: Any = None,
    eta: Any = None,
    task: str | None = None,
    queue: str | None = None,
    due_after: datetime | timedelta | None = None,
    due_before: datetime | timedelta | None = None,
    tag: str | None = None,
    dry_run: bool = False,
    app: Celery | None = None,
    by: str | None = None,
) -> int:
    """Move every parked task that matches to a new due time; return how many moved.

    Filters as for :func:`cancel_matching`; the new time as for
    :func:`reschedule`. The matches are selected first, so a task moved into
    the selected range is not moved twice.
    """
    app = _app(app)
    due = due_from(countdown, eta)
    store = store_for(app)
    ids = _select(store, task, queue, due_after, due_before, tag)
    if dry_run:
        return len(ids)
    moves = []
    for task_id in ids:
        due_ms = store.reschedule(task_id, due)
        if due_ms is not None:
            moves.append((task_id, due_ms))
    _rescheduled(app, moves, by)
    return len(moves)


def requeue_dead(
    task_ids: Sequence[str], *, app: Celery | None = None, by: str | None = None
) -> list[bool]:
    """Park dead-lettered entries again, due now; return, per id, whether it was.

    An id is not requeued when it is not dead-lettered, has no message, or
    was parked again since (see :func:`celery_zdelay.store.admin.requeue_dead`).
    """
    task_ids = _checked(task_ids)
    app = _app(app)
    flags = admin.requeue_dead(store_for(app), task_ids)
    for task_id, done in zip(task_ids, flags, strict=True):
        if done:
            audit_line(app, "Requeued %s, due now", task_id, by=by, task_id=task_id)
    return flags


def requeue_all_dead(*, app: Celery | None = None, by: str | None = None) -> tuple[int, int]:
    """Requeue every entry dead-lettered so far; return (requeued, left dead-lettered)."""
    app = _app(app)
    requeued, left = admin.requeue_all_dead(store_for(app))
    if requeued:
        audit_line(app, "Requeued every dead-lettered entry (%d), due now", requeued, by=by)
    return requeued, left


def purge_dead(
    task_ids: Sequence[str] | None = None, *, app: Celery | None = None, by: str | None = None
) -> int:
    """Delete dead-lettered entries (*task_ids*, or all) for good; return how many were."""
    if task_ids is not None:
        task_ids = _checked(task_ids)
    app = _app(app)
    purged = admin.purge_dead(store_for(app), task_ids)
    if purged and task_ids is None:
        audit_line(app, "Purged every dead-lettered entry (%d)", purged, by=by)
    elif purged and task_ids is not None:
        asked = ", ".join(task_ids)
        audit_line(app, "Purged %d dead-lettered entries (asked: %s)", purged, asked, by=by)
    return purged


def audit_line(app: Celery, message: str, *args: Any, by: str | None, **extra: Any) -> None:
    """Write one line of the audit trail (``zdelay_audit_log``), naming who acted (*by*).

    *extra* goes on the log record (``task_id``, ``control``) for structured logs.
    """
    if get_config(app).audit_log:
        audit.info(message + _by_text(by), *args, extra=extra)


def _checked(task_ids: Sequence[str]) -> list[str]:
    """Return *task_ids*, each checked as an id (:mod:`celery_zdelay.names`).

    No task is parked under an id that breaks the rule, and an id that
    reached an audit line with a newline would forge a second line.
    """
    return [validate_task_id(task_id, done="changed") for task_id in task_ids]


def _app(app: Celery | None) -> Celery:
    return app if app is not None else celery.current_app._get_current_object()


def _canvas_members(store: Store, result_id: str) -> list[str]:
    """Return the ids parked for the canvas whose result id is *result_id* (none: [])."""
    with store_errors(store.url):
        members = store.client.smembers(canvas_key(store.config.key_prefix, result_id))
    return sorted(m.decode() if isinstance(m, bytes) else str(m) for m in members)


def _select(
    store: Store,
    task: str | None,
    queue: str | None,
    due_after: datetime | timedelta | None,
    due_before: datetime | timedelta | None,
    tag: str | None = None,
) -> list[str]:
    if task is None and queue is None and due_after is None and due_before is None and tag is None:
        raise ConfigurationError(
            "Give at least one of task=, queue=, due_after=, due_before=, tag= "
            '(task="*" matches every task).'
        )
    if tag is not None:
        validate_tag(tag)
    now_ms = store.time_ms() if _relative(due_after, due_before) else 0
    return select(
        store,
        task=task,
        queue=queue,
        due_after_ms=_ms(due_after, now_ms),
        due_before_ms=_ms(due_before, now_ms),
        tag=tag,
    )


def _relative(*whens: datetime | timedelta | None) -> bool:
    return any(isinstance(w, timedelta) for w in whens)


def _ms(when: datetime | timedelta | None, now_ms: int) -> int | None:
    if when is None:
        return None
    if isinstance(when, timedelta):
        return now_ms + round(when.total_seconds() * 1000)
    due = due_from(eta=when)
    return due.ms


def announce_cancelled(app: Celery, task_ids: list[str], by: str | None, *, why: str = "") -> None:
    """Audit and announce *task_ids* as cancelled: parked, and now never run.

    Every way a parked task is taken out before it runs reports it here, once:
    a cancel by id, canvas or filter, a keyed call whose ``replace`` or
    ``debounce`` took the parked task out, and a periodic occurrence its
    schedule's change, pause or removal took back (*why* says so in the
    audit line).
    The receivers of :data:`~celery_zdelay.signals.tasks_cancelled` record it
    ``REVOKED`` (:mod:`.revocation`) and send ``task-revoked`` (:mod:`.events`).
    """
    if not task_ids:
        return
    for task_id in task_ids:
        audit_line(app, "Cancelled %s%s", task_id, why, by=by, task_id=task_id)
    signals.tasks_cancelled.send(sender=app, task_ids=task_ids, by=by)


def _rescheduled(app: Celery, moves: list[tuple[str, int]], by: str | None) -> None:
    """Audit and announce *moves* (id, new due ms) (receiver: :mod:`.events`)."""
    if not moves:
        return
    for task_id, due_ms in moves:
        audit_line(app, "Rescheduled %s: due %s", task_id, utc(due_ms), by=by, task_id=task_id)
    signals.tasks_rescheduled.send(
        sender=app, task_ids=[m[0] for m in moves], due_ms=[m[1] for m in moves], by=by
    )


def _by_text(by: str | None) -> str:
    """The audit line's " by <who>" (``%`` escaped: it joins a format string)."""
    return f" by {by.replace('%', '%%')}" if by else ""
