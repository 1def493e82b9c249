"""What celery-zdelay does in a Celery worker: a start-up check, and the ETA a task sees.

A worker is where a forgotten companion or a misspelt setting would
otherwise go unnoticed: tasks are parked and never run, or transparent mode
is silently off. :class:`StartupCheck` logs each problem once, at start, and
never stops the worker.

A released message has no ``eta`` header: with one, Celery's worker would
hold it in its timer and raise its prefetch count for it (see
docs/transparent.rst, "The ETA a released task sees"). The ETA Celery would
have sent travels in the :data:`ETA_HEADER` header instead, and
:func:`restore_eta` puts it back into ``self.request.eta`` just before the
task runs, so task code sees what it would have seen without celery-zdelay.

A run that holds a key (an ``until_finished`` key, or a periodic
schedule's overlap key) frees it when it ends, however it ends: Celery's
``after_return`` is not called for ``Ignore``, ``Reject`` or a revoke, so
the receivers below listen to Celery's own signals instead (see
:func:`release_after_run`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from celery import bootsteps, signals, states
from celery.app.task import Context
from celery.exceptions import WorkerLostError

from .config import unknown_settings
from .errors import ZDelayError
from .keys import release_key

if TYPE_CHECKING:
    from celery import Celery

    from .entry import TaskMessage
    from .schedule import Due

__all__ = [
    "ETA_HEADER",
    "StartupCheck",
    "add_bootstep",
    "carry_eta",
    "not_this_runs_key",
    "release_after_internal_error",
    "release_after_revoke",
    "release_after_run",
    "release_after_worker_lost",
    "restore_eta",
    "startup_problems",
]

logger = logging.getLogger(__name__)

#: Header of a parked message holding the ETA Celery would have sent (an
#: ISO 8601 string, as Celery's own ``eta`` header), while ``eta`` is None.
ETA_HEADER = "zdelay_eta"


def startup_problems(app: Celery) -> list[str]:
    """Return what a worker of *app* should warn about: unknown settings, no store, no companion.

    An app that does not use celery-zdelay (no ``zdelay_*`` setting, not its
    task class) gets no warning, though importing ``celery_zdelay`` hooks it.
    """
    if not _uses_zdelay(app):
        return []
    problems = unknown_settings(app)
    if problems:
        return problems
    from .app_state import store_for
    from .store import admin

    try:
        warning = admin.no_companion_warning(store_for(app))
    except ZDelayError as exc:
        return [str(exc)]
    return [warning] if warning else []


def _uses_zdelay(app: Celery) -> bool:
    from .task import DelayedTaskMixin

    for key in list(app.conf.keys()):
        name = str(key).lower()
        if name.startswith(("zdelay_", "celery_zdelay_")):
            return True
    return isinstance(app.Task, type) and issubclass(app.Task, DelayedTaskMixin)


class StartupCheck(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker bootstep: log unknown ``zdelay_*`` settings and a missing companion."""

    label = "celery-zdelay startup check"

    def start(self, worker: Any) -> None:
        for problem in startup_problems(worker.app):
            logger.warning("%s", problem)


def add_bootstep(app: Celery) -> None:
    """Add :class:`StartupCheck` to the workers of *app* (once)."""
    app.steps["worker"].add(StartupCheck)


def carry_eta(app: Celery, messages: Iterable[TaskMessage], due: Due) -> None:
    """Put the ETA Celery would have sent for *due* into the :data:`ETA_HEADER` of *messages*.

    A message that has one already (transparent mode keeps the very string
    Celery wrote) keeps it. A countdown is counted from this host's clock
    and written in the app's time zone, as Celery writes an ``eta``; the
    release itself goes by the Redis clock.
    """
    eta_ms = due.ms if due.mode == "a" else time.time() * 1000 + due.ms
    eta = datetime.fromtimestamp(eta_ms / 1000, tz=app.timezone).isoformat()
    for message in messages:
        message.headers.setdefault(ETA_HEADER, eta)


