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
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from itertools import pairwise

from ..due_score import due_ms_of, score_range
from ..entry import template_ref
from ..store import Store, admin
from ..store.control import HoldReasons
from ..store.listing import in_flight_in_shard
from ..store.lookup import find
from ..store.marks import mark_records
from ..store.read_model import ParkedTask, marks_fields, task_from_row
from ..store.reading import Position, TaggedScan, leased_due_ms, scan_parked

__all__ = [
    "SCAN_BOUND",
    "TIMELINE_SPANS",
    "Bar",
    "Cursor",
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
    entries: list[ParkedTask]
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
    streams: list[list[tuple[int, int, str, ParkedTask | None]]] = []
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


def in_flight(store: Store, filters: Filters) -> list[ParkedTask]:
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
) -> tuple[list[tuple[int, int, str, ParkedTask | None]], Cursor | None, int, bool]:
    """Return (matches, last entry read, entries read, reached the end) of one shard.

    Entries a pause or a rate limit holds back are read with the due set, in
    due order, and marked (:attr:`ParkedTask.held_by`).
    """
    matches: list[tuple[int, int, str, ParkedTask | None]] = []
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
        entry = task_from_row(store, scanned, reasons=reasons)
        if template and entry.error is None and entry.task is not None:
            _remember(template, entry.task)
        if not _selects(filters, entry.task, entry.queue):
            continue
        matches.append((score, shard, task_id, entry))
        if len(matches) > limit:
            return matches, last, read, False
    return matches, last, read, read < bound


def _tagged_page(store: Store, filters: Filters, after: Cursor | None, limit: int) -> Page:
    """:func:`parked_page` for a tag filter, through the tag pager (:class:`TaggedScan`).

    Exact across shards: every id of the tag is placed from the index with
    its due score (ids and scores only), and messages are read only for the
    entries shown, in due order, until the page is full or
    :data:`SCAN_BOUND` were read (a task or queue filter on top may skip
    some). Entries in flight are listed above the page (:func:`in_flight`).
    """
    now_ms = store.time_ms()
    scan = TaggedScan(
        store,
        filters.tag,
        due_after_ms=filters.due_after_ms,
        due_before_ms=filters.due_before_ms,
        after=None if after is None else Position(after.score, after.shard, after.task_id),
        id_prefix=filters.id_prefix,
        records=True,
        first_page=limit + 1,
        max_read=SCAN_BOUND,
    )
    reasons = HoldReasons(store)
    matches: list[tuple[Cursor, ParkedTask]] = []
    for row in scan:
        entry = task_from_row(store, row, reasons=reasons)
        if _selects(filters, entry.task, entry.queue):
            matches.append((Cursor(row.score, row.shard, row.task_id), entry))
            if len(matches) > limit:
                break
    nxt: Cursor | None = None
    if len(matches) > limit:
        matches = matches[:limit]
        nxt = matches[-1][0]
    elif scan.read < len(scan.positions):
        nxt = Cursor(*scan.positions[scan.read - 1])  # stopped at the bound: go on from there
    return Page(
        now_ms=now_ms,
        entries=[entry for _, entry in matches],
        next=nxt,
        scanned=scan.read,
        cut_short=nxt is not None and len(matches) < limit,
    )


def _with_marks(store: Store, entries: list[ParkedTask]) -> list[ParkedTask]:
    """Return *entries* with their keys and tags: one ``HMGET`` per shard of the page."""
    by_shard: dict[int, list[int]] = {}
    for index, entry in enumerate(entries):
        by_shard.setdefault(entry.shard, []).append(index)
    marked = list(entries)
    for shard, indexes in by_shard.items():
        members = [entries[i].task_id.encode() for i in indexes]
        for i, record in zip(indexes, mark_records(store, shard, members), strict=True):
            if record is not None:
                marked[i] = replace(entries[i], **marks_fields(record))
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


def entry_detail(store: Store, task_id: str) -> ParkedTask | None:
    """Look *task_id* up in its shard's parked, held, in-flight and dead sets, as lookup does."""
    return find(store, task_id)


def dead_page(store: Store, *, limit: int = 100) -> admin.Listing:
    """Return the most recent dead letters (a bounded read per shard)."""
    return admin.list_dead(store, limit=limit)


def as_ids(values: Iterable[str]) -> list[str]:
    """Return the non-empty ids of a form, each once, in their order."""
    return list(dict.fromkeys(v for v in values if v))
