"""How the store's admin reads read parked entries: one scan, and what its callers share.

:func:`scan_parked` is the one way to read parked entries in due order (as
redis-py's ``zscan_iter`` hides paging): the listing (``zdelay list``), bulk
selection (``cancel --task``), the dashboard and the testing plugin read
through it; with ``held=True`` it also reads the entries a pause or a rate
limit holds back (the held sets of :mod:`.control`), merged into the due
order. The rest are the checks and conversions those callers share:
shard and limit checks, glob matching, a payload's Celery headers.

Payloads are read only for their Celery headers
(:func:`~celery_zdelay.entry.entry_headers`): task arguments are never
decoded.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, NamedTuple, cast

from ..due_score import due_ms_of, score_of, score_range
from ..entry import TemplateLookup, entry_headers, entry_routing_key, expand_entry
from ..errors import ConfigurationError, EntryError
from .client import store_errors
from .keys import held_set_key
from .marks import mark_records
from .store import Store

__all__ = [
    "ADMIN_BATCH",
    "DEFAULT_LIST_LIMIT",
    "MAX_LIST_LIMIT",
    "SCAN_PAGE",
    "Position",
    "ScannedEntry",
    "as_text",
    "check_limit",
    "describe",
    "held_scores",
    "leased_due_ms",
    "leased_score",
    "matches_patterns",
    "optional_str",
    "scan_parked",
    "selected_shards",
]

#: Entries a listing shows when no limit is given.
DEFAULT_LIST_LIMIT = 100
#: Largest listing, so one command cannot pull a whole store into memory.
MAX_LIST_LIMIT = 10_000
#: Ids per admin script call (cancel, requeue, purge), so each call stays short.
ADMIN_BATCH = 500
#: Most entries :func:`scan_parked` reads per round trip.
SCAN_PAGE = 500


class Position(NamedTuple):
    """A place in the due order of every shard: (score, shard, id), compared in that order."""

    score: int
    shard: int
    task_id: str


@dataclass(frozen=True)
class ScannedEntry:
    """A parked entry as :func:`scan_parked` reads it: its id, score and stored bytes."""

    task_id: str
    shard: int
    #: Its due score (:mod:`celery_zdelay.due_score`).
    score: int
    #: The stored entry; None when the id is parked without one (the
    #: companion will dead-letter it), or when payloads were not asked for.
    payload: bytes | None
    #: Its key and tag record (:mod:`.marks`), when asked for and it has one.
    record: bytes | None = None
    #: The control (``"queue:emails"``) whose held set it is in, if a pause
    #: or a rate limit holds it back; None when it is in the due set.
    held: str | None = None

    @property
    def due_ms(self) -> int:
        return due_ms_of(self.score)


def scan_parked(
    store: Store,
    *,
    shards: Iterable[int] | None = None,
    due_after_ms: int | None = None,
    due_before_ms: int | None = None,
    after: Position | None = None,
    first_page: int = SCAN_PAGE,
    per_shard: int | None = None,
    payloads: bool = True,
    records: bool = False,
    held: bool = False,
) -> Iterator[ScannedEntry]:
    """Yield the parked entries of *shards* (all by default), shard by shard, each in due order.

    With *held*, the entries held back by a pause or a rate limit too (each
    names its control in :attr:`ScannedEntry.held`), merged with the due set
    in (score, id) order: they are parked, only waiting behind their control.

    Due times are selected in ``[due_after_ms, due_before_ms)``; with *after*,
    only entries past that position in (score, shard, id) order. Entries are
    read in pages, lazily: the first of *first_page* entries (a caller that
    wants a screenful stops there), each next one four times larger, up to
    :data:`SCAN_PAGE` (or *first_page*, if larger). *per_shard* caps the entries yielded per shard.

    Every command names one shard's keys, so a Redis Cluster serves each from
    one node. Entries are not read in a transaction: an entry released
    between the page of ids and the read of its payload is skipped, and one
    still parked without a payload is yielded with ``payload=None``, so a
    scan yields what the counts count.
    """
    for shard in selected_shards(store, shards):
        sources: list[str | None] = [None]
        if held:
            sources += store.lanes(shard)
        streams = [
            _scan_set(
                store,
                shard,
                lane,
                due_after_ms,
                due_before_ms,
                after,
                first_page=first_page,
                per_shard=per_shard,
                payloads=payloads,
                records=records,
            )
            for lane in sources
        ]
        if len(streams) == 1:
            yield from streams[0]
            continue
        # Redis orders equal scores by member: (score, id) is each set's order.
        merged = heapq.merge(*streams, key=lambda entry: (entry.score, entry.task_id))
        for count, entry in enumerate(merged):
            if per_shard is not None and count >= per_shard:
                break
            yield entry


def _scan_set(
    store: Store,
    shard: int,
    lane: str | None,
    due_after_ms: int | None,
    due_before_ms: int | None,
    after: Position | None,
    *,
    first_page: int,
    per_shard: int | None,
    payloads: bool,
    records: bool,
) -> Iterator[ScannedEntry]:
    """Yield the entries of *shard*'s due set (*lane* None) or of *lane*'s held set, in order."""
    keys = store.keys(shard)
    source = keys.due if lane is None else held_set_key(store.config.key_prefix, shard, lane)
    low, high = score_range(due_after_ms, due_before_ms)
    offset = 0
    if after is not None and (due_after_ms is None or after.score >= score_of(due_after_ms)):
        # Entries with the position's score come after it only on a later shard,
        # or on its shard with a larger id (Redis orders equal scores by member).
        low = str(after.score) if shard >= after.shard else f"({after.score}"
        if shard == after.shard:
            # Entries of the position's score up to its id were read already:
            # start near it rather than at the start of its score slot, which
            # may hold thousands (a bulk park of more than 1,024 in one millisecond).
            offset = max(_rank_in_slot(store, source, after) - first_page, 0)
    yielded = 0
    page = first_page
    while per_shard is None or yielded < per_shard:
        size = page if per_shard is None else min(page, per_shard - yielded)
        with store_errors(store.url):
            # The store's client returns bytes (decode_responses=False).
            members = cast(
                "list[tuple[bytes, float]]",
                store.client.zrangebyscore(
                    source, low, high, start=offset, num=size, withscores=True
                ),
            )
            ids = [member for member, _ in members]
            stored = _payloads(store, shard, source, ids) if payloads else [None] * len(ids)
            marks = mark_records(store, shard, ids) if records else [None] * len(ids)
        offset += len(members)
        for (member, score), payload, record in zip(members, stored, marks, strict=True):
            task_id = as_text(member)
            if after is not None and (int(score), shard) == after[:2] and task_id <= after.task_id:
                continue  # read already, before the position
            if payload is _RELEASED:
                continue
            yielded += 1
            yield ScannedEntry(
                task_id, shard, int(score), cast("bytes | None", payload), record, held=lane
            )
        if len(members) < size:
            return
        # Dense matches fill a page from a short read; sparse ones read more per trip.
        page = max(page, min(page * 4, SCAN_PAGE))


#: Stands for the payload of an entry released between the two reads.
_RELEASED = object()


def _payloads(store: Store, shard: int, source: str, members: list[bytes]) -> list[Any]:
    """Return the stored entries of *members* of the set *source*; :data:`_RELEASED`
    for those gone from it meanwhile."""
    if not members:
        return []
    keys = store.keys(shard)
    stored = cast("list[bytes | None]", store.client.hmget(keys.msg, members))
    missing = [m for m, p in zip(members, stored, strict=True) if p is None]
    if not missing:
        return list(stored)
    with store.client.pipeline(transaction=False) as pipe:
        for member in missing:
            pipe.zscore(source, member)
        scores = pipe.execute()
    still_parked = {m for m, s in zip(missing, scores, strict=True) if s is not None}
    return [
        _RELEASED if p is None and m not in still_parked else p
        for m, p in zip(members, stored, strict=True)
    ]


def _rank_in_slot(store: Store, due: str, position: Position) -> int:
    """Return how many entries of the position's score slot come up to its id, or 0 if it left.

    Two O(log n) reads; entries of the slot removed meanwhile would make it
    too large, so the scan starts a page's worth before it (the entries read
    again are skipped by id).
    """
    with store_errors(store.url), store.client.pipeline(transaction=False) as pipe:
        pipe.zscore(due, position.task_id)
        pipe.zrank(due, position.task_id)
        pipe.zcount(due, "-inf", f"({position.score}")
        score, rank, before = pipe.execute()
    if score is None or rank is None or int(score) != position.score:
        return 0
    return int(rank) + 1 - int(before)


def leased_score(record: bytes) -> int:
    """Return the due score of an in-flight entry from its leased record ("<score> <token>")."""
    return int(bytes(record).split()[0])


def leased_due_ms(record: bytes) -> int:
    """Return the due ms of an in-flight entry from its leased record."""
    return due_ms_of(leased_score(record))


def describe(
    payload: bytes | None, templates: TemplateLookup
) -> tuple[dict[str, Any], str | None, str | None]:
    """Return (Celery headers, routing key, error) of *payload*, never decoding the body."""
    if payload is None:
        return {}, None, "payload missing: the id was parked without a message"
    try:
        payload = expand_entry(payload, templates)
        headers = entry_headers(payload)
    except EntryError as exc:
        return {}, None, exc.reason
    return headers, entry_routing_key(payload), None


def selected_shards(store: Store, shards: Iterable[int] | None) -> list[int]:
    """Return *shards* sorted, once each (all of the store's when None); refuse unknown ones."""
    if shards is None:
        return list(store.shards)
    numbers = sorted(set(shards))
    invalid = [s for s in numbers if s not in store.shards]
    if invalid:
        raise ConfigurationError(
            f"Shard {','.join(map(str, invalid))} does not exist: zdelay_shards is "
            f"{store.config.shards}, so shards run from 0 to {store.config.shards - 1}."
        )
    return numbers


def matches_patterns(
    name: Any, queue: Any, task_pattern: str | None, queue_pattern: str | None
) -> bool:
    """Whether a task *name* routed to *queue* matches the glob patterns (None: any)."""
    if task_pattern is not None and not (isinstance(name, str) and fnmatchcase(name, task_pattern)):
        return False
    return queue_pattern is None or (isinstance(queue, str) and fnmatchcase(queue, queue_pattern))


def check_limit(limit: int) -> None:
    """Refuse a listing *limit* outside 1 to :data:`MAX_LIST_LIMIT`."""
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise ConfigurationError(f"limit must be from 1 to {MAX_LIST_LIMIT}, got {limit}.")


def optional_str(value: Any) -> str | None:
    """Return *value* as text, None staying None."""
    return None if value is None else str(value)


def as_text(value: Any) -> str:
    """Return a Redis reply (bytes) as text, never failing on bad UTF-8."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def held_scores(store: Store, shard: int, task_ids: list[str]) -> dict[str, tuple[str, int]]:
    """Return, for those of *task_ids* a pause or rate limit holds on *shard*, (control, score).

    A ``ZSCORE`` per id and held set of the shard (few sets: one per control
    name), in one round trip; for what the tag index and single-id reads
    find, which do not scan. (``ZSCORE``, not ``ZMSCORE``: the documented
    producer and dashboard ACL users may run it.)
    """
    lanes = store.lanes(shard)
    if not lanes or not task_ids:
        return {}
    prefix = store.config.key_prefix
    with store_errors(store.url), store.client.pipeline(transaction=False) as pipe:
        for lane in lanes:
            key = held_set_key(prefix, shard, lane)
            for task_id in task_ids:
                pipe.zscore(key, task_id)
        replies = iter(pipe.execute())
    found: dict[str, tuple[str, int]] = {}
    for lane in lanes:
        for task_id in task_ids:
            score = next(replies)
            if score is not None:
                found.setdefault(task_id, (lane, int(score)))
    return found
