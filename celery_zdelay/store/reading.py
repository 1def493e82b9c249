"""How the store's admin reads read parked entries: one pager, one tag pager, what they share.

:func:`scan_parked` is the one way to read parked entries in due order (as
redis-py's ``zscan_iter`` hides paging): the listing (``zdelay list``), bulk
selection (``cancel --task``), the dashboard and the testing plugin read
through it; with ``held=True`` it also reads the entries a pause or a rate
limit holds back (the held sets of :mod:`.control`), merged into the due
order. :class:`TaggedScan` is the one way to read the entries of a tag,
through its index: ``zdelay list --tag``, ``cancel_matching(tag=...)`` and
``reschedule_matching(tag=...)``, and the dashboard's tag filter. The rest
are the checks and conversions those callers share: shard and limit
checks, glob matching, a payload's Celery headers.

Both yield raw rows (:class:`ScannedEntry`); :mod:`.read_model` turns a row
into the :class:`~.read_model.ParkedTask` that callers show.

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
from .marks import mark_records, signed_with_tag, tagged_ids
from .redis_keys import held_set_key
from .store import Store

__all__ = [
    "ADMIN_BATCH",
    "DEFAULT_LIST_LIMIT",
    "MAX_LIST_LIMIT",
    "SCAN_PAGE",
    "Position",
    "ScannedEntry",
    "TaggedScan",
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
    """A raw row of a scan: an id, its score and the stored bytes, not yet read.

    Internal: what :func:`scan_parked` and :class:`TaggedScan` read from
    Redis, before anything is decoded. It stays a type of its own so that a
    caller which only needs ids and scores (bulk cancel, the testing
    plugin's clock) reads no payload and decodes no header; everything shown
    to users is a :class:`~.read_model.ParkedTask`
    (:func:`~.read_model.task_from_row`).
    """

    task_id: str
    shard: int
    #: Its due score (:mod:`celery_zdelay.due_score`).
    score: int
    #: The stored entry; None when the id is parked without one (the
    #: companion will dead-letter it), or when payloads were not asked for.
    payload: bytes | None
    #: Its key and tag record (:mod:`.marks`), when asked for and it has one.
    record: bytes | None = None
    #: The lane (a control, ``"queue:emails"``, or its pause's: see
    #: :func:`~.control.lane_control`) whose held set it is in, if a pause
    #: or a rate limit holds it back; None when it is in the due set.
    held: str | None = None
    #: Read from the lease (claimed by a companion); its score is the one it
    #: was claimed at.
    in_flight: bool = False

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


class TaggedScan:
    """The entries tagged *tag*, read through its index in (score, shard, id) order.

    The one tag pager. Creating it reads, per shard, the tag's ids (from
    the index, in pages) and where each is: its due score in the due set, in
    a held set (:attr:`ScannedEntry.held`), or, with *in_flight*, in the
    lease; ids and scores only, so the order is exact across shards, and
    :attr:`positions` lists every candidate. Iterating it then reads
    messages (*payloads*) and key/tag records (*records*) in pages, lazily,
    in that order: the first of *first_page* entries, each next one four
    times larger, up to :data:`SCAN_PAGE`; at most *max_read* in all.
    :attr:`read` says how many candidates were read so far, so a caller
    that stops can say where.

    Due times are selected in ``[due_after_ms, due_before_ms)``; with
    *after*, only entries past that position; with *id_prefix*, only ids
    that start with it. An entry released or cancelled between the reads is
    skipped. With ``zdelay_signing_key`` an entry is yielded only if its
    signed message carries the tag: an index entry written into Redis
    cannot put a signed entry under the listing, or a bulk cancel or
    reschedule, of another tag.
    """

    def __init__(
        self,
        store: Store,
        tag: str,
        *,
        shards: Iterable[int] | None = None,
        due_after_ms: int | None = None,
        due_before_ms: int | None = None,
        after: Position | None = None,
        id_prefix: str = "",
        in_flight: bool = False,
        payloads: bool = True,
        records: bool = False,
        first_page: int = SCAN_PAGE,
        max_read: int | None = None,
    ) -> None:
        self.store = store
        self.tag = tag
        self._payloads = payloads or bool(store.config.signing_keys)
        self._records = records
        self._first_page = first_page
        self._max_read = max_read
        #: Candidates read so far (yielded or skipped).
        self.read = 0
        found: list[tuple[Position, str | None, bool]] = []
        for shard in selected_shards(store, shards):
            ids = [t for t in tagged_ids(store, tag, shards=[shard]) if t.startswith(id_prefix)]
            for start in range(0, len(ids), SCAN_PAGE):
                found += self._placed(shard, ids[start : start + SCAN_PAGE], in_flight)
        found = [
            item
            for item in found
            if (due_after_ms is None or due_ms_of(item[0].score) >= due_after_ms)
            and (due_before_ms is None or due_ms_of(item[0].score) < due_before_ms)
            and (after is None or item[0] > after)
        ]
        found.sort(key=lambda item: item[0])
        self._candidates = found
        #: Every candidate's position, in order: where the tag's entries are.
        self.positions = [position for position, _, _ in found]

    def _placed(
        self, shard: int, ids: list[str], in_flight: bool
    ) -> list[tuple[Position, str | None, bool]]:
        """Return (position, held control, in flight) of those of *ids* still parked on *shard*."""
        store = self.store
        keys = store.keys(shard)
        # ZSCORE per id rather than ZMSCORE: the documented producer ACL
        # user (cancel_matching) may run it.
        with store_errors(store.url), store.client.pipeline(transaction=False) as pipe:
            for task_id in ids:
                pipe.zscore(keys.due, task_id)
            scores: list[Any] = pipe.execute()
        held = held_scores(store, shard, [t for t, s in zip(ids, scores, strict=True) if s is None])
        leased: list[Any] = [None] * len(ids)
        unplaced = [t for t, s in zip(ids, scores, strict=True) if s is None and t not in held]
        if in_flight and unplaced:
            with store_errors(store.url):
                records = cast("list[bytes | None]", store.client.hmget(keys.leased, unplaced))
            by_id = dict(zip(unplaced, records, strict=True))
            leased = [by_id.get(t) for t in ids]
        placed: list[tuple[Position, str | None, bool]] = []
        for task_id, score, lease in zip(ids, scores, leased, strict=True):
            if task_id in held:
                placed.append((Position(held[task_id][1], shard, task_id), held[task_id][0], False))
            elif score is not None:
                placed.append((Position(int(score), shard, task_id), None, False))
            elif lease is not None:
                placed.append((Position(leased_score(lease), shard, task_id), None, True))
            # else: released, cancelled or (without *in_flight*) being released
        return placed

    def __iter__(self) -> Iterator[ScannedEntry]:
        store = self.store
        page = self._first_page
        while self.read < len(self._candidates):
            size = page if self._max_read is None else min(page, self._max_read - self.read)
            if size <= 0:
                return
            chunk = self._candidates[self.read : self.read + size]
            self.read += len(chunk)
            # Dense matches fill a page from a short read; sparse ones read more per trip.
            page = max(page, min(page * 4, SCAN_PAGE))
            payloads, records = self._read([position for position, _, _ in chunk])
            for (position, held, flying), payload, record in zip(
                chunk, payloads, records, strict=True
            ):
                if self._payloads and payload is None:
                    continue  # released or cancelled between the reads
                if store.config.signing_keys and not signed_with_tag(
                    store, position.shard, position.task_id, payload, self.tag
                ):
                    continue
                yield ScannedEntry(
                    position.task_id,
                    position.shard,
                    position.score,
                    payload,
                    record,
                    held=held,
                    in_flight=flying,
                )

    def _read(self, places: list[Position]) -> tuple[list[bytes | None], list[bytes | None]]:
        """Return the messages and key/tag records of *places* (as asked for), in their order."""
        store = self.store
        payloads: list[bytes | None] = [None] * len(places)
        records: list[bytes | None] = [None] * len(places)
        if not (self._payloads or self._records):
            return payloads, records
        by_shard: dict[int, list[int]] = {}
        for index, place in enumerate(places):
            by_shard.setdefault(place.shard, []).append(index)
        for shard, indexes in by_shard.items():
            members = [places[i].task_id.encode() for i in indexes]
            with store_errors(store.url):
                if self._payloads:
                    shard_payloads = cast(
                        "list[bytes | None]", store.client.hmget(store.keys(shard).msg, members)
                    )
                    for i, payload in zip(indexes, shard_payloads, strict=True):
                        payloads[i] = payload
                if self._records:
                    for i, record in zip(indexes, mark_records(store, shard, members), strict=True):
                        records[i] = record
        return payloads, records


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
