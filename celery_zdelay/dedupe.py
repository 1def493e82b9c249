"""The optional worker-side guard: run a released task once, even if delivered twice.

Releases through a Redis broker are exactly once. Through other brokers they
are at least once: a companion killed after the broker accepted a message but
before the store forgot it lets the entry be released again when its lease
expires. With ``zdelay_worker_dedupe = True``:

- each parked message carries a ``zdelay_park`` header, a random id of that
  park (parking the same task id again gets a new one);
- before a task starts, the worker records ``<park id>:<retries>`` in the
  store with ``SET NX`` for :data:`SEEN_SECONDS`; a second delivery finds it
  and is dropped (Celery's ``Ignore``: no result is stored, no callbacks run).

Retries count separately, so ``Task.retry`` still works. If the store cannot
be reached the task runs: the guard never loses a task to save a duplicate.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from celery.exceptions import Ignore
from redis.exceptions import RedisError

from .config import get_config
from .errors import ZDelayError

__all__ = ["HEADER", "SEEN_SECONDS", "mark_parked", "refuse_second_delivery"]

logger = logging.getLogger(__name__)

#: Header naming one park of a message.
HEADER = "zdelay_park"
#: How long a first delivery is remembered: far longer than a lease.
SEEN_SECONDS = 24 * 3600


def mark_parked(headers: dict[str, Any]) -> None:
    """Give a message about to be parked its park id."""
    headers[HEADER] = uuid.uuid4().hex


def refuse_second_delivery(task: Any) -> None:
    """Raise ``Ignore`` when this delivery of a released task was seen before.

    Called by :meth:`DelayedTaskMixin.before_start` in workers.
    """
    request = task.request
    park_id = getattr(request, HEADER, None) or (request.headers or {}).get(HEADER)
    if not park_id or request.is_eager:
        return
    app = task._get_app()
    config = get_config(app)
    if not config.worker_dedupe:
        return
    from .parking import store_for

    key = f"{config.key_prefix}:seen:{park_id}:{request.retries or 0}"
    try:
        first = store_for(app).client.set(key, request.id or "", nx=True, ex=SEEN_SECONDS)
    except (ZDelayError, RedisError, OSError) as exc:
        # Run the task rather than lose it.
        logger.warning(
            "Could not check %s[%s] for a second delivery: %r", task.name, request.id, exc
        )
        return
    if not first:
        logger.warning(
            "Dropped a second delivery of %s[%s]: celery-zdelay released it twice "
            "(a companion died after publishing it)",
            task.name,
            request.id,
        )
        raise Ignore()
