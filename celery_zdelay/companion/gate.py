"""The gate: which released entries a rate limit or a pause holds back, and when they go.

Every parked task leaves through a companion, so this is where a limit can
hold for the whole deployment. The companion asks the gate about each entry
it claimed; an entry of a paused or rate-limited queue or task is held: moved
from the lease into a held set of its control (``hold.lua``), parked in
Redis in due order, never in a companion's memory. Each pass then releases
held entries: none while paused; under a limit, as many as the tokens taken
from the limit's bucket allow (one bucket for all companions and shards).

A ``limit_key:<glob>`` limit holds each distinct limit key (the task's
``zdelay_limit_key`` header) in a lane of its own, ``limit_key:<key>``, with
a bucket of its own; the release pass drains those lanes in turns (see
:mod:`.release`), so a key with a large backlog delays the others by at
most one turn. A pause, or a queue's or task's limit, holds an entry with
a limit key in a lane of that key under it (:func:`~..store.control.fair_lane`):
on resume, or under the limit's one bucket, the keys are served in turns
the same way.

A concurrency control (``zdelay_concurrency``) holds an entry when its
slots are all taken: the companion takes a slot for each entry it is about
to publish (``take_slots.lua``, one record for all companions), holds the
entries it got none for in the lane of the slot name, and drains that lane
as slots free (it looks every :data:`REFRESH_SECONDS` while anything is
held).

With no limit, pause or concurrency control configured and nothing held,
the gate costs one read of two small hashes every :data:`REFRESH_SECONDS`
and nothing per entry: :attr:`Gate.active` is False and the companion
skips it.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Iterable
from typing import Any

from ..concurrency import control_of_slot, effective_concurrency, slots_of
from ..entry import TaskMessage
from ..rates import LIMIT_KEY, RateLimit, key_control, key_lane
from ..redis_layout import RedisLayout
from ..store import Store
from ..store.control import (
    ControlStore,
    fair_lane,
    is_key_lane,
    lane_base,
    lane_control,
    lane_group,
    pause_lane,
)
from ..store.headers import LIMIT_KEY_HEADER

__all__ = [
    "ALL_LIMITS",
    "MIN_THROTTLE_SECONDS",
    "REFRESH_SECONDS",
    "Gate",
    "queue_of",
]

logger = logging.getLogger(__name__)

#: Seconds between reads of the limits and pauses: a pause, resume or limit
#: change reaches every companion within this (plus the batch in hand).
REFRESH_SECONDS = 0.5
#: Shortest sleep of a companion held back by a rate limit: it sleeps until
#: the next token, but wakes for a few at a time rather than for each one.
MIN_THROTTLE_SECONDS = 0.01
#: What :meth:`Gate.lane_of` is told an entry passed when it waited for a
#: concurrency slot: it had passed every rate limit before it waited.
ALL_LIMITS = "|all limits"


def queue_of(message: TaskMessage) -> str:
    """Return the Celery queue *message* goes to (the one its producer declared)."""
    if message.declare:
        return str(message.declare[0])
    return message.routing_key


class Gate:
    """The limits and pauses one companion applies, read from the settings and the store."""

    def __init__(self, store: Store) -> None:
        self.control = ControlStore(store)
        self.config_limits: dict[str, RateLimit] = dict(store.config.rate_limits)
        #: Effective limits: the settings, overridden by those set at run time.
        self.limits: dict[str, RateLimit] = dict(self.config_limits)
        #: Paused names -> since ms.
        self.paused: dict[str, int] = {}
        #: Per shard, the lanes with a held set there (see :func:`pause_lane`).
        self.lanes: dict[int, set[str]] = {}
        self._read_at: float | None = None
        self._logged: dict[str, str] = {}
        self._held_dests: tuple[Any, list[str]] | None = None
        self.config_concurrency: dict[str, int] = dict(store.config.concurrency)
        #: Effective concurrency: ``zdelay_concurrency``, overridden by what
        #: was set at run time (:func:`celery_zdelay.set_concurrency`):
        #: control name -> most released and not finished.
        self.concurrency: dict[str, int] = dict(self.config_concurrency)

    @property
    def active(self) -> bool:
        """Whether a limit, pause or concurrency control applies: each claimed entry is checked."""
        return bool(self.limits or self.paused or self.concurrency)

    @property
    def by_task(self) -> bool:
        """Whether a task name or a limit key is limited or paused, or a concurrency control is set.

        The handoff (handoff.lua) reads an entry's destination list only, not
        its headers: it can tell neither tasks nor limit keys apart, and it
        cannot take a concurrency slot before it pushes (the slots are not in
        the shard's slot on a Cluster): then every entry is leased and asked
        about here.
        """
        return bool(self.concurrency) or any(
            name.startswith(("task:", f"{LIMIT_KEY}:")) for name in (*self.limits, *self.paused)
        )

    def slots_for(self, message: TaskMessage) -> list[tuple[str, int]]:
        """Return the concurrency slots *message* needs before it is published: (slot, most)."""
        if not self.concurrency:
            return []
        return slots_of(
            self.concurrency,
            task=message.task_name,
            queue=queue_of(message),
            limit_key=message.headers.get(LIMIT_KEY_HEADER),
        )

    def held_dests(self, layout: RedisLayout) -> list[str]:
        """Return the Redis broker lists of the limited and paused queues, every priority."""
        key = (id(layout), frozenset(self.limits), frozenset(self.paused))
        if self._held_dests is not None and self._held_dests[0] == key:
            return self._held_dests[1]
        # Every priority a message may have (kombu's are 0-9), mapped to its step.
        dests = sorted(
            {
                layout.list_key(name[len("queue:") :], priority)
                for name in (*self.limits, *self.paused)
                if name.startswith("queue:")
                for priority in (None, *range(10))
            }
        )
        self._held_dests = (key, dests)
        return dests

    @property
    def watching(self) -> bool:
        """Whether something is limited, paused or held: the companion wakes to refresh."""
        return self.active or any(self.lanes.values())

    def refresh(self, shards: Iterable[int], *, force: bool = False) -> None:
        """Read the limits, pauses and held sets again if :data:`REFRESH_SECONDS` passed."""
        now = time.monotonic()
        if not force and self._read_at is not None and now - self._read_at < REFRESH_SECONDS:
            return
        state = self.control.read()
        limits = dict(self.config_limits)
        for name, limit in state.limits.items():
            if limit is None:
                limits.pop(name, None)
            else:
                limits[name] = limit
        self.limits = limits
        self.paused = state.paused
        self.concurrency = effective_concurrency(
            self.config_concurrency, state.concurrency, now_ms=state.now_ms
        )
        self.lanes = self.control.lanes(shards)
        self._read_at = now
        self._log_changes()

    def slot_limit(self, slot: str) -> int | None:
        """Return the most live slots of *slot* (a slot name), None if its control is gone."""
        return self.concurrency.get(control_of_slot(slot))

    def lane_of(self, message: TaskMessage, *, passed: str | None = None) -> str | None:
        """Return the lane that holds *message* back, or None to release it.

        A pause of its task or queue holds it, in the pause's own lane. So
        do the limits of its queue, then of its task, each in the lane named
        by it, but those before *passed* and *passed* itself: the limit
        whose tokens it was released under, so that an entry under both
        waits for both, once each. An entry drained from a held set without
        tokens (a pause resumed, a limit removed) passed none: it waits for
        every limit that applies now, as if it had just fallen due. A pause
        and a limit of one control hold in two sets, so on resume what the
        pause held is not taken for what the limit held (which passed the
        limits before it). An entry with a limit key waits in the lane of
        its key under the pause or limit (:func:`fair_lane`); *passed* names
        the control's own lane.
        """
        limit_key = message.headers.get(LIMIT_KEY_HEADER)
        lane = self._held_by(message, limit_key, passed)
        return None if lane is None else fair_lane(lane, limit_key)

    def _held_by(self, message: TaskMessage, limit_key: Any, passed: str | None) -> str | None:
        queue = f"queue:{queue_of(message)}"
        task = f"task:{message.task_name}"
        if task in self.paused:
            return pause_lane(task)
        if queue in self.paused:
            return pause_lane(queue)
        order: tuple[str, ...] = (queue, task)
        if isinstance(limit_key, str):
            paused_by = key_control(limit_key, self.paused)
            if paused_by is not None:
                return pause_lane(paused_by)
            # Last: what a queue or task limit lets through meets the key's
            # bucket next, in the same pass.
            order = (queue, task, key_lane(limit_key))
        start = (
            len(order)
            if passed == ALL_LIMITS
            else order.index(passed) + 1
            if passed in order
            else 0
        )
        for name in order[start:]:
            if self.limit_of(name) is not None:
                return name
        return None

    def limit_of(self, lane: str) -> RateLimit | None:
        """Return the limit *lane*'s entries are released under, or None.

        A per-key lane (``limit_key:<key>``) is under the first
        ``limit_key:<glob>`` limit matching its key; each key has a bucket
        of its own, named by the lane. A key's lane under a queue's or
        task's limit is under that limit, and takes from its bucket
        (:meth:`bucket_of`).
        """
        if not is_key_lane(lane):
            return self.limits.get(lane_base(lane))
        control = key_control(lane[len(LIMIT_KEY) + 1 :], self.limits)
        return None if control is None else self.limits[control]

    @staticmethod
    def bucket_of(lane: str) -> str:
        """Return the bucket *lane*'s entries take tokens from: its own for a
        key's lane, else its control's, shared by the lanes of every key under it."""
        return lane_base(lane)

    def control_of(self, lane: str) -> str:
        """Return the control *lane* counts under: for a per-key lane, its glob."""
        return lane_group(lane, (*self.limits, *self.paused, *self.concurrency))

    def is_paused(self, lane: str) -> bool:
        """Whether a pause stops *lane* (a per-key lane: a paused glob matching its key)."""
        control = lane_control(lane)
        if control in self.paused:
            return True
        return is_key_lane(control) and (
            key_control(control[len(LIMIT_KEY) + 1 :], self.paused) is not None
        )

    def releasable(self, shards: Iterable[int]) -> dict[str, list[int]]:
        """Return the lanes that may hold entries on *shards* and whose control is not paused.

        For each, the shards to look at: all of them for a limit (another
        companion may have held entries on a shard since the lanes were
        read, and due order across shards needs them all), else those with
        a held set of it (a removed limit or a resumed pause, to drain).
        A ``limit_key:<glob>`` limit has no lane of its own: each key it
        holds has one (``limit_key:<key>``), found in the lanes sets, and
        looked for on every shard as a limit's; so are the lanes of the
        keys a queue's or task's limit holds.

        In the order entries flow between them: held sets to drain first,
        then queue limits, then task limits, then per-key limits, so that
        what one of them moves to the next is released in the same pass, as
        the next allows.
        """
        shard_list = list(shards)
        found: dict[str, list[int]] = {}
        for name in self.limits:
            if not is_key_lane(name):
                found[name] = shard_list
        for shard in shard_list:
            for name in self.lanes.get(shard, ()):
                per_key = is_key_lane(name) or lane_base(name) != name
                if per_key and self.limit_of(name) is not None:
                    found[name] = shard_list
                elif name not in self.limits:
                    found.setdefault(name, []).append(shard)
        return {
            name: found[name]
            for name in sorted(found, key=self._flow_rank)
            if not self.is_paused(name)
        }

    def _flow_rank(self, name: str) -> tuple[int, str]:
        if self.limit_of(name) is None:
            return (0, name)
        if is_key_lane(name):
            return (3, name)
        return (1 if name.startswith("queue:") else 2, name)

    def first_held(self, name: str, shards: Iterable[int], count: int) -> list[int]:
        """Return the shard of each of the first *count* entries *name* holds, in due order.

        Entries go out in due order across shards: a backlog on one shard does
        not overtake older entries held on another.
        """
        shard_list = list(shards)
        peeked = self.control.peek_shards(shard_list, name, count)
        scores = [
            [(score, shard) for score in found]
            for shard, found in zip(shard_list, peeked, strict=True)
        ]
        return [shard for _, shard in _first(scores, count)]

    def _log_changes(self) -> None:
        now = {f"limit {n}": lim.text for n, lim in self.limits.items()}
        now.update({f"pause {n}": str(since) for n, since in self.paused.items()})
        now.update({f"concurrency {n}": str(most) for n, most in self.concurrency.items()})
        for key in now.keys() - self._logged.keys():
            logger.info("Release control on: %s %s", key, now[key])
        for key in self._logged.keys() - now.keys():
            logger.info("Release control off: %s", key)
        self._logged = now


def _first(scores: list[list[tuple[int, int]]], count: int) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for item in heapq.merge(*scores):
        if len(merged) >= count:
            break
        merged.append(item)
    return merged
