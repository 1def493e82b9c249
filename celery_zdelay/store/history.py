"""A task id's history in the store: read it, and sweep the expired records.

Recorded by the scripts' transitions (lua/_history.lua) in each shard's
``history`` hash (id -> one line per event, oldest first) and
``history_exp`` zset (id -> ms the record expires). A read ignores an
expired record; :func:`sweep_history` deletes them in bounded steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from .client import store_errors
from .store import Store

__all__ = ["HistoryLine", "read_history", "sweep_history"]

#: Event code of a line -> its name (celery_zdelay.history.HistoryEvent.event).
EVENTS = {
    "P": "parked",
    "S": "rescheduled",
    "H": "held",
    "R": "released",
    "C": "cancelled",
    "D": "dead",
    "Q": "requeued",
    "X": "purged",
}


@dataclass(frozen=True)
class HistoryLine:
    """One stored event: its name, when (Redis clock, ms) and its fields as stored."""

    event: str
    at_ms: int
    fields: tuple[str, ...]


def read_history(store: Store, task_id: str) -> list[HistoryLine]:
    """Return the events recorded for *task_id*, oldest first ([] if none or expired)."""
    keys = store.keys(store.shard_of(task_id))
    with store_errors(store.url):
        raw = store.client.hget(keys.history, task_id)
        if raw is None:
            return []
        expires = store.client.zscore(keys.history_exp, task_id)
    now_ms = store.time_ms()
    if raw is None or expires is None or expires <= now_ms:
        return []
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    lines = []
    for line in text.split("\n"):
        code, _, rest = line.partition("\t")
        at, _, tail = rest.partition("\t")
        if code not in EVENTS or not at.isdigit():
            continue  # written by something else: not ours to show
        lines.append(HistoryLine(EVENTS[code], int(at), tuple(tail.split("\t")) if tail else ()))
    return lines


def sweep_history(store: Store, shard: int, limit: int) -> int:
    """Delete up to *limit* expired history records of *shard*; return how many."""
    keys = store.keys(shard)
    store.ensure_allowed(keys.due, "history_sweep")
    with store_errors(store.url):
        return int(
            store.scripts.history_sweep(
                keys=[keys.history, keys.history_exp], args=[limit], client=store.client
            )
        )
