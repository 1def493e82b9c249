"""Dead letters: list them with their reason, requeue them, purge them.

A dead letter is read as a :class:`~.read_model.ParkedTask` in state
``dead`` (:func:`~.read_model.dead_task`), as lookup and listings read it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import cast

from .client import store_errors
from .listing import Listing
from .read_model import ParkedTask, dead_task
from .reading import ADMIN_BATCH, DEFAULT_LIST_LIMIT, as_text, check_limit, selected_shards
from .store import Store

__all__ = ["DeadEntry", "list_dead", "purge_dead", "requeue_all_dead", "requeue_dead"]

logger = logging.getLogger(__name__)


#: The name dead-letter listings used before there was one read model:
#: kept for code that imported it from :mod:`celery_zdelay.store.admin`.
DeadEntry = ParkedTask


# -- dead letters -------------------------------------------------------------


def list_dead(
    store: Store, *, limit: int = DEFAULT_LIST_LIMIT, shards: Iterable[int] | None = None
) -> Listing:
    """Return dead-lettered entries (:class:`~.read_model.ParkedTask`), most recent first.

    At most *limit* of them.
    """
    check_limit(limit)
    numbers = selected_shards(store, shards)
    now_ms = store.time_ms()
    found: list[ParkedTask] = []
    more = False
    for shard in numbers:
        keys = store.keys(shard)
        with store_errors(store.url):
            members = cast(
                "list[tuple[bytes, float]]",
                store.client.zrevrange(keys.dead, 0, limit, withscores=True),
            )
            stored = cast(
                "list[bytes | None]",
                store.client.hmget(keys.dead_msg, [m for m, _ in members]) if members else [],
            )
        more = more or len(members) > limit
        for (member, died), record in zip(members, stored, strict=True):
            found.append(dead_task(store, as_text(member), shard, int(died), record))
    found.sort(key=lambda e: (-(e.died_ms or 0), e.shard, e.task_id))
    if len(found) > limit:
        more = True
    return Listing(now_ms=now_ms, entries=found[:limit], more=more)


def requeue_dead(store: Store, task_ids: Sequence[str]) -> list[bool]:
    """Park dead-lettered entries again, due now; return, per id, whether it was.

    An id is not requeued when it is not dead-lettered, has no message (it
    died because the message was missing), or was parked again since (and
    is waiting, or being released right now).
    """
    by_shard: dict[int, list[int]] = {}
    for index, task_id in enumerate(task_ids):
        by_shard.setdefault(store.shard_of(task_id), []).append(index)
    done = [False] * len(task_ids)
    for shard, indexes in by_shard.items():
        for start in range(0, len(indexes), ADMIN_BATCH):
            chunk = indexes[start : start + ADMIN_BATCH]
            flags = _requeue_call(store, shard, [task_ids[i] for i in chunk])
            for index, flag in zip(chunk, flags, strict=True):
                done[index] = flag
    return done


def requeue_all_dead(store: Store, shards: Iterable[int] | None = None) -> tuple[int, int]:
    """Requeue every entry dead-lettered so far; return (requeued, left dead-lettered).

    Only entries that died before the call are taken: a requeued entry that a
    running companion dead-letters again is left for the next call, so this
    always ends.
    """
    numbers = selected_shards(store, shards)
    until_ms = store.time_ms()
    requeued = left = 0
    for shard in numbers:
        keys = store.keys(shard)
        # Entries that cannot be requeued stay in the set: step over them.
        offset = 0
        while True:
            with store_errors(store.url):
                members = store.client.zrangebyscore(
                    keys.dead, "-inf", until_ms, start=offset, num=ADMIN_BATCH
                )
            if not members:
                break
            flags = _requeue_call(store, shard, [as_text(m) for m in members])
            requeued += sum(flags)
            offset += len(flags) - sum(flags)
        left += offset
    return requeued, left


def _requeue_call(store: Store, shard: int, task_ids: list[str]) -> list[bool]:
    keys = store.keys(shard)
    store.ensure_allowed(keys.due, "requeue")
    history = store.history_args(shard)
    with store_errors(store.url):
        reply = store.scripts.requeue(
            keys=[
                keys.dead,
                keys.dead_msg,
                keys.due,
                keys.msg,
                keys.lease,
                keys.marks,
                keys.tagged,
                *history.keys,
            ],
            args=[keys.wake, *task_ids, *history.args],
            client=store.client,
        )
    flags = [bool(int(flag)) for flag in reply]
    for task_id, flag in zip(task_ids, flags, strict=True):
        if flag:
            logger.info("Requeued dead-lettered %s on shard %d, due now", task_id, shard)
    return flags


def purge_dead(
    store: Store, task_ids: Sequence[str] | None = None, *, shards: Iterable[int] | None = None
) -> int:
    """Delete dead-lettered entries (*task_ids*, or all); return how many were deleted.

    Deletes in batches rather than with one ``DEL``, so purging a large set
    never blocks Redis for long; each batch is one script, so a concurrent
    requeue finds either the message and its index entry or neither.
    """
    if task_ids is not None:
        by_shard: dict[int, list[str]] = {}
        for task_id in task_ids:
            by_shard.setdefault(store.shard_of(task_id), []).append(task_id)
        return sum(_purge_call(store, shard, ids) for shard, ids in by_shard.items())
    numbers = selected_shards(store, shards)
    # Only what died before the call, so a companion dead-lettering as fast
    # as we delete cannot keep this running.
    until_ms = store.time_ms()
    purged = 0
    for shard in numbers:
        while True:
            with store_errors(store.url):
                members = store.client.zrangebyscore(
                    store.keys(shard).dead, "-inf", until_ms, start=0, num=ADMIN_BATCH
                )
            if not members:
                break
            purged += _purge_call(store, shard, [as_text(m) for m in members])
    return purged


def _purge_call(store: Store, shard: int, task_ids: list[str]) -> int:
    removed = 0
    for start in range(0, len(task_ids), ADMIN_BATCH):
        chunk = task_ids[start : start + ADMIN_BATCH]
        # One script: the message, the index entry and the template count go
        # together (a concurrent requeue finds either all or nothing).
        removed += store.purge_dead(shard, chunk)
    return removed
