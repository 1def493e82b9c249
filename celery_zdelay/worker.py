"""What celery-zdelay does in a Celery worker: every hook of a run, in one module.

A worker is where a forgotten companion or a misspelt setting would
otherwise go unnoticed: tasks are parked and never run, or transparent mode
is silently off. :class:`StartupCheck`, the worker bootstep, logs each
problem once, at start, and never stops the worker.

Then, around each run of a task:

- **before it starts** (Celery's ``task_prerun`` and the task class's
  ``before_start``, see :class:`RunHooks`): :func:`restore_eta` gives a
  released task the ETA Celery would have sent back in ``request.eta``;
  :func:`refuse_second_delivery` drops a second publish of a released task
  (``zdelay_worker_dedupe``); :func:`apply_overlap_policy` runs, waits or
  skips a periodic occurrence by its schedule's overlap policy;
- **when it ends**: :func:`note_run_finished` records the end for the guard,
  and :func:`release_key` frees the key the run took (an ``until_finished``
  key, or a schedule's overlap key) and its concurrency slots
  (``zdelay_concurrency``) however the run ends: Celery's
  ``after_return`` is not called for ``Ignore``, ``Reject`` or a revoke, so
  the receivers at the end of this module listen to Celery's own signals
  (see :func:`release_after_run`).

The ETA. A released message has no ``eta`` header: with one, Celery's
worker would hold it in its timer and raise its prefetch count for it (see
docs/transparent.rst, "The ETA a released task sees"). The ETA Celery would
have sent travels in the ``zdelay_eta`` header instead
(:func:`celery_zdelay.parking.carry_eta`). The exception is a release ahead
(``zdelay_release_ahead_seconds``): its ``eta`` is its due time, a few ms
away, for the worker's timer to start it then.

The second-delivery guard. Releases through a Redis broker are exactly
once. Through other brokers they are at least once: a companion killed
after the broker accepted a message but before the store forgot it lets the
entry be published again when its lease expires. With
``zdelay_worker_dedupe = True``:

- each parked message carries a ``zdelay_park`` header, a random id of that
  park (parking the same task id again gets a new one);
- before a task starts, the worker records ``<park id>:<retries>`` in the
  store with ``SET NX`` for :data:`SEEN_SECONDS`; when the run ends (success
  or failure) the record says so;
- a later delivery that finds the record is a second *publish* by a companion
  and is dropped (Celery's ``Ignore``: no result is stored, no callbacks
  run) — unless the broker marks it *redelivered*: then it is the same
  publish coming back (``Reject(requeue=True)``, a worker killed mid-run with
  ``acks_late``, a Redis visibility timeout) and it runs, unless the record
  says a run already finished.

The guard never loses a task to save a duplicate: a redelivery runs whenever
an earlier run may not have finished, and if the store cannot be reached the
task runs. Retries count separately, so ``Task.retry`` still works. The
companion republishes the very bytes it verified (signing), so two publishes
cannot be told apart by their content; the broker's redelivered flag
(``delivery_info['redelivered']``: AMQP sets it, and kombu's Redis transport
sets it when it restores an unacknowledged message) is what tells them apart.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from celery import bootsteps, signals, states
from celery.app.task import Context
from celery.exceptions import Ignore, WorkerLostError
from redis.exceptions import RedisError

from .app_state import store_for
from .concurrency import slots_of
from .config import get_config, unknown_settings
from .errors import ZDelayError
from .periodic.overlap import overlap_key_of_run
from .periodic.store import PeriodicStore
from .store import admin
from .store.control import ControlStore, free_slots
from .store.headers import (
    ETA_HEADER,
    KEY_HEADER,
    LIMIT_KEY_HEADER,
    ON_KEY_HEADER,
    OVERLAP_HEADER,
    OVERLAP_TIMEOUT_HEADER,
    PARK_HEADER,
    SCHEDULE_HEADER,
    header_of,
)
from .store.marks import finish_key, start_run
from .store.redis_keys import seen_key

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "SEEN_SECONDS",
    "RunHooks",
    "StartupCheck",
    "add_bootstep",
    "apply_overlap_policy",
    "note_run_finished",
    "refuse_second_delivery",
    "release_after_internal_error",
    "release_after_revoke",
    "release_after_run",
    "release_after_worker_lost",
    "release_key",
    "release_slots",
    "restore_eta",
    "startup_problems",
]

logger = logging.getLogger(__name__)

#: How long a first delivery is remembered by the guard: far longer than a lease.
SEEN_SECONDS = 24 * 3600
#: The guard's record values: a run started, a run ended (success or failure).
RUNNING, FINISHED = b"running", b"finished"
#: How often a buffered periodic occurrence asks whether the run before it ended.
BUFFER_POLL_SECONDS = 0.2
#: Request attribute set on a delivery that must not free the key of its
#: task id: a second delivery the worker-side guard refused while the first
#: one runs (:meth:`RunHooks.before_start`).
_NOT_THIS_RUNS_KEY = "zdelay_not_this_runs_key"


# -- the worker starts -----------------------------------------------------------------


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
    try:
        warning = admin.no_companion_warning(store_for(app))
    except ZDelayError as exc:
        return [str(exc)]
    return [warning] if warning else []


def _uses_zdelay(app: Celery) -> bool:
    for key in list(app.conf.keys()):
        name = str(key).lower()
        if name.startswith(("zdelay_", "celery_zdelay_")):
            return True
    return isinstance(app.Task, type) and issubclass(app.Task, RunHooks)


class StartupCheck(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker bootstep: log unknown ``zdelay_*`` settings and a missing companion."""

    label = "celery-zdelay startup check"

    def start(self, worker: Any) -> None:
        for problem in startup_problems(worker.app):
            logger.warning("%s", problem)


