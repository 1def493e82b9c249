"""Overlap policy of a periodic schedule: what an occurrence does while the previous run goes on.

``zdelay_overlap`` is ``allow`` (celery beat's behaviour: each occurrence
runs whatever the previous one does), ``skip`` (an occurrence that starts
while the schedule's previous run is unfinished does not run) or
``buffer_one`` (it waits for that run to end, then runs; one waits at most,
the others are skipped).

Only a worker knows when a run starts and ends, so the companions park and
release every occurrence as before (each exactly once), with the policy in
the message headers (:func:`overlap_headers`), and the worker decides just
before the task runs (:func:`celery_zdelay.worker.apply_overlap_policy`).
The run takes the schedule's key (:func:`overlap_key_of_run`) as an
``until_finished`` key stays taken after its release
(``store/lua/start_run.lua``): the same record in the same index, freed by
the same receivers however the run ends (:func:`celery_zdelay.worker.release_key`),
and by itself once ``zdelay_overlap_timeout`` (by default
``zdelay_max_run_seconds``) passed, so a SIGKILLed worker does not block
the schedule for ever.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..store.headers import OVERLAP_HEADER, OVERLAP_TIMEOUT_HEADER, SCHEDULE_HEADER, header_of

if TYPE_CHECKING:
    from .definition import Definition

__all__ = ["overlap_headers", "overlap_key", "overlap_key_of_run"]


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


def overlap_key_of_run(request: Any) -> str | None:
    """The schedule's key the run of worker *request* holds, or None (no overlap policy)."""
    name = header_of(request, SCHEDULE_HEADER)
    if isinstance(name, str) and header_of(request, OVERLAP_HEADER) in ("skip", "buffer_one"):
        return overlap_key(name)
    return None
