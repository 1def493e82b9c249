"""What the ``zdelay`` commands print: aligned text for people, JSON for tools.

The JSON documents are a stable interface (``docs/cli.rst`` lists every
field): fields may be added in later releases, but none is renamed, removed
or changes meaning. Times in JSON are integer epoch milliseconds on the
Redis server's clock (``*_ms``) or durations in milliseconds (``*_age_ms``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from .._format import (
    ago,
    clip,
    count,
    counted,
    duration,
    relative_due,
    shard_ranges,
    table,
    utc,
)
from ..store.admin import (
    CompanionInfo,
    Counts,
    EntryState,
    Listing,
    ParkedTask,
    ServerHealth,
    ShardCounts,
    Status,
)

__all__ = [
    "check_text",
    "dead_json",
    "dead_text",
    "listing_json",
    "listing_text",
    "status_json",
    "status_text",
]

#: Widest argument and reason text in a table; JSON carries them whole.
ARGS_WIDTH = 60


# -- status -------------------------------------------------------------------


def status_json(
    current: Status, *, shards: int, problems: Sequence[str] | None = None, max_overdue_ms: int = 0
) -> dict[str, Any]:
    """Return the ``status --json`` document; ``check`` only when *problems* is given."""
    document: dict[str, Any] = {
        "now_ms": current.now_ms,
        "store": {"url": current.url, "key_prefix": current.key_prefix, "shards": shards},
        **_counts_json(current.counts),
        "shards": [_shard_json(s) for s in current.counts.shards],
        "companions": [_companion_json(c) for c in current.companions],
        "redis": _health_json(current.health),
        "stranded_shards": list(current.stranded),
    }
    if problems is not None:
        document["check"] = {
            "ok": not problems,
            "problems": list(problems),
            "max_overdue_ms": max_overdue_ms,
        }
    return document


def _counts_json(counts: Counts) -> dict[str, Any]:
    return {
        "parked": counts.parked,
        "overdue": counts.overdue,
        "overdue_in_flight": counts.overdue_in_flight,
        "oldest_overdue_age_ms": counts.oldest_overdue_age_ms,
        "in_flight": counts.in_flight,
        "dead": counts.dead,
        "next_due_ms": counts.next_due_ms,
    }


def _shard_json(shard: ShardCounts) -> dict[str, Any]:
    return {
        "shard": shard.shard,
        "parked": shard.parked,
        "overdue": shard.overdue,
        "overdue_in_flight": shard.overdue_in_flight,
        "oldest_overdue_age_ms": shard.oldest_overdue_age_ms,
        "in_flight": shard.in_flight,
        "dead": shard.dead,
        "next_due_ms": shard.next_due_ms,
    }


def _companion_json(companion: CompanionInfo) -> dict[str, Any]:
    return {
        "id": companion.id,
        "host": companion.host,
        "pid": companion.pid,
        "version": companion.version,
        "shards": companion.shards,
        "handoff": companion.handoff,
        "started_ms": companion.started_ms,
        "seen_ms": companion.seen_ms,
        "alive": companion.alive,
        "released": companion.released,
        "dead_lettered": companion.dead_lettered,
        "beat": companion.beat,
    }


def _health_json(health: ServerHealth) -> dict[str, Any]:
    return {
        "version": health.redis_version,
        "maxmemory_policy": health.maxmemory_policy,
        "maxmemory": health.maxmemory,
        "appendonly": health.appendonly,
        "appendfsync": health.appendfsync,
        "save": health.save,
        "warnings": list(health.warnings),
    }


def status_text(current: Status, *, shards: int, per_shard: bool = False) -> str:
    """Return ``status`` for people: counts, companions, Redis settings, warnings."""
    now = current.now_ms
    counts = current.counts
    health = current.health
    plural = "" if shards == 1 else "s"
    lines = [
        f"Store:  {current.url} (prefix {current.key_prefix}, {shards} shard{plural})",
        "Redis:  " + _health_line(health),
        "",
    ]
    next_due = counts.next_due_ms
    oldest = counts.oldest_overdue_age_ms
    lines.append(
        table(
            None,
            [
                ["Parked", count(counts.parked), _next_due(next_due, now)],
                [
                    "Overdue",
                    count(counts.overdue),
                    _overdue_note(oldest, counts.overdue_in_flight),
                ],
                ["In flight", count(counts.in_flight), "claimed, not yet acknowledged"],
                ["Dead", count(counts.dead), "see: zdelay dead list" if counts.dead else ""],
            ],
            right={1},
        )
    )
    if per_shard:
        lines += ["", _shards_table(counts.shards, now)]
    lines += ["", _companions_text(current.companions, now)]
    for warning in current.warnings:
        lines += ["", f"Warning: {warning}"]
    return "\n".join(lines)


def _health_line(health: ServerHealth) -> str:
    def show(value: str | None) -> str:
        return "?" if value is None else value

    save = "?" if health.save is None else f'"{health.save}"'
    return (
        f"{show(health.redis_version)}, maxmemory-policy {show(health.maxmemory_policy)}, "
        f"appendonly {show(health.appendonly)}, appendfsync {show(health.appendfsync)}, "
        f"save {save}"
    )


def _next_due(next_due_ms: int | None, now_ms: int) -> str:
    if next_due_ms is None:
        return "nothing due later"
    return f"next due {relative_due(next_due_ms, now_ms)} ({utc(next_due_ms)})"


def _shards_table(shards: Sequence[ShardCounts], now_ms: int) -> str:
    rows = [
        [
            str(s.shard),
            count(s.parked),
            count(s.overdue),
            "-" if s.oldest_overdue_age_ms is None else duration(s.oldest_overdue_age_ms),
            count(s.in_flight),
            count(s.dead),
            "-" if s.next_due_ms is None else relative_due(s.next_due_ms, now_ms),
        ]
        for s in shards
    ]
    headers = ["SHARD", "PARKED", "OVERDUE", "OLDEST OVERDUE", "IN FLIGHT", "DEAD", "NEXT DUE"]
    return table(headers, rows, right={0, 1, 2, 4, 5})


def _companions_text(companions: Sequence[CompanionInfo], now_ms: int) -> str:
    alive = sum(1 for c in companions if c.alive)
    if not companions:
        return "Companions: none alive (start one with: celery -A proj zdelay)"
    stale = len(companions) - alive
    title = f"Companions: {alive} alive" + (f", {stale} stale" if stale else "")
    rows = [
        [
            c.id,
            "alive" if c.alive else "stale",
            c.host,
            str(c.pid),
            shard_ranges(c.shards),
            c.handoff,
            count(c.released),
            count(c.dead_lettered),
            "yes" if c.beat else "no",
            ago(c.started_ms, now_ms),
            ago(c.seen_ms, now_ms),
        ]
        for c in companions
    ]
    headers = [
        "ID",
        "STATE",
        "HOST",
        "PID",
        "SHARDS",
        "HANDOFF",
        "RELEASED",
        "DEAD",
        "BEAT",
        "STARTED",
        "LAST SEEN",
    ]
    return title + "\n" + table(headers, rows, right={3, 6, 7})


def _overdue_note(oldest: int | None, in_flight: int) -> str:
    if oldest is None:
        return ""
    note = f"oldest overdue {duration(oldest)}"
    if in_flight:
        note += f" ({count(in_flight)} of them in flight)"
    return note


def check_text(problems: Sequence[str], current: Status) -> str:
    """Return the one-line verdict of ``status --check``."""
    if problems:
        return "FAIL: " + "; ".join(problems)
    alive = len(current.alive)
    oldest = current.counts.oldest_overdue_age_ms
    overdue = "nothing overdue" if oldest is None else f"oldest overdue {duration(oldest)}"
    return f"OK: {alive} companion{'' if alive == 1 else 's'} alive, {overdue}"


# -- listings -----------------------------------------------------------------


def listing_json(listing: Listing) -> dict[str, Any]:
    """Return the ``list --json`` document."""
    return {
        "now_ms": listing.now_ms,
        "more": listing.more,
        "entries": [_parked_json(e) for e in listing.entries],
    }


def _parked_json(entry: ParkedTask) -> dict[str, Any]:
    return {
        "id": entry.task_id,
        "task": entry.task,
        "shard": entry.shard,
        "due_ms": entry.due_ms,
        "parked_ms": entry.parked_ms,
        "queue": entry.queue,
        "argsrepr": entry.argsrepr,
        "kwargsrepr": entry.kwargsrepr,
        "expires": entry.expires,
        "error": entry.error,
        "state": entry.state.value,
        "held_by": entry.held_by,
        "held_reason": entry.held_reason,
        "key": entry.key,
        "tags": list(entry.tags),
    }


def _state_note(entry: ParkedTask) -> str:
    """What the DUE column adds to the due time: in flight, or held by which control."""
    if entry.in_flight:
        return f", {entry.state.label}"
    if entry.held_by:
        return f", held by {entry.held_by} ({_REASON_WORDS.get(entry.held_reason or '', '?')})"
    return ""


#: How ``list`` says why a control holds an entry.
_REASON_WORDS = {"pause": "paused", "rate_limit": "rate limit", "concurrency": "concurrency"}


def listing_text(listing: Listing, *, show_shard: bool = False) -> str:
    """Return ``list`` for people, one entry per line in due order."""
    if not listing.entries:
        return "No parked entries match."
    now = listing.now_ms
    rows = []
    for entry in listing.entries:
        rows.append(
            [
                ("-" if entry.due_ms is None else relative_due(entry.due_ms, now))
                + _state_note(entry),
                "-" if entry.due_ms is None else utc(entry.due_ms),
                *([str(entry.shard)] if show_shard else []),
                entry.task or "(unreadable)",
                entry.task_id,
                entry.queue or "-",
                clip(_arguments(entry.argsrepr, entry.kwargsrepr, entry.error), ARGS_WIDTH),
            ]
        )
    headers = ["DUE", "DUE AT (UTC)", *(["SHARD"] if show_shard else []), "TASK", "ID"]
    headers += ["QUEUE", "ARGS"]
    states = Counter(entry.state for entry in listing.entries)
    if states.keys() <= {EntryState.PARKED}:
        return table(headers, rows) + "\n" + _footer(listing, EntryState.PARKED.label)
    # In this order: parked always, held and in flight when there are some.
    parts = [
        f"{count(states[state])} {state.label}"
        for state in (EntryState.PARKED, EntryState.HELD, EntryState.IN_FLIGHT)
        if states[state] or state is EntryState.PARKED
    ]
    n = len(listing.entries)
    shown = f"{counted(n, 'entry', 'entries')}: {', '.join(parts)}"
    footer = (
        f"Showing the first {shown}; more match (raise --limit)." if listing.more else f"{shown}."
    )
    return table(headers, rows) + "\n" + footer


def dead_json(listing: Listing) -> dict[str, Any]:
    """Return the ``dead list --json`` document."""
    return {
        "now_ms": listing.now_ms,
        "more": listing.more,
        "entries": [_dead_json(e) for e in listing.entries],
    }


def _dead_json(entry: ParkedTask) -> dict[str, Any]:
    return {
        "id": entry.task_id,
        "task": entry.task,
        "shard": entry.shard,
        "died_ms": entry.died_ms,
        "due_ms": entry.due_ms,
        "reason": entry.reason,
        "companion": entry.companion,
        "queue": entry.queue,
        "argsrepr": entry.argsrepr,
        "kwargsrepr": entry.kwargsrepr,
        "expires": entry.expires,
        "error": entry.error,
    }


def dead_text(listing: Listing, *, show_shard: bool = False) -> str:
    """Return ``dead list`` for people, most recent first."""
    if not listing.entries:
        return "No dead-lettered entries."
    now = listing.now_ms
    rows = [
        [
            "-" if entry.died_ms is None else ago(entry.died_ms, now),
            *([str(entry.shard)] if show_shard else []),
            entry.task or "(unreadable)",
            entry.task_id,
            entry.queue or "-",
            # The last column: shown whole, since the reason is what to act on.
            " ".join((entry.reason or "-").split()),
        ]
        for entry in listing.entries
    ]
    headers = ["DIED", *(["SHARD"] if show_shard else []), "TASK", "ID", "QUEUE", "REASON"]
    return table(headers, rows) + "\n" + _footer(listing, "dead-lettered")


def _footer(listing: Listing, what: str) -> str:
    n = len(listing.entries)
    shown = counted(n, f"{what} entry", f"{what} entries")
    if listing.more:
        return f"Showing the first {shown}; more match (raise --limit)."
    return f"{shown}."


def _arguments(argsrepr: str | None, kwargsrepr: str | None, error: str | None) -> str:
    if error is not None:
        return f"! {error}"
    parts = [argsrepr or "()"]
    if kwargsrepr and kwargsrepr != "{}":
        parts.append(kwargsrepr)
    return " ".join(parts)
