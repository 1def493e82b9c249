"""Find parked entries: one by id (its state and due time), or all that match a filter.

:func:`find` reads the keys of the id's shard in one round trip (two when
a pause or a rate limit holds entries there) and says whether the entry
waits (``parked``), waits behind a pause or rate limit (``held``), is being
released (``in_flight``) or could not be published (``dead``).
:func:`select` pages through the due and held sets and returns the ids
whose task name, queue and due time match, for bulk cancel and reschedule.
Payloads are read only for their Celery headers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal

from ..due_score import due_ms_of
from ..entry import parked_ms
from .client import store_errors
from .control import HoldReasons
from .deadletters import dead_entry
from .marks import parse_record, signed_with_tag, tagged_ids
from .reading import (
    as_text,
    describe,
    held_scores,
    leased_score,
    matches_patterns,
    optional_str,
    scan_parked,
    selected_shards,
)
from .store import Store

__all__ = ["EntryState", "ParkedTask", "find", "select"]

EntryState = Literal["parked", "held", "in_flight", "dead"]

#: Entries read per round trip while selecting.
_PAGE = 1000


@dataclass(frozen=True)
class ParkedTask:
    """A task celery-zdelay holds, as :func:`celery_zdelay.lookup` returns it."""

    #: The id of the parked entry (the first task of a parked chain).
    task_id: str
    #: ``"parked"`` (waiting for its due time, or overdue), ``"held"``
    #: (due, and held back by a pause or a rate limit: see :attr:`held_by`),
    #: ``"in_flight"`` (claimed by a companion, being published) or
    #: ``"dead"`` (dead-lettered).
    state: EntryState
    #: When it is (or was) due, in epoch ms on the Redis clock; None if unknown.
    due_ms: int | None
    #: Task name; None when the message cannot be read.
    task: str | None
    #: The queue (routing key) it is published to.
    queue: str | None
    shard: int
    #: Why it was dead-lettered (``state == "dead"``), or why its message cannot be read.
    reason: str | None = None
    #: When it was parked, in epoch ms on the Redis clock; None when not
    #: recorded (parked whole, by ``zdelay_whole_messages``, or by an earlier
    #: release, which did not record it).
    parked_ms: int | None = None
    #: Its key (``apply_delayed(key=...)``), while it holds it; else None.
    key: str | None = None
    #: Its ``on_key`` mode, with :attr:`key`.
    on_key: str | None = None
    #: Its tags (``apply_delayed(tags=[...])``).
    tags: tuple[str, ...] = ()
    #: The control holding it back (``"queue:emails"``), when ``state == "held"``.
    held_by: str | None = None
    #: Why: ``"pause"`` or ``"rate_limit"``, when ``state == "held"``.
    held_reason: str | None = None

    @property
    def due(self) -> datetime | None:
        """:attr:`due_ms` as an aware UTC datetime."""
        if self.due_ms is None:
            return None
        return datetime.fromtimestamp(self.due_ms / 1000, tz=timezone.utc)

    @property
    def parked_at(self) -> datetime | None:
        """:attr:`parked_ms` as an aware UTC datetime."""
        if self.parked_ms is None:
            return None
        return datetime.fromtimestamp(self.parked_ms / 1000, tz=timezone.utc)


def find(store: Store, task_id: str) -> ParkedTask | None:
    """Return the entry parked, in flight or dead-lettered under *task_id*, else None."""
    shard = store.shard_of(task_id)
    keys = store.keys(shard)
    with store_errors(store.url), store.client.pipeline(transaction=False) as pipe:
        pipe.zscore(keys.due, task_id)
        pipe.hget(keys.leased, task_id)
        pipe.hget(keys.msg, task_id)
        pipe.zscore(keys.dead, task_id)
        pipe.hget(keys.dead_msg, task_id)
        pipe.hmget(keys.marks, ["i:" + task_id, "d:" + task_id])
        score, leased, payload, died, record, (marked, dead_marked) = pipe.execute()
    held_by: str | None = None
    if score is None and leased is None and payload is not None:
        # Not due nor in flight, yet its message is there: held back, or
        # moving between the sets right now (then the read finds nothing).
        held_by, score = held_scores(store, shard, [task_id]).get(task_id, (None, None))
    if score is not None or leased is not None:
        state: EntryState = "in_flight" if score is None else "held" if held_by else "parked"
        headers, queue, error = describe(payload, store.templates(shard))
        # The leased record starts with the due score (then the claim token).
        due_score = int(score) if score is not None else leased_score(leased)
        return ParkedTask(
            task_id=task_id,
            state=state,
            due_ms=due_ms_of(due_score),
            task=optional_str(headers.get("task")),
            queue=queue,
            shard=shard,
            reason=error,
            parked_ms=parked_ms(payload),
            held_by=held_by,
            held_reason=None if held_by is None else HoldReasons(store)(held_by),
            **_marks(marked),
        )
    if died is not None:
        dead = dead_entry(store, task_id, shard, int(died), record)
        return ParkedTask(
            task_id=task_id,
            state="dead",
            due_ms=dead.due_ms,
            task=dead.task,
            queue=dead.queue,
            shard=shard,
            reason=dead.reason or dead.error,
            parked_ms=parked_ms(bytes(record).partition(b"\n")[2] if record else None),
            **_marks(dead_marked),
        )
    return None


def _marks(record: bytes | None) -> dict[str, Any]:
    """The key, on_key and tags fields of a :class:`ParkedTask`, from the index record."""
    if record is None:
        return {}
    marks = parse_record(as_text(record))
    return {"key": marks.key, "on_key": marks.on_key, "tags": marks.tags}


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
    if tag is not None:
        return _select_tagged(store, tag, task, queue, due_after_ms, due_before_ms, shards)
    filtered = task is not None or queue is not None
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
        if filtered:
            headers, routing_key, _ = describe(scanned.payload, store.templates(scanned.shard))
            if not matches_patterns(headers.get("task"), routing_key, task, queue):
                continue
        found.append(scanned.task_id)
    # An entry moving between its due and held sets during the scan can be
    # read in both: select it once.
    return list(dict.fromkeys(found))


def _select_tagged(
    store: Store,
    tag: str,
    task: str | None,
    queue: str | None,
    due_after_ms: int | None,
    due_before_ms: int | None,
    shards: Iterable[int] | None,
) -> list[str]:
    """:func:`select` through the index of *tag*.

    With ``zdelay_signing_key`` an entry is selected only if its signed
    message carries the tag: an index entry someone wrote into Redis cannot
    point a bulk cancel or reschedule at a signed entry tagged otherwise.
    """
    signing_keys = store.config.signing_keys
    found: list[tuple[int, str]] = []
    for shard in selected_shards(store, shards):
        keys = store.keys(shard)
        ids = tagged_ids(store, tag, shards=[shard])
        read_payloads = task is not None or queue is not None or bool(signing_keys)
        for start in range(0, len(ids), _PAGE):
            chunk = ids[start : start + _PAGE]
            with store_errors(store.url), store.client.pipeline(transaction=False) as pipe:
                for task_id in chunk:
                    pipe.zscore(keys.due, task_id)
                pipe.hmget(keys.msg, chunk)
                *scores, payloads = pipe.execute()
            unseen = [t for t, s in zip(chunk, scores, strict=True) if s is None]
            held = held_scores(store, shard, unseen)
            scores = [held[t][1] if t in held else s for t, s in zip(chunk, scores, strict=True)]
            for task_id, score, payload in zip(chunk, scores, payloads, strict=True):
                if score is None:
                    continue  # in flight: it cannot be cancelled or moved any more
                due_ms = due_ms_of(score)
                if due_after_ms is not None and due_ms < due_after_ms:
                    continue
                if due_before_ms is not None and due_ms >= due_before_ms:
                    continue
                if read_payloads:
                    headers, routing_key, _ = describe(payload, store.templates(shard))
                    if not matches_patterns(headers.get("task"), routing_key, task, queue):
                        continue
                    if signing_keys and not signed_with_tag(store, shard, task_id, payload, tag):
                        continue
                found.append((int(score), task_id))
    return [task_id for _, task_id in sorted(found)]
