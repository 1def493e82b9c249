"""Find parked entries: one by id (its state and due time), or all that match a filter.

:func:`find` reads the keys of the id's shard in one round trip (two when
a pause or a rate limit holds entries there) and says, as an
:class:`~.read_model.EntryState`, whether the entry waits (``parked``),
waits behind a pause or rate limit (``held``), is being released
(``in_flight``) or could not be published (``dead``): what
:func:`celery_zdelay.lookup` and the dashboard's entry page show.
:func:`select` pages through the due and held sets (or a tag's index)
and returns the ids whose task name, queue and due time match, for bulk
cancel and reschedule. Payloads are read only for their Celery headers.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..due_score import due_ms_of
from ..entry import parked_ms
from .client import store_errors
from .control import HoldReasons, lane_control
from .read_model import (
    EntryState,
    ParkedTask,
    dead_task,
    entry_state,
    header_fields,
    marks_fields,
)
from .reading import (
    ScannedEntry,
    TaggedScan,
    describe,
    held_scores,
    leased_score,
    matches_patterns,
    optional_str,
    scan_parked,
)
from .store import Store

__all__ = ["EntryState", "ParkedTask", "find", "select"]

#: Entries read per round trip while selecting.
_PAGE = 1000


def find(store: Store, task_id: str) -> ParkedTask | None:
    """Return the entry parked, held, in flight or dead-lettered under *task_id*, else None."""
    shard = store.shard_of(task_id)
    keys = store.keys(shard)
    with store_errors(store.url), store.client.pipeline(transaction=False) as pipe:
        pipe.zscore(keys.due, task_id)
        pipe.hget(keys.msg, task_id)
        pipe.zscore(keys.lease, task_id)
        pipe.hget(keys.leased, task_id)
        pipe.zscore(keys.dead, task_id)
        pipe.hget(keys.dead_msg, task_id)
        # Its key and tags: "i:<id>" while parked or in flight, "d:<id>" while dead.
        pipe.hmget(keys.marks, ["i:" + task_id, "d:" + task_id])
        score, payload, lease, leased, died, record, (marked, dead_marked) = pipe.execute()
    lane: str | None = None
    if score is None and leased is None and payload is not None:
        # Not due nor in flight, yet its message is there: held back, or
        # moving between the sets right now (then the read finds nothing).
        lane, score = held_scores(store, shard, [task_id]).get(task_id, (None, None))
    state = entry_state(
        due=score is not None,
        held_by=lane,
        leased=leased is not None or lease is not None,
        dead=died is not None,
    )
    if state is None:
        return None
    if state is EntryState.DEAD:
        return dead_task(store, task_id, shard, int(died), record, dead_marked)
    headers, queue, error = describe(payload, store.templates(shard))
    # The leased record starts with the due score it was claimed at (then the claim token).
    due_score = int(score) if score is not None else leased_score(leased) if leased else None
    return ParkedTask(
        task_id=task_id,
        state=state,
        due_ms=None if due_score is None else due_ms_of(due_score),
        task=optional_str(headers.get("task")),
        queue=queue,
        shard=shard,
        reason=error,
        parked_ms=parked_ms(payload),
        held_by=None if lane is None else lane_control(lane),
        held_reason=None if lane is None else HoldReasons(store)(lane),
        error=error,
        lease_until_ms=None if lease is None else int(lease),
        **header_fields(headers),
        **marks_fields(marked),
    )


def select(
    store: Store,
    *,
    task: str | None = None,
    queue: str | None = None,
    due_after_ms: int | None = None,
    due_before_ms: int | None = None,
    shards: Iterable[int] | None = None,
    tag: str | None = None,
) -> list[str]:
    """Return the ids of every parked entry that matches, in due order per shard.

    *task* and *queue* are names or glob patterns (``proj.orders.*``); due
    times are selected in ``[due_after_ms, due_before_ms)``; *tag* selects
    the entries tagged so (through the tag index, without a scan). Unlike a
    listing there is no bound: bulk cancel and reschedule must see every
    match. Entries held back by a pause or a rate limit are selected (they
    can be cancelled and moved); entries in flight are not.
    """
    filtered = task is not None or queue is not None
    if tag is not None:
        # In flight is not selected: it cannot be cancelled or moved any more.
        tagged = TaggedScan(
            store,
            tag,
            shards=shards,
            due_after_ms=due_after_ms,
            due_before_ms=due_before_ms,
            payloads=filtered,
            first_page=_PAGE,
        )
        return [row.task_id for row in tagged if not filtered or _matches(store, row, task, queue)]
    found: list[str] = []
    for scanned in scan_parked(
        store,
        shards=shards,
        due_after_ms=due_after_ms,
        due_before_ms=due_before_ms,
        first_page=_PAGE,
        payloads=filtered,
        held=True,
    ):
        if filtered and not _matches(store, scanned, task, queue):
            continue
        found.append(scanned.task_id)
    # An entry moving between its due and held sets during the scan can be
    # read in both: select it once.
    return list(dict.fromkeys(found))


def _matches(store: Store, row: ScannedEntry, task: str | None, queue: str | None) -> bool:
    """Whether the task name and queue of *row*'s message match the glob patterns."""
    headers, routing_key, _ = describe(row.payload, store.templates(row.shard))
    return matches_patterns(headers.get("task"), routing_key, task, queue)
