"""The optional worker-side guard: run a released task once, even if published twice.

Releases through a Redis broker are exactly once. Through other brokers they
are at least once: a companion killed after the broker accepted a message but
before the store forgot it lets the entry be published again when its lease
expires. With ``zdelay_worker_dedupe = True``:

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
task runs. Retries count separately, so ``Task.retry`` still works.

The companion republishes the very bytes it verified (signing), so two
publishes cannot be told apart by their content; the broker's redelivered
flag (``delivery_info['redelivered']``: AMQP sets it, and kombu's Redis
transport sets it when it restores an unacknowledged message) is what tells
them apart.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from celery.exceptions import Ignore
from redis.exceptions import RedisError

from .app_state import store_for
from .config import get_config
from .errors import ZDelayError

__all__ = ["HEADER", "SEEN_SECONDS", "mark_parked", "note_run_finished", "refuse_second_delivery"]

logger = logging.getLogger(__name__)

#: Header naming one park of a message.
HEADER = "zdelay_park"
#: How long a first delivery is remembered: far longer than a lease.
SEEN_SECONDS = 24 * 3600
#: Record values: a run started, a run ended (success or failure).
RUNNING, FINISHED = b"running", b"finished"


def mark_parked(headers: dict[str, Any]) -> None:
    """Give a message about to be parked its park id."""
    headers[HEADER] = uuid.uuid4().hex


def refuse_second_delivery(task: Any) -> None:
    """Raise ``Ignore`` when this delivery is a second publish of a released task.

    Called by :meth:`DelayedTaskMixin.before_start` in workers.
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

    Called by :meth:`DelayedTaskMixin.after_return`, which Celery calls for
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
    park_id = getattr(request, HEADER, None) or (request.headers or {}).get(HEADER)
    if not park_id or request.is_eager:
        return None
    config = get_config(task._get_app())
    if not config.worker_dedupe:
        return None
    return f"{config.key_prefix}:seen:{park_id}:{request.retries or 0}"


def _client(task: Any) -> Any:
    return store_for(task._get_app()).client