def add_bootstep(app: Celery) -> None:
    """Add :class:`StartupCheck` to the workers of *app* (once)."""
    app.steps["worker"].add(StartupCheck)


# -- a run starts ----------------------------------------------------------------------


class RunHooks:
    """The hooks of a run a task class carries; :class:`celery_zdelay.DelayedTaskMixin` has them.

    Celery calls ``before_start`` in the worker just before the task runs
    (raising ``Ignore`` there skips the run) and ``after_return`` after a
    success or a failure; the other ends of a run are Celery signals,
    received below.
    """

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        """Drop a second delivery (``zdelay_worker_dedupe``); apply a schedule's overlap policy."""
        try:
            refuse_second_delivery(self)
        except Ignore:
            # A second delivery of a task id that runs elsewhere: its key is
            # that run's, which frees it when it ends.
            setattr(self.request, _NOT_THIS_RUNS_KEY, True)  # type: ignore[attr-defined]
            raise
        apply_overlap_policy(self)
        super().before_start(task_id, args, kwargs)  # type: ignore[misc]

    def after_return(
        self, status: str, retval: Any, task_id: str, args: Any, kwargs: Any, einfo: Any
    ) -> None:
        """Tell the worker-side guard that a run ended.

        An ``until_finished`` key is freed by :func:`release_after_run` and
        its siblings on every end of a run, including those Celery calls no
        ``after_return`` for.
        """
        note_run_finished(self)
        super().after_return(status, retval, task_id, args, kwargs, einfo)  # type: ignore[misc]


@signals.task_prerun.connect(weak=False)  # type: ignore[untyped-decorator]
def restore_eta(task: Any = None, **_: Any) -> None:
    """Celery ``task_prerun`` receiver: give a released task its ETA back in ``request.eta``.

    It travels in the ``zdelay_eta`` header (``store.headers.ETA_HEADER``).
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
    # Also over the eta of a release ahead (zdelay_release_ahead_seconds):
    # that one is the due time the worker's timer waited for, this one the
    # ETA Celery would have sent (a countdown's, before any jitter).
    request.eta = eta


# -- the second-delivery guard (zdelay_worker_dedupe) ----------------------------------


def refuse_second_delivery(task: Any) -> None:
    """Raise ``Ignore`` when this delivery is a second publish of a released task.

    Called by :meth:`RunHooks.before_start`.
    """
    key = _seen_key(task)
    if key is None:
        return
    request = task.request
    redelivered = bool((request.delivery_info or {}).get("redelivered"))
    try:
        client = _client(task)
        if client.set(key, RUNNING, nx=True, ex=SEEN_SECONDS):
            return  # the first delivery
        finished = redelivered and client.get(key) == FINISHED
    except (ZDelayError, RedisError, OSError) as exc:
        # Run the task rather than lose it.
        logger.warning(
            "Could not check %s[%s] for a second delivery: %r", task.name, request.id, exc
        )
        return
    if redelivered and not finished:
        # The broker gave back a delivery nobody acknowledged: the run that
        # saw it first may have died. Running it again is the only safe choice.
        logger.info(
            "Running a redelivery of %s[%s]: the broker gave it back unacknowledged",
            task.name,
            request.id,
        )
        return
    logger.warning(
        "Dropped a second delivery of %s[%s]: %s",
        task.name,
        request.id,
        "a run of it already finished"
        if redelivered
        else "celery-zdelay published it twice (a companion died after publishing it)",
    )
    raise Ignore()


def note_run_finished(task: Any) -> None:
    """Record that a guarded run ended (success or failure), so a redelivery is dropped.

    Called by :meth:`RunHooks.after_return`, which Celery calls for
    successes and failures only, not for ``Reject``, ``Ignore`` or ``Retry``.
    """
    key = _seen_key(task)
    if key is None:
        return
    try:
        _client(task).set(key, FINISHED, xx=True, keepttl=True)
    except (ZDelayError, RedisError, OSError) as exc:
        # A later redelivery will run again: a duplicate, never a loss.
        logger.warning("Could not record the end of %s[%s]: %r", task.name, task.request.id, exc)


def _seen_key(task: Any) -> str | None:
    """The guard's record of this park and retry, or None when the guard is off."""
    request = task.request
    park_id = header_of(request, PARK_HEADER)
    if not park_id or request.is_eager:
        return None
    config = get_config(task._get_app())
    if not config.worker_dedupe:
        return None
    return seen_key(config.key_prefix, park_id, request.retries or 0)


