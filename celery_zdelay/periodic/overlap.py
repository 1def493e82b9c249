"""Overlap policy of a periodic schedule: what an occurrence does while the previous run goes on.

``zdelay_overlap`` is ``allow`` (celery beat's behaviour: each occurrence
runs whatever the previous one does), ``skip`` (an occurrence that starts
while the schedule's previous run is unfinished does not run) or
``buffer_one`` (it waits for that run to end, then runs; one waits at most,
the others are skipped).

Only a worker knows when a run starts and ends, so the companions park and
release every occurrence as before (each exactly once), with the policy in
the message headers, and the worker decides just before the task runs
(:func:`start_run`, from :meth:`celery_zdelay.DelayedTaskMixin.before_start`).
The run holds the schedule's key as an ``until_finished`` key is held after
its release (``store/lua/start_run.lua``): the same record in the same
index, freed by the same receivers however the run ends
(:func:`celery_zdelay.keys.release_key`, from :mod:`celery_zdelay.worker`), and by itself once
``zdelay_overlap_timeout`` (by default ``zdelay_key_hold_seconds``) passed,
so a SIGKILLed worker does not block the schedule for ever.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from celery.exceptions import Ignore
from redis.exceptions import RedisError

from ..errors import ZDelayError

if TYPE_CHECKING:
    from .definition import Definition

__all__ = [
    "OVERLAP_HEADER",
    "OVERLAP_TIMEOUT_HEADER",
    "SCHEDULE_HEADER",
    "held_key",
    "overlap_headers",
    "overlap_key",
    "start_run",
]

logger = logging.getLogger(__name__)

#: Headers of an occurrence whose schedule has a policy: the schedule's
#: name, the policy, and the hold (ms; absent: the worker's
#: ``zdelay_key_hold_seconds``).
SCHEDULE_HEADER = "zdelay_schedule"
OVERLAP_HEADER = "zdelay_overlap"
OVERLAP_TIMEOUT_HEADER = "zdelay_overlap_timeout_ms"
#: How often a buffered occurrence asks whether the run before it ended.
BUFFER_POLL_SECONDS = 0.2


def overlap_key(name: str) -> str:
    """The key a run of schedule *name* holds while it goes on.

    It starts with a control character, which no producer's key may hold
    (:func:`celery_zdelay.keys.validate_key`): it is never one of theirs.
    """
    return f"\x1fperiodic:{name}"


def overlap_headers(definition: Definition) -> dict[str, Any]:
    """The headers an occurrence of *definition* carries to the worker (none for ``allow``)."""
    if definition.overlap == "allow":
        return {}
    headers: dict[str, Any] = {
        SCHEDULE_HEADER: definition.name,
        OVERLAP_HEADER: definition.overlap,
    }
    if definition.overlap_timeout_ms is not None:
        headers[OVERLAP_TIMEOUT_HEADER] = definition.overlap_timeout_ms
    return headers


def _header(request: Any, name: str) -> Any:
    # Celery's Context holds every message header as an attribute (and, on
    # Celery >= 5.3, the custom ones in request.headers as well).
    return getattr(request, name, None) or (request.headers or {}).get(name)


def held_key(request: Any) -> str | None:
    """The key the run of *request* holds, when its schedule has an overlap policy."""
    name = _header(request, SCHEDULE_HEADER)
    if isinstance(name, str) and _header(request, OVERLAP_HEADER) in ("skip", "buffer_one"):
        return overlap_key(name)
    return None


def start_run(task: Any) -> None:
    """Run, wait or skip the occurrence about to run in this worker, by its schedule's policy.

    Raises ``celery.exceptions.Ignore`` to skip it (counted as skipped by
    overlap). With ``buffer_one`` it waits here, in this worker process,
    until the run before it ends or its hold does. Should the store be out
    of reach, the occurrence runs: the policy is a guard against piling up
    runs, and a tick not run cannot be run later.
    """
    request = task.request
    key = held_key(request)
    if key is None or request.is_eager or not request.id:
        return
    from ..app_state import store_for
    from ..keys import hold_ms
    from ..store.marks import start_run as take_key
    from .store import PeriodicStore

    app = task._get_app()
    policy = _header(request, OVERLAP_HEADER)
    name = _header(request, SCHEDULE_HEADER)
    timeout = _header(request, OVERLAP_TIMEOUT_HEADER)
    hold = timeout if isinstance(timeout, int) and timeout > 0 else hold_ms(app)
    waited = False
    while True:
        try:
            store = store_for(app)
            verdict, holder = take_key(store, key, request.id, hold_ms=hold, policy=policy)
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
                holder,
                policy,
                extra={"task_id": request.id},
            )
            raise Ignore()
        # Bounded: the holder's hold ends at most *hold* ms after it started.
        waited = True
        time.sleep(BUFFER_POLL_SECONDS)
