"""A task id's history in the store: read it, and sweep the expired records.

Recorded by the scripts' transitions (lua/_history.lua) in each shard's
``history`` hash: id -> one line per event, oldest first,
``<code>\\t<at ms>[\\t<field>...]``. A record expires
``zdelay_history_seconds`` after its last event: a read ignores it from
then on, and :func:`sweep_history` deletes it, scanning in bounded steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from .client import store_errors
from .store import Store

__all__ = ["EVENTS", "HistoryLine", "read_history", "sweep_history"]

#: Event code of a line -> its name (celery_zdelay.HistoryEvent.event).
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
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    lines = []
    for line in text.split("\n"):
        code, _, rest = line.partition("\t")
        at, _, tail = rest.partition("\t")
        if code not in EVENTS or not at.isdigit():
            continue  # written by something else: not ours to show
        lines.append(HistoryLine(EVENTS[code], int(at), tuple(tail.split("\t")) if tail else ()))
    # Expired once zdelay_history_seconds passed since its last event, as
    # history_sweep.lua deletes it.
    if not lines or lines[-1].at_ms + store.config.history_ms <= store.time_ms():
        return []
    return lines


def sweep_history(store: Store, shard: int, cursor: int, count: int) -> tuple[int, int]:
    """One step of the sweep of *shard*'s expired histories, from scan *cursor*.

    Looks at about *count* records; returns the next cursor (0: the scan is
    over) and how many records it deleted.
    """
    keys = store.keys(shard)
    store.ensure_allowed(keys.due, "history_sweep")
    with store_errors(store.url):
        next_cursor, deleted = store.scripts.history_sweep(
            keys=[keys.history], args=[cursor, count, store.config.history_ms], client=store.client
        )
    return int(next_cursor), int(deleted)
