"""What the dashboard reads from the store: bounded reads only.

Every page costs Redis a fixed number of O(log n) commands per shard, however
many entries are parked (a tag filter reads the tag's index: its cost grows
with the tag, not with the store): counts are ``ZCARD``/``ZCOUNT``, the timeline is one
``ZCOUNT`` per bar, and a listing is a ``ZRANGEBYSCORE ... LIMIT`` that starts
where the previous page stopped (a keyset cursor, never an offset), so page
10,000 costs what page 1 does. Filters on what only the payload says (task
name, queue) read at most :data:`SCAN_BOUND` entries per page, shared by the
shards, and
say where they stopped. Payloads are read only for their Celery headers:
task arguments are never decoded, and nothing is unpickled.
"""

from __future__ import annotations

import heapq
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from itertools import pairwise
from typing import Any, cast

from ..due_score import due_ms_of, score_range
from ..entry import parked_ms, template_ref
from ..store import Store, admin
from ..store.admin import ParkedEntry
from ..store.control import HoldReasons
from ..store.listing import describe_entry, in_flight_in_shard
from ..store.marks import EntryMarks, mark_records, parse_record, signed_with_tag, tagged_ids
from ..store.reading import (
    SCAN_PAGE,
    Position,
    describe,
    held_scores,
    leased_due_ms,
    scan_parked,
)

__all__ = [
    "SCAN_BOUND",
    "TIMELINE_SPANS",
    "Bar",
    "Cursor",
    "EntryDetail",
    "Filters",
    "Page",
    "Timeline",
    "entry_detail",
    "in_flight",
    "parked_page",
    "timeline",
]

#: Most entries one filtered page reads, shared by the shards (each reads at
#: least one page's worth), before it stops and says where.
SCAN_BOUND = 5_000

_MINUTE = 60_000
_HOUR = 60 * _MINUTE
_DAY = 24 * _HOUR
#: Timeline spans: name -> (span ms, bar width ms); "all" reaches the last entry.
TIMELINE_SPANS: dict[str, tuple[int, int]] = {
    "hour": (_HOUR, 2 * _MINUTE),
    "day": (_DAY, _HOUR),
    "week": (7 * _DAY, 6 * _HOUR),
}
#: Bars of the "all" timeline.
_ALL_BARS = 30


# -- timeline -----------------------------------------------------------------


@dataclass(frozen=True)
class Bar:
    """Entries due in ``[start_ms, end_ms)``; the overdue bar has no start."""

    start_ms: int | None
    end_ms: int
    count: int


@dataclass(frozen=True)
class Timeline:
    """A histogram of due times, read at :attr:`now_ms`."""

    span: str
    now_ms: int
    #: The first bar holds what is overdue; the others follow in due order.
    bars: list[Bar]
    #: Entries due after the last bar (beyond the span).
    later: int

    @property
    def peak(self) -> int:
        return max((b.count for b in self.bars), default=0)


