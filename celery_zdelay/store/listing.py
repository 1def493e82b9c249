"""List parked entries in due order, filtered by task and due window, bounded.

Listings are bounded with ``LIMIT`` (and a scan bound when filtering by
task name), so listing a store of millions of entries costs Redis about
what one claim does. Entries in flight are listed too, and so are those a
pause or a rate limit holds back (marked with their control and why).
Each entry is a :class:`~.read_model.ParkedTask`, read through the one
pager (:func:`~.reading.scan_parked`) or, for a tag, the one tag pager
(:class:`~.reading.TaggedScan`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import cast

from .client import store_errors
from .control import HoldReasons
from .marks import mark_records
from .read_model import ParkedTask, task_from_row
from .reading import (
    DEFAULT_LIST_LIMIT,
    MAX_LIST_LIMIT,
    SCAN_PAGE,
    ScannedEntry,
    TaggedScan,
    as_text,
    check_limit,
    leased_score,
    matches_patterns,
    scan_parked,
    selected_shards,
)
from .store import Store

__all__ = [
    "DEFAULT_LIST_LIMIT",
    "MAX_LIST_LIMIT",
    "MAX_SCAN",
    "Listing",
    "ParkedEntry",
    "in_flight_in_shard",
    "list_parked",
]

#: Most entries per shard a filtered listing (``task=``) reads before it stops.
MAX_SCAN = 10_000

#: The name listings used before there was one read model: kept for code
#: that imported it from :mod:`celery_zdelay.store.admin`.
ParkedEntry = ParkedTask


@dataclass(frozen=True)
class Listing:
    """Entries of a listing, and whether more match than it shows."""

    now_ms: int
    entries: list[ParkedTask]
    #: More entries match (or may match, when a filtered scan stopped at its bound).
    more: bool


def list_parked(
    store: Store,
    *,
    task: str | None = None,
    queue: str | None = None,
    due_after_ms: int | None = None,
    due_before_ms: int | None = None,
    limit: int = DEFAULT_LIST_LIMIT,
    shards: Iterable[int] | None = None,
    scan_limit: int = MAX_SCAN,
    tag: str | None = None,
) -> Listing:
    """Return parked entries (:class:`~.read_model.ParkedTask`) in due order, at most *limit*.

    *due_after_ms* and *due_before_ms* select due times in ``[after,
    before)``; *task* and *queue* are names or glob patterns
    (``proj.orders.*``). Without them each shard costs one bounded range
    read; with them, each shard reads at most *scan_limit* entries, in pages.
    With *tag*, only the entries of that tag are read, through its index.
    """
    check_limit(limit)
    numbers = selected_shards(store, shards)
    now_ms = store.time_ms()
    wanted = _matcher(task, queue)
    reasons = HoldReasons(store)
    if tag is not None:
        found_tagged = _tagged(
            store, numbers, tag, due_after_ms, due_before_ms, wanted, limit, reasons
        )
        return Listing(now_ms=now_ms, entries=found_tagged[:limit], more=len(found_tagged) > limit)
    found: list[tuple[int, int, ParkedTask]] = []
    more = False
    for shard in numbers:
        entries, shard_more = _parked_in_shard(
            store, shard, due_after_ms, due_before_ms, wanted, limit, scan_limit, reasons
        )
        found += entries
        found += in_flight_in_shard(store, shard, due_after_ms, due_before_ms, wanted)
        more = more or shard_more
    found.sort(key=lambda item: (item[0], item[1]))
    if len(found) > limit:
        more = True
    return Listing(now_ms=now_ms, entries=[entry for _, _, entry in found[:limit]], more=more)


def _matcher(task: str | None, queue: str | None) -> Callable[[ParkedTask], bool] | None:
    """Return whether an entry matches the *task* and *queue* patterns; None matches all."""
    if task is None and queue is None:
        return None

    def wanted(entry: ParkedTask) -> bool:
        return matches_patterns(entry.task, entry.queue, task, queue)

    return wanted


def _parked_in_shard(
    store: Store,
    shard: int,
    due_after_ms: int | None,
    due_before_ms: int | None,
    wanted: Callable[[ParkedTask], bool] | None,
    limit: int,
    scan_limit: int,
    reasons: HoldReasons,
) -> tuple[list[tuple[int, int, ParkedTask]], bool]:
    """Return up to limit + 1 matching entries of *shard*, and whether the scan was cut short."""
    matches: list[tuple[int, int, ParkedTask]] = []
    read = 0
    for scanned in scan_parked(
        store,
        shards=[shard],
        due_after_ms=due_after_ms,
        due_before_ms=due_before_ms,
        # Unfiltered, the first limit + 1 entries are the answer: one read.
        first_page=limit + 1 if wanted is None else SCAN_PAGE,
        per_shard=None if wanted is None else scan_limit,
        records=True,
        held=True,
    ):
        read += 1
        entry = task_from_row(store, scanned, reasons=reasons)
        if wanted is None or wanted(entry):
            matches.append((scanned.score, shard, entry))
        if len(matches) > limit:
            return matches, False
    return matches, wanted is not None and read >= scan_limit


def in_flight_in_shard(
    store: Store,
    shard: int,
    due_after_ms: int | None,
    due_before_ms: int | None,
    wanted: Callable[[ParkedTask], bool] | None,
) -> list[tuple[int, int, ParkedTask]]:
    """Return the in-flight entries of *shard* that match, with their scores, in no order.

    They are listed too: an entry a companion holds while the broker is down
    is still waiting to run, and late if its due time passed. The set is
    bounded by the companions' batches, so it is read whole.
    """
    keys = store.keys(shard)
    with store_errors(store.url):
        leased = cast("dict[bytes, bytes]", store.client.hgetall(keys.leased))
        members = list(leased)
        payloads = cast(
            "list[bytes | None]", store.client.hmget(keys.msg, members) if members else []
        )
        records = mark_records(store, shard, members)
    found = []
    for member, payload, record in zip(members, payloads, records, strict=True):
        score = leased_score(leased[member])
        row = ScannedEntry(as_text(member), shard, score, payload, record, in_flight=True)
        if due_after_ms is not None and row.due_ms < due_after_ms:
            continue
        if due_before_ms is not None and row.due_ms >= due_before_ms:
            continue
        entry = task_from_row(store, row)
        if wanted is not None and not wanted(entry):
            continue
        found.append((score, shard, entry))
    return found


def _tagged(
    store: Store,
    shards: list[int],
    tag: str,
    due_after_ms: int | None,
    due_before_ms: int | None,
    wanted: Callable[[ParkedTask], bool] | None,
    limit: int,
    reasons: HoldReasons,
) -> list[ParkedTask]:
    """Return up to *limit* + 1 entries of *tag* that match, parked, held or in flight, in order."""
    scan = TaggedScan(
        store,
        tag,
        shards=shards,
        due_after_ms=due_after_ms,
        due_before_ms=due_before_ms,
        in_flight=True,
        records=True,
        first_page=limit + 1,
    )
    found: list[ParkedTask] = []
    for row in scan:
        entry = task_from_row(store, row, reasons=reasons)
        if wanted is None or wanted(entry):
            found.append(entry)
            if len(found) > limit:
                break
    return found
