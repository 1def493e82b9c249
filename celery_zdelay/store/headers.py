"""Every ``zdelay_*`` message header, in one place: the wire contract.

A parked message carries these headers from the producer through the store
to the worker, beside Celery's own; the store reads some of them (a signed
entry's key and tags), the worker the rest. Like the Redis key names
(:mod:`celery_zdelay.store.redis_keys`), each name is written here once, and every
module that reads or writes one imports it from here.

Celery's worker holds every message header as an attribute of the task's
request (and, on Celery >= 5.3, the custom ones in ``request.headers`` as
well): :func:`header_of` reads either.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ETA_HEADER",
    "KEY_HEADER",
    "LIMIT_KEY_HEADER",
    "MAX_WAIT_HEADER",
    "ON_KEY_HEADER",
    "OVERLAP_HEADER",
    "OVERLAP_TIMEOUT_HEADER",
    "PARK_HEADER",
    "SCHEDULE_HEADER",
    "TAGS_HEADER",
    "header_of",
]

#: The ETA Celery would have sent (an ISO 8601 string, as Celery's own
#: ``eta`` header), while ``eta`` is None: the worker puts it back into
#: ``request.eta`` (:func:`celery_zdelay.worker.restore_eta`).
ETA_HEADER = "zdelay_eta"
#: The task's key (``key=``), its ``on_key`` mode, and its tags (a list).
KEY_HEADER, ON_KEY_HEADER, TAGS_HEADER = "zdelay_key", "zdelay_on_key", "zdelay_tags"
#: The task's limit key (``limit_key=``, a string): the companion's gate
#: holds it in a lane of that key under a ``limit_key:<glob>`` rate limit
#: that matches it, and counts it under that key for a ``limit_key:<glob>``
#: concurrency control.
LIMIT_KEY_HEADER = "zdelay_limit_key"
#: A debounced task's ``max_wait=`` in ms: its key's burst of calls runs at
#: most this long after the burst's first call.
MAX_WAIT_HEADER = "zdelay_max_wait_ms"
#: A random id of one park of the message, for the worker-side guard
#: against a second publish (``zdelay_worker_dedupe``).
PARK_HEADER = "zdelay_park"
#: A periodic occurrence whose schedule has an overlap policy: the
#: schedule's name, the policy, and the overlap timeout (ms; absent: the worker's
#: ``zdelay_max_run_seconds``).
SCHEDULE_HEADER = "zdelay_schedule"
OVERLAP_HEADER = "zdelay_overlap"
OVERLAP_TIMEOUT_HEADER = "zdelay_overlap_timeout_ms"


def header_of(request: Any, name: str) -> Any:
    """The header *name* of the message behind a worker's task *request*, or None."""
    return getattr(request, name, None) or (request.headers or {}).get(name)
