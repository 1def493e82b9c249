"""How many entries each shard holds, in one round trip: parked, overdue, in flight, dead.

Every command names the keys of one shard only, so on a Redis Cluster the
pipeline is split by node; counting is ``ZCARD``/``ZCOUNT`` (O(1) or
O(log n)), plus the in-flight records (bounded by the companions' batches).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..due_score import due_ms_of, last_score_of
from .client import store_errors
from .reading import leased_due_ms, selected_shards
from .store import Store

__all__ = ["Counts", "ShardCounts", "counts"]


@dataclass(frozen=True)
class ShardCounts:
    """How many entries one shard holds, and when the next is due."""

    shard: int
    #: Entries waiting in the due set, overdue ones included.
    parked: int
    #: Entries whose due time has passed: waiting in the due set, or claimed
    #: by a companion and not yet acknowledged (in flight is late too: a
    #: broker outage keeps entries cycling between the two).
    overdue: int
    #: Age of the oldest overdue entry in ms, or None when nothing is overdue.
    oldest_overdue_age_ms: int | None
    #: Entries claimed by a companion and not yet acknowledged.
    in_flight: int
    #: Dead-lettered entries.
    dead: int
    #: Due ms of the earliest entry that is not due yet, if any.
    next_due_ms: int | None
    #: How many of :attr:`overdue` are in flight.
    overdue_in_flight: int = 0


@dataclass(frozen=True)
class Counts:
    """The counts of every shard, read at :attr:`now_ms` on the Redis clock."""

    now_ms: int
    shards: list[ShardCounts]

    @property
    def parked(self) -> int:
        return sum(s.parked for s in self.shards)

    @property
    def overdue(self) -> int:
        return sum(s.overdue for s in self.shards)

    @property
    def in_flight(self) -> int:
        return sum(s.in_flight for s in self.shards)

    @property
    def overdue_in_flight(self) -> int:
        return sum(s.overdue_in_flight for s in self.shards)

    @property
    def dead(self) -> int:
        return sum(s.dead for s in self.shards)

    @property
    def oldest_overdue_age_ms(self) -> int | None:
        ages = [s.oldest_overdue_age_ms for s in self.shards if s.oldest_overdue_age_ms is not None]
        return max(ages) if ages else None

    @property
    def next_due_ms(self) -> int | None:
        dues = [s.next_due_ms for s in self.shards if s.next_due_ms is not None]
        return min(dues) if dues else None


def counts(store: Store, shards: Iterable[int] | None = None) -> Counts:
    """Count the entries of *shards* (default: all) in one round trip.

    Each command reads one key, so on a Redis Cluster the pipeline is split
    by node and still never crosses a slot. The counts of a shard are read
    back to back but not in one transaction: under load they can be a few
    entries apart, never more than what moved meanwhile.
    """
    numbers = selected_shards(store, shards)
    now_ms = store.time_ms()
    # An entry is overdue when claim.lua would take it now: score below (now + 1 ms) * 1024.
    due_now = last_score_of(now_ms)
    with store_errors(store.url), store.client.pipeline(transaction=False) as pipe:
        for shard in numbers:
            keys = store.keys(shard)
            pipe.zcard(keys.due)
            pipe.zcount(keys.due, "-inf", due_now)
            pipe.zrange(keys.due, 0, 0, withscores=True)
            pipe.zrangebyscore(keys.due, f"({due_now}", "+inf", start=0, num=1, withscores=True)
            pipe.zcard(keys.lease)
            pipe.zcard(keys.dead)
            # In flight is bounded by the companions' batches: reading it whole is cheap.
            pipe.hvals(keys.leased)
        replies = pipe.execute()
    result = []
    for index, shard in enumerate(numbers):
        parked, overdue, head, upcoming, in_flight, dead, leased = replies[
            7 * index : 7 * index + 7
        ]
        # Read a moment after ZCARD: never report more overdue than parked.
        waiting_late = min(int(overdue), int(parked))
        ages = [now_ms - due_ms_of(head[0][1])] if waiting_late and head else []
        flying_late = [now_ms - due for due in map(leased_due_ms, leased) if due <= now_ms]
        ages += flying_late
        result.append(
            ShardCounts(
                shard=shard,
                parked=int(parked),
                overdue=waiting_late + len(flying_late),
                oldest_overdue_age_ms=max(*ages, 0) if ages else None,
                in_flight=int(in_flight),
                dead=int(dead),
                next_due_ms=due_ms_of(upcoming[0][1]) if upcoming else None,
                overdue_in_flight=len(flying_late),
            )
        )
    return Counts(now_ms=now_ms, shards=result)