@signals.task_prerun.connect(weak=False)  # type: ignore[untyped-decorator]
def restore_eta(task: Any = None, **_: Any) -> None:
    """Celery ``task_prerun`` receiver: give a released task its ETA back in ``request.eta``.

    Connected in every process that imports ``celery_zdelay``, for every
    app. The header is taken out of ``request.headers`` too: Celery copies
    those into the message of a ``retry()``, whose own ETA (or none) must
    not be overwritten by this one's when it runs.
    """
    request: Any = getattr(task, "request", None)
    # Celery's Context holds every message header as an attribute (and, on
    # Celery >= 5.3, the custom ones in request.headers as well).
    eta = getattr(request, "__dict__", {}).get(ETA_HEADER)
    if eta is None:
        return
    headers = request.headers
    if isinstance(headers, dict):
        headers.pop(ETA_HEADER, None)
    if request.eta is None:
        request.eta = eta


# -- the end of a run: free the key it held -------------------------------------------

#: Request attribute set on a delivery that must not free the key of its
#: task id: a second delivery the worker-side guard refused while the first
#: one runs (:meth:`celery_zdelay.DelayedTaskMixin.before_start`).
_NOT_THIS_RUNS_KEY = "zdelay_not_this_runs_key"

#: Per thread of a pool process: the id of the last run whose key was freed
#: by :func:`release_after_run`, so ``task_internal_error`` after it does not
#: free it twice.
_ended = threading.local()


def not_this_runs_key(request: Any) -> None:
    """Mark *request*'s delivery as one whose end must not free its task id's key."""
    setattr(request, _NOT_THIS_RUNS_KEY, True)


@signals.task_prerun.connect(weak=False)  # type: ignore[untyped-decorator]
def _run_starts(task: Any = None, **_: Any) -> None:
    _ended.task_id = None


@signals.task_postrun.connect(weak=False)  # type: ignore[untyped-decorator]
def release_after_run(task: Any = None, state: Any = None, retval: Any = None, **_: Any) -> None:
    """Celery ``task_postrun`` receiver: free the key of the run that just ended.

    Sent in the pool process for every end of a run that reached the task:
    return and failure, and also ``Ignore`` and ``Reject``, for which Celery
    calls no ``after_return``. Two ends keep the key, because the same task
    id runs again and its end frees it: a retry (``Task.retry``), and
    ``Reject(requeue=True)`` of an ``acks_late`` task (the broker delivers the
    message again).
    """
    request: Any = getattr(task, "request", None)
    if request is None or getattr(request, _NOT_THIS_RUNS_KEY, False):
        return
    if state == states.RETRY:
        return
    if state == states.REJECTED and getattr(retval, "requeue", False) and task.acks_late:
        return
    _ended.task_id = request.id
    release_key(task, request)


@signals.task_revoked.connect(weak=False)  # type: ignore[untyped-decorator]
def release_after_revoke(sender: Any = None, request: Any = None, **_: Any) -> None:
    """Celery ``task_revoked`` receiver: free the key of a task revoked in this worker.

    Sent in the worker's main process, for a run ended by ``revoke(...,
    terminate=True)`` (its pool process never reports an end) and for a
    message the worker dropped unrun (revoked before it started, or expired).
    """
    if sender is not None and request is not None:
        release_key(sender, request)


@signals.task_failure.connect(weak=False)  # type: ignore[untyped-decorator]
def release_after_worker_lost(sender: Any = None, exception: Any = None, **_: Any) -> None:
    """Celery ``task_failure`` receiver: free the key of a run whose pool process died.

    The worker's main process reports a pool process that died mid-run
    (SIGKILL, out of memory) as ``WorkerLostError``, with the run's request
    pushed. Other failures are freed by :func:`release_after_run` in the pool
    process. (A message requeued by ``reject_on_worker_lost`` sends no
    failure: its next run frees the key.)
    """
    if sender is not None and isinstance(exception, WorkerLostError):
        release_key(sender)


@signals.task_internal_error.connect(weak=False)  # type: ignore[untyped-decorator]
def release_after_internal_error(
    sender: Any = None, task_id: str | None = None, request: Any = None, **_: Any
) -> None:
    """Celery ``task_internal_error`` receiver: free the key of a run Celery failed to trace.

    Unless :func:`release_after_run` freed it already for this run.
    """
    if sender is None or request is None or getattr(_ended, "task_id", None) == task_id:
        return
    release_key(sender, request if isinstance(request, Context) else Context(request))