def _client(task: Any) -> Any:
    return store_for(task._get_app()).client


# -- a periodic occurrence's overlap policy --------------------------------------------


def apply_overlap_policy(task: Any) -> None:
    """Run, wait or skip the periodic occurrence about to run here, by its schedule's policy.

    Called by :meth:`RunHooks.before_start` (see :mod:`celery_zdelay.periodic.overlap`).
    Raises ``celery.exceptions.Ignore`` to skip it (counted as skipped by
    overlap). With ``buffer_one`` it waits here, in this worker process,
    until the run before it ends or is taken to have ended. Should the store be out
    of reach, the occurrence runs: the policy is a guard against piling up
    runs, and a tick not run cannot be run later.
    """
    request = task.request
    key = overlap_key_of_run(request)
    if key is None or request.is_eager or not request.id:
        return
    app = task._get_app()
    policy = header_of(request, OVERLAP_HEADER)
    name = header_of(request, SCHEDULE_HEADER)
    timeout = header_of(request, OVERLAP_TIMEOUT_HEADER)
    max_run_ms = timeout if isinstance(timeout, int) and timeout > 0 else get_config(app).max_run_ms
    waited = False
    while True:
        try:
            store = store_for(app)
            verdict, owner = start_run(store, key, request.id, max_run_ms=max_run_ms, policy=policy)
            if verdict == "skip":
                PeriodicStore(store).count(name, "skipped_overlap")
        except (ZDelayError, RedisError, OSError) as exc:
            logger.warning(
                "Periodic task %r: could not check its overlap policy (%r); running %s",
                name,
                exc,
                request.id,
                extra={"task_id": request.id},
            )
            return
        if verdict == "run":
            if waited:
                logger.info(
                    "Periodic task %r: %s ran after the run before it ended (buffer_one)",
                    name,
                    request.id,
                    extra={"task_id": request.id},
                )
            return
        if verdict == "skip":
            logger.info(
                "Periodic task %r: skipped %s, run %s is unfinished (zdelay_overlap=%r)",
                name,
                request.id,
                owner,
                policy,
                extra={"task_id": request.id},
            )
            raise Ignore()
        # Bounded: the owner's run is taken to end at most *max_run_ms* after it started.
        waited = True
        time.sleep(BUFFER_POLL_SECONDS)


# -- a run ends: free the key it took --------------------------------------------------