def timeline(store: Store, span: str = "day") -> Timeline:
    """Count parked entries per due-time bar, one pipelined ``ZCOUNT`` per bar and shard."""
    now_ms = store.time_ms()
    shards = list(store.shards)
    if span == "all":
        last = _last_due_ms(store, shards)
        width = max(-(-max((last or now_ms) - now_ms, 1) // _ALL_BARS), 1000)
        edges = [now_ms + width * i for i in range(_ALL_BARS + 1)]
    else:
        total, width = TIMELINE_SPANS[span]
        edges = [now_ms + width * i for i in range(total // width + 1)]
    # Each bar is [edge, next edge) in due ms: scores [edge*1024, next*1024).
    bounds = [score_range(None, edges[0])]
    bounds += [score_range(a, b) for a, b in pairwise(edges)]
    bounds.append(score_range(edges[-1], None))
    with store.client.pipeline(transaction=False) as pipe:
        for shard in shards:
            keys = store.keys(shard)
            for low, high in bounds:
                pipe.zcount(keys.due, low, high)
            # In flight past its due time is overdue too, as the counts say
            # (bounded by the companions' batches: read whole).
            pipe.hvals(keys.leased)
        replies = pipe.execute()
    sums = [0] * len(bounds)
    per_shard = len(bounds) + 1
    for index, reply in enumerate(replies):
        if index % per_shard == len(bounds):
            sums[0] += sum(leased_due_ms(record) <= now_ms for record in reply)
        else:
            sums[index % per_shard] += int(reply)
    bars = [Bar(None, edges[0], sums[0])]
    bars += [Bar(a, b, n) for a, b, n in zip(edges[:-1], edges[1:], sums[1:-1], strict=True)]
    return Timeline(span=span, now_ms=now_ms, bars=bars, later=sums[-1])


def _last_due_ms(store: Store, shards: list[int]) -> int | None:
    with store.client.pipeline(transaction=False) as pipe:
        for shard in shards:
            pipe.zrange(store.keys(shard).due, -1, -1, withscores=True)
        replies = pipe.execute()
    dues = [due_ms_of(reply[0][1]) for reply in replies if reply]
    return max(dues) if dues else None


# -- the parked listing -----------------------------------------------------------


@dataclass(frozen=True)
class Filters:
    """What a listing selects. Empty strings and None select everything."""

    #: Task name or glob pattern (``proj.orders.*``).
    task: str = ""
    #: Routing key (the queue name on the default exchange), exactly.
    queue: str = ""
    #: Start of the task id.
    id_prefix: str = ""
    #: Due in ``[due_after_ms, due_before_ms)``.
    due_after_ms: int | None = None
    due_before_ms: int | None = None
    #: A tag (``apply_delayed(tags=[...])``), exactly: read through its index.
    tag: str = ""

    @property
    def scans(self) -> bool:
        """Whether the filter reads payloads (or ids) rather than only the index."""
        return bool(self.task or self.queue or self.id_prefix)


@dataclass(frozen=True, order=True)
class Cursor:
    """Where a page stopped: the last entry read, in (score, shard, id) order."""

    score: int
    shard: int
    task_id: str

    def encode(self) -> str:
        return f"{self.score}.{self.shard}.{self.task_id}"

    @classmethod
    def decode(cls, text: str) -> Cursor | None:
        """Return the cursor *text* encodes, or None when it is not one."""
        # ASCII digits of a bounded length: str.isdigit() also accepts "²"
        # and "٣", which int() refuses, and int() refuses 4,300+ digits.
        found = _CURSOR.fullmatch(text)
        if found is None:
            return None
        return cls(int(found.group(1)), int(found.group(2)), found.group(3))


#: score.shard.task_id; a score is at most 2**63 (20 digits).
_CURSOR = re.compile(r"([0-9]{1,20})\.([0-9]{1,6})\.(.*)", re.ASCII | re.DOTALL)


@dataclass(frozen=True)
class Page:
    """One page of a listing, and the cursor of the next one."""

    now_ms: int
    entries: list[ParkedEntry]
    #: Where the next page starts; None when nothing is left.
    next: Cursor | None
    #: Entries read to fill the page (more than shown when a filter skipped some).
    scanned: int
    #: A filtered scan stopped at its bound before filling the page.
    cut_short: bool = False


def parked_page(
    store: Store, filters: Filters, *, after: Cursor | None = None, limit: int = 50
) -> Page:
    """Return up to *limit* parked entries matching *filters*, in due order, after *after*.

    Each shard is read from the cursor on, in due order, until it has given
    *limit* matches or its share of :data:`SCAN_BOUND` entries; the shards are merged by
    (score, shard, id). When a shard's scan stops at its bound, the page
    ends at the earliest point every shard has reached, so the next page
    misses nothing.
    """
    if filters.tag:
        return _tagged_page(store, filters, after, limit)
    now_ms = store.time_ms()
    streams: list[list[tuple[int, int, str, ParkedEntry | None]]] = []
    frontier: Cursor | None = None  # earliest point where a cut-short shard stopped
    scanned = 0
    bound = max(SCAN_BOUND // len(store.shards), limit + 1) if filters.scans else limit + 1
    reasons = HoldReasons(store)
    for shard in store.shards:
        matches, last, count, exhausted = _scan_shard(
            store, shard, filters, after, limit, bound, reasons
        )
        scanned += count
        streams.append(matches)
        if not exhausted and last is not None and len(matches) <= limit:
            # This shard stopped at its bound without filling the page.
            frontier = last if frontier is None else min(frontier, last)
    merged = list(heapq.merge(*streams, key=lambda m: (m[0], m[1], m[2])))
    if frontier is not None:
        merged = [m for m in merged if Cursor(m[0], m[1], m[2]) <= frontier]
    shown = merged[:limit]
    entries = [m[3] for m in shown if m[3] is not None]
    if len(merged) > limit:
        nxt: Cursor | None = Cursor(*shown[-1][:3])
    elif frontier is not None:
        nxt = frontier
    else:
        nxt = None
    return Page(
        now_ms=now_ms,
        entries=_with_marks(store, entries),
        next=nxt,
        scanned=scanned,
        cut_short=frontier is not None and len(merged) <= limit,
    )


def in_flight(store: Store, filters: Filters) -> list[ParkedEntry]:
    """Return the entries in flight that match *filters*, in due order.

    Claimed by a companion and not yet acknowledged (being released, or held
    while the broker is down): still waiting to run, and counted as overdue
    once their due time passed, so the listing shows them too. Bounded by
    the companions' batches.
    """
    found = []
    for shard in store.shards:
        for score, _, entry in in_flight_in_shard(
            store, shard, filters.due_after_ms, filters.due_before_ms, None
        ):
            if filters.id_prefix and not entry.task_id.startswith(filters.id_prefix):
                continue
            if filters.tag and filters.tag not in entry.tags:
                continue
            if _selects(filters, entry.task, entry.queue):
                found.append((score, shard, entry.task_id, entry))
    found.sort(key=lambda item: item[:3])
    return [entry for *_, entry in found]


def _scan_shard(
    store: Store,
    shard: int,
    filters: Filters,
    after: Cursor | None,
    limit: int,
    bound: int,
    reasons: HoldReasons,
) -> tuple[list[tuple[int, int, str, ParkedEntry | None]], Cursor | None, int, bool]:
    """Return (matches, last entry read, entries read, reached the end) of one shard.

    Entries a pause or a rate limit holds back are read with the due set, in
    due order, and marked (:attr:`ParkedEntry.held_by`).
    """
    matches: list[tuple[int, int, str, ParkedEntry | None]] = []
    # Entries read past the cursor: what the bound counts.
    read = 0
    last: Cursor | None = None
    for scanned in scan_parked(
        store,
        shards=[shard],
        due_after_ms=filters.due_after_ms,
        due_before_ms=filters.due_before_ms,
        after=None if after is None else Position(after.score, after.shard, after.task_id),
        first_page=limit + 1,
        per_shard=bound,
        held=True,
    ):
        read += 1
        task_id, score, payload = scanned.task_id, scanned.score, scanned.payload
        last = Cursor(score, shard, task_id)
        if filters.id_prefix and not task_id.startswith(filters.id_prefix):
            continue
        template = template_ref(payload) if payload is not None else None
        known = _TEMPLATE_TASKS.get(template) if template else None
        if known is not None and filters.task and not fnmatchcase(known, filters.task):
            continue  # ruled out by its template alone, without decoding it
        entry = describe_entry(
            store, task_id, shard, score, payload, held_by=scanned.held, reasons=reasons
        )
        if template and entry.error is None and entry.task is not None:
            _remember(template, entry.task)
        if not _selects(filters, entry.task, entry.queue):
            continue
        matches.append((score, shard, task_id, entry))
        if len(matches) > limit:
            return matches, last, read, False
    return matches, last, read, read < bound


def _tagged_page(store: Store, filters: Filters, after: Cursor | None, limit: int) -> Page:
    """:func:`parked_page` for a tag filter: the tag's index says which entries to read.

    Exact across shards: every id of the tag is read from the index with its
    due score (ids and scores only), and messages only for the entries shown,
    in due order, until the page is full or :data:`SCAN_BOUND` were read (a
    task or queue filter on top may skip some). With ``zdelay_signing_key``
    an entry is shown only if its signed message carries the tag, as the
    CLI's and Python's tag selections require: an index entry written into
    Redis cannot put a signed entry under a bulk action of another tag.
    """
    now_ms = store.time_ms()
    low = filters.due_after_ms
    high = filters.due_before_ms
    candidates: list[Cursor] = []
    held_by: dict[tuple[int, str], str] = {}
    for shard in store.shards:
        ids = [
            task_id
            for task_id in tagged_ids(store, filters.tag, shards=[shard])
            if task_id.startswith(filters.id_prefix)
        ]
        scores = store.client.zmscore(store.keys(shard).due, ids) if ids else []
        held = held_scores(store, shard, [t for t, s in zip(ids, scores, strict=True) if s is None])
        for task_id, lane_score in held.items():
            held_by[shard, task_id] = lane_score[0]
        scores = [held[t][1] if t in held else s for t, s in zip(ids, scores, strict=True)]
        for task_id, score in zip(ids, scores, strict=True):
            if score is None:
                continue  # in flight (listed above the page) or gone
            place = Cursor(int(score), shard, task_id)
            due_ms = due_ms_of(place.score)
            if (low is not None and due_ms < low) or (high is not None and due_ms >= high):
                continue
            if after is None or place > after:
                candidates.append(place)
    candidates.sort()
    signed = bool(store.config.signing_keys)
    reasons = HoldReasons(store)
    matches: list[tuple[Cursor, ParkedEntry]] = []
    read = 0
    page_size = limit + 1
    while read < len(candidates) and len(matches) <= limit and read < SCAN_BOUND:
        chunk = candidates[read : read + min(page_size, SCAN_BOUND - read)]
        read += len(chunk)
        # Dense matches fill a page from a short read; sparse ones read more per trip.
        page_size = min(page_size * 4, SCAN_PAGE)
        for place, payload, record in zip(chunk, *_read_entries(store, chunk), strict=True):
            if payload is None:
                continue  # released or cancelled between the reads
            if signed and not signed_with_tag(
                store, place.shard, place.task_id, payload, filters.tag
            ):
                continue
            entry = describe_entry(
                store,
                place.task_id,
                place.shard,
                place.score,
                payload,
                record=record,
                held_by=held_by.get((place.shard, place.task_id)),
                reasons=reasons,
            )
            if _selects(filters, entry.task, entry.queue):
                matches.append((place, entry))
    nxt: Cursor | None = None
    if len(matches) > limit:
        matches = matches[:limit]
        nxt = matches[-1][0]
    elif read < len(candidates):
        nxt = candidates[read - 1]  # stopped at the bound: go on from the last read
    return Page(
        now_ms=now_ms,
        entries=[entry for _, entry in matches],
        next=nxt,
        scanned=read,
        cut_short=nxt is not None and len(matches) < limit,
    )


def _read_entries(
    store: Store, places: list[Cursor]
) -> tuple[list[bytes | None], list[bytes | None]]:
    """Return the messages and key/tag records of *places*, in their order."""
    by_shard: dict[int, list[int]] = {}
    for index, place in enumerate(places):
        by_shard.setdefault(place.shard, []).append(index)
    payloads: list[bytes | None] = [None] * len(places)
    records: list[bytes | None] = [None] * len(places)
    for shard, indexes in by_shard.items():
        members = [places[i].task_id.encode() for i in indexes]
        shard_payloads = cast(
            "list[bytes | None]", store.client.hmget(store.keys(shard).msg, members)
        )
        for i, payload, record in zip(
            indexes, shard_payloads, mark_records(store, shard, members), strict=True
        ):
            payloads[i], records[i] = payload, record
    return payloads, records


def _with_marks(store: Store, entries: list[ParkedEntry]) -> list[ParkedEntry]:
    """Return *entries* with their keys and tags: one ``HMGET`` per shard of the page."""
    by_shard: dict[int, list[int]] = {}
    for index, entry in enumerate(entries):
        by_shard.setdefault(entry.shard, []).append(index)
    marked = list(entries)
    for shard, indexes in by_shard.items():
        members = [entries[i].task_id.encode() for i in indexes]
        for i, record in zip(indexes, mark_records(store, shard, members), strict=True):
            if record is not None:
                marks = parse_record(record.decode(errors="replace"))
                marked[i] = replace(entries[i], key=marks.key, tags=marks.tags)
    return marked


#: Task name by template id. The task name is a template field (the same for
#: every entry of a template), and a template id is the hash of its content,
#: so a task filter can rule entries out from their metadata line alone. The
#: routing key is not: it is a per-call value (a topic exchange may get a new
#: one on every call), so a queue filter reads each entry.
_TEMPLATE_TASKS: dict[str, str] = {}
_TEMPLATE_TASKS_SIZE = 10_000


def _remember(template: str, task: str) -> None:
    if len(_TEMPLATE_TASKS) >= _TEMPLATE_TASKS_SIZE:
        _TEMPLATE_TASKS.clear()
    _TEMPLATE_TASKS[template] = task


def _selects(filters: Filters, task: str | None, queue: str | None) -> bool:
    if filters.task and (task is None or not fnmatchcase(task, filters.task)):
        return False
    return not (filters.queue and queue != filters.queue)


# -- one entry ----------------------------------------------------------------------


@dataclass(frozen=True)
class EntryDetail:
    """Everything the store knows about one id, without decoding its arguments."""

    task_id: str
    shard: int
    #: "parked", "held", "in flight", "dead" or None when the id is unknown.
    state: str | None
    due_ms: int | None = None
    #: Lease expiry of an in-flight entry.
    lease_until_ms: int | None = None
    died_ms: int | None = None
    reason: dict[str, Any] = field(default_factory=dict)
    #: Celery headers, as Celery wrote them (argsrepr, kwargsrepr, ...).
    headers: dict[str, Any] = field(default_factory=dict)
    queue: str | None = None
    #: Why the payload cannot be read, if it cannot.
    error: str | None = None
    #: When it was parked (epoch ms, Redis clock); None when not recorded.
    parked_ms: int | None = None
    #: Its key, ``on_key`` mode and tags (``apply_delayed(key=..., tags=...)``).
    marks: EntryMarks | None = None
    #: The control holding it back (``"queue:emails"``), when state is "held".
    held_by: str | None = None
    #: Why: "pause" or "rate_limit", when state is "held".
    held_reason: str | None = None


def entry_detail(store: Store, task_id: str) -> EntryDetail:
    """Look *task_id* up in its shard's parked, held, in-flight and dead sets."""
    shard = store.shard_of(task_id)
    keys = store.keys(shard)
    with store.client.pipeline(transaction=False) as pipe:
        pipe.zscore(keys.due, task_id)
        pipe.hget(keys.msg, task_id)
        pipe.zscore(keys.lease, task_id)
        pipe.hget(keys.leased, task_id)
        pipe.zscore(keys.dead, task_id)
        pipe.hget(keys.dead_msg, task_id)
        # Its key and tags: "i:<id>" while parked or in flight, "d:<id>" while dead.
        pipe.hmget(keys.marks, ["i:" + task_id, "d:" + task_id])
        due, payload, lease, leased, died, dead_record, (marked, dead_marked) = pipe.execute()
    reason: dict[str, Any] = {}
    due_ms: int | None
    held = (
        held_scores(store, shard, [task_id]).get(task_id)
        if due is None and lease is None and payload is not None
        else None
    )
    if due is not None:
        state, due_ms = "parked", due_ms_of(due)
    elif held is not None:
        state, due_ms = "held", due_ms_of(held[1])
    elif lease is not None:
        # The leased record starts with the due score the entry was claimed at.
        due_ms = leased_due_ms(leased) if leased else None
        state = "in flight"
    elif died is not None:
        state, due_ms = "dead", None
        line, _, payload = (dead_record or b"").partition(b"\n")
        try:
            parsed = json.loads(line)
            reason = parsed if isinstance(parsed, dict) else {"reason": str(parsed)}
        except ValueError:
            reason = {"reason": line.decode(errors="replace")}
        if isinstance(reason.get("due_ms"), int):
            due_ms = reason["due_ms"]
        payload = payload or None
    else:
        return EntryDetail(task_id=task_id, shard=shard, state=None)
    headers, queue, error = describe(payload, store.templates(shard))
    record = dead_marked if state == "dead" else marked
    return EntryDetail(
        task_id=task_id,
        shard=shard,
        state=state,
        due_ms=due_ms,
        lease_until_ms=int(lease) if lease is not None else None,
        died_ms=int(died) if died is not None else None,
        reason=reason,
        headers=headers,
        queue=queue,
        error=error,
        parked_ms=parked_ms(payload),
        marks=parse_record(record.decode(errors="replace")) if record is not None else None,
        held_by=held[0] if held else None,
        held_reason=HoldReasons(store)(held[0]) if held else None,
    )


def dead_page(store: Store, *, limit: int = 100) -> admin.Listing:
    """Return the most recent dead letters (a bounded read per shard)."""
    return admin.list_dead(store, limit=limit)


def as_ids(values: Iterable[str]) -> list[str]:
    """Return the non-empty ids of a form, each once, in their order."""
    return list(dict.fromkeys(v for v in values if v))
