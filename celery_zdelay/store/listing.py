"""List parked entries in due order, filtered by task and due window, bounded.

Listings are bounded with ``LIMIT`` (and a scan bound when filtering by
task name), so listing a store of millions of entries costs Redis about
what one claim does. Entries in flight are listed too, and so are those a
pause or a rate limit holds back (marked with their control and why).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

from ..due_score import due_ms_of
from ..entry import parked_ms
from .client import store_errors
from .control import HoldReasons
from .marks import mark_records, parse_record, signed_with_tag, tagged_ids
from .reading import (
    DEFAULT_LIST_LIMIT,
    MAX_LIST_LIMIT,
    SCAN_PAGE,
    as_text,
    check_limit,
    describe,
    held_scores,
    leased_score,
    matches_patterns,
    optional_str,
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
    "describe_entry",
    "in_flight_in_shard",
    "list_parked",
]

#: Most entries per shard a filtered listing (``task=``) reads before it stops.
MAX_SCAN = 10_000


@dataclass(frozen=True)
class ParkedEntry:
    """A parked entry as a listing shows it: its Celery headers, never its body."""

    task_id: str
    shard: int
    due_ms: int
    #: Task name; None when the payload cannot be read (see :attr:`error`).
    task: str | None
    #: Routing key the message is published with: the queue name on the default exchange.
    queue: str | None
    argsrepr: str | None
    kwargsrepr: str | None
    #: Celery's ``expires`` header (absolute ISO time), if the task has one.
    expires: str | None
    #: Why the payload cannot be read; the companion will dead-letter it.
    error: str | None = None
    #: Claimed by a companion and not yet acknowledged (being released, or
    #: waiting for the broker); it returns to the due set if that fails.
    in_flight: bool = False
    #: When it was parked, in epoch ms on the Redis clock; None when not
    #: recorded (parked whole, by ``zdelay_whole_messages``, or by an earlier
    #: release, which did not record it).
    parked_ms: int | None = None
    #: Its key (``apply_delayed(key=...)``), if it has one.
    key: str | None = None
    #: Its tags (``apply_delayed(tags=[...])``).
    tags: tuple[str, ...] = ()
    #: The control holding it back (``"queue:emails"``), when a pause or a
    #: rate limit does: overdue, it waits for the control, not for a companion.
    held_by: str | None = None
    #: Why :attr:`held_by` holds it: ``"pause"`` or ``"rate_limit"``.
    held_reason: str | None = None

    @property
    def state(self) -> str:
        """``"parked"``, ``"held"`` (by :attr:`held_by`) or ``"in_flight"``."""
        return "in_flight" if self.in_flight else "held" if self.held_by else "parked"


@dataclass(frozen=True)
class Listing:
    """Entries of a listing, and whether more match than it shows."""

    now_ms: int
    entries: list[Any]
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
    """Return parked entries in due order, at most *limit* of them.

    *due_after_ms* and *due_before_ms* select due times in ``[after,
    before)``; *task* and *queue* are names or glob patterns
    (``proj.orders.*``). Without them each shard costs one bounded range
    read; with them, each shard reads at most *scan_limit* entries, in pages.
    With *tag*, only the entries of that tag are read, through its index.
    """
    check_limit(limit)
    numbers = selected_shards(store, shards)
    now_ms = store.time_ms()
    found: list[tuple[int, int, ParkedEntry]] = []
    more = False
    wanted = _matcher(task, queue)
    reasons = HoldReasons(store)
    for shard in numbers:
        if tag is not None:
            found += _tagged_in_shard(
                store, shard, tag, due_after_ms, due_before_ms, wanted, reasons
            )
            continue
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


def _matcher(task: str | None, queue: str | None) -> Callable[[ParkedEntry], bool] | None:
    """Return whether an entry matches the *task* and *queue* patterns; None matches all."""
    if task is None and queue is None:
        return None

    def wanted(entry: ParkedEntry) -> bool:
        return matches_patterns(entry.task, entry.queue, task, queue)

    return wanted


def _parked_in_shard(
    store: Store,
    shard: int,
    due_after_ms: int | None,
    due_before_ms: int | None,
    wanted: Callable[[ParkedEntry], bool] | None,
    limit: int,
    scan_limit: int,
    reasons: HoldReasons,
) -> tuple[list[tuple[int, int, ParkedEntry]], bool]:
    """Return up to limit + 1 matching entries of *shard*, and whether the scan was cut short."""
    matches: list[tuple[int, int, ParkedEntry]] = []
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
        entry = describe_entry(
            store,
            scanned.task_id,
            shard,
            scanned.score,
            scanned.payload,
            record=scanned.record,
            held_by=scanned.held,
            reasons=reasons,
        )
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
    wanted: Callable[[ParkedEntry], bool] | None,
) -> list[tuple[int, int, ParkedEntry]]:
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
        due_ms = due_ms_of(score)
        if due_after_ms is not None and due_ms < due_after_ms:
            continue
        if due_before_ms is not None and due_ms >= due_before_ms:
            continue
        entry = describe_entry(
            store, as_text(member), shard, score, payload, in_flight=True, record=record
        )
        if wanted is not None and not wanted(entry):
            continue
        found.append((score, shard, entry))
    return found


def describe_entry(
    store: Store,
    task_id: str,
    shard: int,
    score: int,
    payload: bytes | None,
    *,
    in_flight: bool = False,
    record: bytes | None = None,
    held_by: str | None = None,
    reasons: HoldReasons | None = None,
) -> ParkedEntry:
    """Return the entry parked (or *in_flight*, or held by *held_by*) under *task_id*.

    *reasons* says why a control holds it (the pauses, read once per listing).
    """
    headers, queue, error = describe(payload, store.templates(shard))
    marks = parse_record(as_text(record)) if record is not None else None
    return ParkedEntry(
        task_id=task_id,
        shard=shard,
        due_ms=due_ms_of(score),
        task=optional_str(headers.get("task")),
        queue=queue,
        argsrepr=optional_str(headers.get("argsrepr")),
        kwargsrepr=optional_str(headers.get("kwargsrepr")),
        expires=optional_str(headers.get("expires")),
        error=error,
        in_flight=in_flight,
        parked_ms=parked_ms(payload),
        key=marks.key if marks else None,
        tags=marks.tags if marks else (),
        held_by=held_by,
        held_reason=None if held_by is None else (reasons or HoldReasons(store))(held_by),
    )


def _tagged_in_shard(
    store: Store,
    shard: int,
    tag: str,
    due_after_ms: int | None,
    due_before_ms: int | None,
    wanted: Callable[[ParkedEntry], bool] | None,
    reasons: HoldReasons,
) -> list[tuple[int, int, ParkedEntry]]:
    """Return the entries of *shard* tagged *tag* that match, parked, held or in flight."""
    keys = store.keys(shard)
    ids = tagged_ids(store, tag, shards=[shard])
    if not ids:
        return []
    members = [task_id.encode() for task_id in ids]
    with store_errors(store.url), store.client.pipeline(transaction=False) as pipe:
        pipe.zmscore(keys.due, ids)
        pipe.hmget(keys.leased, members)
        pipe.hmget(keys.msg, members)
        scores, leased, payloads = pipe.execute()
    records = mark_records(store, shard, members)
    unseen = [i for i, s, le in zip(ids, scores, leased, strict=True) if s is None and le is None]
    held = held_scores(store, shard, unseen)
    # A held entry is parked with its due score, in its control's held set.
    scores = [held[i][1] if i in held else s for i, s in zip(ids, scores, strict=True)]
    found = []
    for member, score, lease, payload, record in zip(
        members, scores, leased, payloads, records, strict=True
    ):
        held_by = held[as_text(member)][0] if as_text(member) in held else None
        if score is None and lease is None:
            continue
        in_flight = score is None
        due_score = int(score) if score is not None else leased_score(lease)
        due_ms = due_ms_of(due_score)
        if due_after_ms is not None and due_ms < due_after_ms:
            continue
        if due_before_ms is not None and due_ms >= due_before_ms:
            continue
        # An index entry written into Redis cannot list a signed entry under
        # a tag its message does not carry (cancel and reschedule skip it too).
        if store.config.signing_keys and not signed_with_tag(
            store, shard, as_text(member), payload, tag
        ):
            continue
        entry = describe_entry(
            store,
            as_text(member),
            shard,
            due_score,
            payload,
            in_flight=in_flight,
            record=record,
            held_by=held_by,
            reasons=reasons,
        )
        if wanted is None or wanted(entry):
            found.append((due_score, shard, entry))
    return found