def release_key(task: Any, request: Any = None) -> None:
    """Free the key and concurrency slots the run of *request* (default: the current one) took.

    The ``until_finished`` key of a released task, or the key a periodic
    occurrence takes for its schedule's overlap policy. Called once per run
    by the run-end receivers below, however the run ended. Only the owner
    frees a key (``finish_key.lua`` compares the task id), so a call for a
    run that never took it changes nothing. Should no call come (a worker
    that died), the key is freed by itself: ``zdelay_max_run_seconds`` after
    the release, or the schedule's ``zdelay_overlap_timeout`` after the run
    started. The slots of ``zdelay_concurrency`` are freed the same way,
    on the same ends (see :func:`release_slots`).
    """
    if request is None:
        request = task.request
    if request is None or request.is_eager:
        return
    release_slots(task, request)
    key = header_of(request, KEY_HEADER)
    if not isinstance(key, str) or header_of(request, ON_KEY_HEADER) != "until_finished":
        # A periodic occurrence with an overlap policy takes its schedule's
        # key the same way while it runs (see apply_overlap_policy).
        key = overlap_key_of_run(request)
    if key is None or not request.id:
        return
    try:
        finish_key(store_for(task._get_app()), key, request.id)
    except (ZDelayError, RedisError, OSError) as exc:
        # The key is freed on its own (zdelay_max_run_seconds after the release).
        logger.warning(
            "Could not free key %r of %s[%s]: %r",
            key,
            task.name,
            request.id,
            exc,
            extra={"task_id": request.id},
        )


def release_slots(task: Any, request: Any) -> None:
    """Free the ``zdelay_concurrency`` slots the run of *request* took (see :func:`release_key`).

    The slots of its task's control, of every queue control (the worker
    does not know which queue the companion saw; freeing a slot a task did
    not take changes nothing) and of its limit key's controls. Like a key,
    a slot no call frees (a worker that died) ends by itself,
    ``zdelay_max_run_seconds`` after the release. A retry and a
    ``Reject(requeue=True)`` keep the slots, as they keep the key: the task
    has not finished, and its next run's end frees them.
    """
    if not request.id:
        return
    try:
        app = task._get_app()
        slots = slots_of(
            dict.fromkeys(_concurrency_names(app), 0),
            task=task.name,
            queue=None,
            limit_key=header_of(request, LIMIT_KEY_HEADER),
        )
        if slots:
            free_slots(store_for(app), [slot for slot, _ in slots], [request.id])
    except (ZDelayError, RedisError, OSError) as exc:
        # The slot ends on its own (zdelay_max_run_seconds after the release).
        logger.warning(
            "Could not free the concurrency slots of %s[%s]: %r",
            task.name,
            request.id,
            exc,
            extra={"task_id": request.id},
        )


#: Seconds a worker process goes on with the names of the concurrency
#: controls set at run time before it reads them again (at a run's end).
#: Less than CONCURRENCY_SETTLE_MS, after which companions apply a new name:
#: a run that took a slot under it ends after the worker has read it.
CONCURRENCY_NAMES_SECONDS = 0.5
#: Seconds before a worker process tries again when that read failed.
CONCURRENCY_NAMES_RETRY_SECONDS = 5.0
#: Per app: (when to read again, on time.monotonic(); the names read).
_names_read: dict[int, tuple[float, frozenset[str]]] = {}
_names_lock = threading.Lock()


def _concurrency_names(app: Any) -> frozenset[str]:
    """The control names whose slots a run's end frees: the settings' and those set at run time.

    Those set at run time (:func:`celery_zdelay.set_concurrency`, removed
    ones too) are read from Redis at most every
    :data:`CONCURRENCY_NAMES_SECONDS`, at a run's end: one small read per
    worker process and half second while tasks end. When the store does not
    answer, the names read last serve for
    :data:`CONCURRENCY_NAMES_RETRY_SECONDS` (a warning says so).
    """
    now = time.monotonic()
    with _names_lock:
        read = _names_read.get(id(app))
    if read is None or now >= read[0]:
        try:
            names = frozenset(ControlStore(store_for(app)).concurrency_names())
            read = (now + CONCURRENCY_NAMES_SECONDS, names)
        except (ZDelayError, RedisError, OSError) as exc:
            # A store that does not answer must not slow every run's end:
            # the names read last serve until the next try.
            logger.warning(
                "Could not read the concurrency controls set at run time (trying again "
                "in %s s; until then the slots of a control set since are not freed): %r",
                CONCURRENCY_NAMES_RETRY_SECONDS,
                exc,
            )
            read = (now + CONCURRENCY_NAMES_RETRY_SECONDS, read[1] if read else frozenset())
        with _names_lock:
            _names_read[id(app)] = read
    return frozenset(get_config(app).concurrency) | read[1]


#: Per thread of a pool process: the id of the last run whose key was freed
#: by :func:`release_after_run`, so ``task_internal_error`` after it does not
#: free it twice.
_ended = threading.local()


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
