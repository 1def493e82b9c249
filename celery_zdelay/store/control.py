"""The store's side of release control: rate limits, pauses, held entries, token buckets.

Where each piece lives, and why:

- limits set at run time and pauses: two hashes under one hash tag
  (:func:`~.redis_keys.control_keys`), read by every companion every
  :data:`~celery_zdelay.companion.gate.REFRESH_SECONDS`;
- a token bucket per limit, a hash tag of its own (``take_tokens.lua``): it
  is never touched in the same script as a shard, so it works on a Redis
  Cluster whatever node the shards are on;
- concurrency slots (``zdelay_concurrency``): per control, or per limit
  key of a ``limit_key:`` control, a sorted set of the task ids released
  and not finished, scored by when each slot ends by itself, a hash tag of
  its own (``take_slots.lua``), as the buckets; a worker frees a task's slot
  when its run ends (:func:`free_slots`);
- held entries: per shard and lane, a sorted set in the shard's slot
  (``hold.lua``), scored like the due set, released by ``claim.lua`` run
  on that set instead of the due set. A lane is a control's: a rate limit
  holds in the set named by the control (``task:proj.send``), a pause in a
  set of its own (:func:`pause_lane`), so that on resume what the pause
  held meets every limit, while what the limit held has passed the limits
  before it (see :meth:`~celery_zdelay.companion.gate.Gate.lane_of`). A
  ``limit_key:<glob>`` limit holds each limit key in a lane of its own,
  ``limit_key:<key>``, with a bucket of its own named by the lane. A
  concurrency control holds in a lane per slot name
  (:func:`concurrency_lane`): one tenant's full slots never stand in front
  of another tenant's entries. A pause, or a queue's or task's limit, holds
  an entry that has a limit key in a lane of that key under it
  (:func:`fair_lane`, ``"queue:emails tenant:42"``): the release pass
  drains a control's lanes in turns, so one tenant's backlog never stands
  in front of another's either, and they share the control's one bucket.

Per-key state does not outlive its use: a bucket expires once it would be
full again (``take_tokens.lua``), a held set is deleted by Redis when its
last entry leaves, and its name leaves the lanes set when a companion finds
it empty (``forget_lane.lua``). Totals (:func:`lane_group`) count per-key
lanes under their glob, so what a listing of controls or a metric shows is
bounded by the number of limits, not of keys.

Like :class:`~.store.Store`, this decides nothing: the companion's gate does.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigurationError
from ..rates import LIMIT_KEY, RateLimit, key_control, parse_limit
from .client import store_errors
from .redis_keys import control_keys, held_set_key, lanes_key
from .store import ClaimResult, Store, claim_result

__all__ = [
    "CONCURRENCY_LANE",
    "PAUSE_LANE",
    "REMOVED",
    "UNMATCHED_KEYS",
    "ControlState",
    "ControlStore",
    "HoldReasons",
    "concurrency_lane",
    "fair_lane",
    "free_slots",
    "hold_reason",
    "is_key_lane",
    "lane_base",
    "lane_control",
    "lane_group",
    "pause_lane",
    "slot_of_lane",
]

#: What a limit set at run time to ``None`` stores when the settings define
#: one: "removed", overriding the setting.
REMOVED = "off"
#: The prefix of a pause's lane: no control name starts with it.
PAUSE_LANE = "pause|"
#: The prefix of a concurrency control's lanes: no control name starts with it.
CONCURRENCY_LANE = "concurrency|"


def pause_lane(control: str) -> str:
    """Return the lane in which a pause of *control* holds entries."""
    return PAUSE_LANE + control


def concurrency_lane(slot: str) -> str:
    """Return the lane in which entries wait for a free slot of *slot* (a slot name)."""
    return CONCURRENCY_LANE + slot


def slot_of_lane(lane: str) -> str | None:
    """Return the slot name a concurrency lane waits for, None for other lanes."""
    return lane[len(CONCURRENCY_LANE) :] if lane.startswith(CONCURRENCY_LANE) else None


def fair_lane(lane: str, limit_key: object) -> str:
    """Return the lane an entry with *limit_key* waits in where *lane* holds it.

    A pause's lane or a queue's or task's limit's holds each limit key in a
    lane of its own under it, ``"<lane> <limit key>"`` (control names hold no
    whitespace, so the first space splits them): the release pass serves a
    control's lanes in turns (fairness between tenants) from its one bucket.
    A key's own lane and a concurrency slot's are per key already; an entry
    without a limit key waits in *lane* itself.
    """
    if not isinstance(limit_key, str) or _per_key(lane):
        return lane
    return f"{lane} {limit_key}"


def lane_base(lane: str) -> str:
    """Return the lane whose turns *lane* is served in: of a :func:`fair_lane`, the control's.

    Also the name of the bucket the lane's entries take tokens from. Any
    other lane (a key's, a concurrency slot's, a control's own) is its own
    base: their names may hold spaces, which split nothing there.
    """
    return lane if _per_key(lane) else lane.split(" ", 1)[0]


def _per_key(lane: str) -> bool:
    """Whether *lane* is one key's already: a per-key limit's, or a concurrency slot's."""
    return is_key_lane(lane) or lane.startswith(CONCURRENCY_LANE)


def lane_control(lane: str) -> str:
    """Return the control whose pause, rate limit or concurrency holds the entries of *lane*.

    For a per-key lane, the lane itself (``limit_key:tenant:42``): which
    key's limit holds them (:func:`lane_group` gives the glob). For a lane
    of one limit key under a pause or a queue's or task's limit
    (:func:`fair_lane`), that control.
    """
    if lane.startswith(CONCURRENCY_LANE):
        # A slot name is the control, then a space and a limit key for a glob.
        return lane[len(CONCURRENCY_LANE) :].split(" ", 1)[0]
    lane = lane_base(lane)
    if lane.startswith(PAUSE_LANE):
        return lane[len(PAUSE_LANE) :]
    return lane


def is_key_lane(lane: str) -> bool:
    """Whether *lane* (or control name) is a limit key's: ``limit_key:...``."""
    return lane.startswith(f"{LIMIT_KEY}:")


#: What per-key lanes count under when no limit or pause of *names* matches
#: their key any more (a limit removed, its held sets drained).
UNMATCHED_KEYS = f"{LIMIT_KEY}:*"


def lane_group(lane: str, names: Iterable[str]) -> str:
    """Return the control *lane* counts under in totals, of the control *names*.

    Its own control, but for a per-key lane: the first ``limit_key:<glob>``
    of *names* that matches its key, or :data:`UNMATCHED_KEYS`. A million
    keys held count under as many names as there are globs.
    """
    control = lane_control(lane)
    names = list(names)
    if not is_key_lane(control) or control in names:
        return control
    return key_control(control[len(LIMIT_KEY) + 1 :], names) or UNMATCHED_KEYS


@dataclass(frozen=True)
class ControlState:
    """What the store says about control, as read in one round trip."""

    #: Limits set at run time: name -> limit, or None where removed.
    limits: dict[str, RateLimit | None]
    #: Paused names -> ms (Redis clock) paused since.
    paused: dict[str, int]
    #: Concurrency set at run time: name -> (most, or None where removed;
    #: the Redis ms the name was first set at run time).
    concurrency: dict[str, tuple[int | None, int]] = field(default_factory=dict)
    #: The Redis clock when this was read, in ms.
    now_ms: int = 0


class ControlStore:
    """Release control in the Redis store of *store*."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.prefix = store.config.key_prefix
        self.keys = control_keys(self.prefix)
        # Loaded with the store's other scripts (store/scripts.py).
        self._take = store.scripts.take_tokens
        self._hold = store.scripts.hold
        self._forget = store.scripts.forget_lane

    # -- limits and pauses ------------------------------------------------------

    def read(self) -> ControlState:
        """Return the limits and concurrency set at run time, the pauses, and the Redis clock."""
        with store_errors(self.store.url):
            if self.store.cluster:
                raw_limits = self.store.client.hgetall(self.keys.limits)
                raw_paused = self.store.client.hgetall(self.keys.paused)
                raw_concurrency = self.store.client.hgetall(self.keys.concurrency)
                now_ms = self.store.time_ms()
            else:
                with self.store.client.pipeline(transaction=False) as pipe:
                    pipe.hgetall(self.keys.limits)
                    pipe.hgetall(self.keys.paused)
                    pipe.hgetall(self.keys.concurrency)
                    pipe.time()
                    raw_limits, raw_paused, raw_concurrency, (seconds, micros) = pipe.execute()
                now_ms = int(seconds) * 1000 + int(micros) // 1000
        limits: dict[str, RateLimit | None] = {}
        for name, value in raw_limits.items():
            limits[_text(name)] = _stored_limit(_text(name), _text(value))
        paused = {_text(name): int(since) for name, since in raw_paused.items()}
        concurrency = {
            _text(name): _stored_concurrency(_text(name), _text(value))
            for name, value in raw_concurrency.items()
        }
        return ControlState(limits=limits, paused=paused, concurrency=concurrency, now_ms=now_ms)

    def concurrency_names(self) -> set[str]:
        """Return every control name concurrency was ever set for at run time (one HKEYS).

        What a worker frees slots of, beside the settings' names: a name
        stays in the hash once set (``"most": null`` once removed), so the
        slots of tasks released under it are freed even after its removal.
        """
        with store_errors(self.store.url):
            return {_text(name) for name in self.store.client.hkeys(self.keys.concurrency)}

    def set_concurrency(self, name: str, most: int | None) -> None:
        """Store *most* for *name*; None removes it (``"most": null``).

        Removed or not, the name stays in the hash (see
        :meth:`concurrency_names`), with the Redis ms it was first set: the
        time from which workers may not know it yet
        (:data:`~celery_zdelay.concurrency.CONCURRENCY_SETTLE_MS`).
        """
        with store_errors(self.store.url):
            before = self.store.client.hget(self.keys.concurrency, name)
        first_ms = (
            _stored_concurrency(name, _text(before))[1]
            if before is not None
            else self.store.time_ms()
        )
        value = json.dumps({"most": most, "at": first_ms}, separators=(",", ":"))
        with store_errors(self.store.url):
            self.store.client.hset(self.keys.concurrency, name, value)
        self.wake()

    def set_limit(self, name: str, limit: RateLimit | None, *, tombstone: bool) -> None:
        """Store *limit* for *name*; None removes it (as :data:`REMOVED` if *tombstone*)."""
        with store_errors(self.store.url):
            if limit is not None:
                value = json.dumps(limit.as_json(), separators=(",", ":"))
                self.store.client.hset(self.keys.limits, name, value)
            elif tombstone:
                self.store.client.hset(self.keys.limits, name, REMOVED)
            else:
                self.store.client.hdel(self.keys.limits, name)
        self.wake()

    def pause(self, name: str) -> int:
        """Pause *name*; return since when (ms), the earlier time if it already was."""
        now_ms = self.store.time_ms()
        with store_errors(self.store.url):
            self.store.client.hsetnx(self.keys.paused, name, now_ms)
            since = self.store.client.hget(self.keys.paused, name)
        return int(since) if since is not None else now_ms

    def resume(self, name: str) -> bool:
        """Resume *name*; return whether it was paused."""
        with store_errors(self.store.url):
            removed = int(self.store.client.hdel(self.keys.paused, name))
        self.wake()
        return bool(removed)

    def wake(self) -> None:
        """Wake sleeping companions, so a resume or a new limit applies at once."""
        with store_errors(self.store.url):
            for shard in self.store.shards:
                self.store.client.publish(self.store.keys(shard).wake, "control")

    # -- token buckets ----------------------------------------------------------

    def take_tokens(self, name: str, limit: RateLimit, wanted: int) -> tuple[int, int]:
        """Take up to *wanted* tokens of *name*'s bucket: (granted, ms until the next one)."""
        with store_errors(self.store.url):
            granted, wait_ms = self._take(
                keys=[self.keys.bucket(self.prefix, name)],
                args=[_per_ms(limit), limit.burst, wanted, 0],
                client=self.store.client,
            )
        return int(granted), int(wait_ms)

    def give_back(self, name: str, limit: RateLimit, unused: int) -> None:
        """Return *unused* tokens to *name*'s bucket (capped at its burst)."""
        if unused <= 0:
            return
        with store_errors(self.store.url):
            self._take(
                keys=[self.keys.bucket(self.prefix, name)],
                args=[_per_ms(limit), limit.burst, 0, unused],
                client=self.store.client,
            )

    # -- concurrency slots ------------------------------------------------------

    def take_slots(
        self, slot: str, limit: int, task_ids: Sequence[str], *, max_run_ms: int
    ) -> list[str]:
        """Take a slot of *slot* for each of *task_ids* while fewer than *limit* are live.

        Returns the ids granted, in order. An id that took a live slot
        already keeps it (its end moved *max_run_ms* on). A slot no worker
        frees ends by itself *max_run_ms* after it was taken.
        """
        if not task_ids:
            return []
        with store_errors(self.store.url):
            granted = self.store.scripts.take_slots(
                keys=[self.keys.slots(self.prefix, slot)],
                args=[limit, max_run_ms, *task_ids],
                client=self.store.client,
            )
            control, _, limit_key = slot.partition(" ")
            if granted and limit_key:
                # For controls(): which keys of a glob have slots (bounded below).
                index = self.keys.slot_keys(self.prefix, control)
                now_ms = self.store.time_ms()
                with self.store.client.pipeline(transaction=False) as pipe:
                    pipe.zremrangebyscore(index, "-inf", now_ms)
                    pipe.zadd(index, {limit_key: now_ms + max_run_ms})
                    pipe.pexpire(index, max_run_ms)
                    pipe.execute()
        return [_text(task_id) for task_id in granted]

    def free_slots(self, slot: str, task_ids: Sequence[str]) -> None:
        """Free the slots of *task_ids* in *slot* (those they did not take: nothing)."""
        free_slots(self.store, [slot], task_ids)

    def live_slots(self, slot: str, now_ms: int | None = None) -> int:
        """Return how many slots of *slot* are taken and have not ended."""
        if now_ms is None:
            now_ms = self.store.time_ms()
        with store_errors(self.store.url):
            return int(
                self.store.client.zcount(self.keys.slots(self.prefix, slot), f"({now_ms}", "+inf")
            )

    def running(self, control: str, *, keys_at_most: int = 1000) -> tuple[int, int, bool]:
        """Return the live slots of *control*: (count, distinct limit keys, whether cut short).

        For a ``limit_key:`` control, summed over the first *keys_at_most*
        limit keys with a live slot (the listing's bound); for another, its
        one count (and 0 keys).
        """
        now_ms = self.store.time_ms()
        if not control.startswith("limit_key:"):
            return self.live_slots(control, now_ms), 0, False
        with store_errors(self.store.url):
            keys = self.store.client.zrangebyscore(
                self.keys.slot_keys(self.prefix, control),
                f"({now_ms}",
                "+inf",
                start=0,
                num=keys_at_most + 1,
            )
        cut = len(keys) > keys_at_most
        records = [
            self.keys.slots(self.prefix, f"{control} {_text(k)}") for k in keys[:keys_at_most]
        ]
        with store_errors(self.store.url):
            if self.store.cluster:
                counts = [self.store.client.zcount(r, f"({now_ms}", "+inf") for r in records]
            else:
                with self.store.client.pipeline(transaction=False) as pipe:
                    for record in records:
                        pipe.zcount(record, f"({now_ms}", "+inf")
                    counts = pipe.execute()
        return sum(int(c) for c in counts), sum(1 for c in counts if int(c)), cut

    # -- held entries -----------------------------------------------------------

    def hold(self, shard: int, token: int, name: str, task_ids: Sequence[str]) -> int:
        """Move claimed entries into *name*'s held set on *shard*; return how many."""
        if not task_ids:
            return 0
        keys = self.store.keys(shard)
        # Their history says held, and why (hold.lua knows a pause's lane).
        history = self.store.history_args(shard)
        with store_errors(self.store.url):
            return int(
                self._hold(
                    keys=[
                        keys.lease,
                        keys.leased,
                        held_set_key(self.prefix, shard, name),
                        lanes_key(self.prefix, shard),
                        *history.keys,
                    ],
                    args=[token, name, *task_ids, *history.args],
                    client=self.store.client,
                )
            )

    def lanes(self, shards: Iterable[int]) -> dict[int, set[str]]:
        """Return, per shard, the names of the controls with held entries there."""
        shard_list = list(shards)
        with store_errors(self.store.url):
            if self.store.cluster:
                replies = [
                    self.store.client.smembers(lanes_key(self.prefix, s)) for s in shard_list
                ]
            else:
                with self.store.client.pipeline(transaction=False) as pipe:
                    for shard in shard_list:
                        pipe.smembers(lanes_key(self.prefix, shard))
                    replies = pipe.execute()
        return {
            shard: {_text(name) for name in reply}
            for shard, reply in zip(shard_list, replies, strict=True)
            if reply
        }

    def peek(self, shard: int, name: str, count: int) -> list[int]:
        """Return the due scores of the first *count* entries held by *name* on *shard*."""
        with store_errors(self.store.url):
            reply: Any = self.store.client.zrange(
                held_set_key(self.prefix, shard, name), 0, count - 1, withscores=True
            )
        return [int(score) for _, score in reply]

    def peek_shards(self, shards: Sequence[int], name: str, count: int) -> list[list[int]]:
        """:meth:`peek` on each of *shards*, in one round trip (one per shard on a Cluster).

        A per-key limit peeks every shard for each key with tasks held, every
        pass: one round trip per key rather than per key and shard.
        """
        if self.store.cluster:
            return [self.peek(shard, name, count) for shard in shards]
        with store_errors(self.store.url), self.store.client.pipeline(transaction=False) as pipe:
            for shard in shards:
                pipe.zrange(held_set_key(self.prefix, shard, name), 0, count - 1, withscores=True)
            replies: list[Any] = pipe.execute()
        return [[int(score) for _, score in reply] for reply in replies]

    def held_count(self, shard: int, name: str) -> int:
        """Return how many entries *name* holds on *shard*."""
        with store_errors(self.store.url):
            return int(self.store.client.zcard(held_set_key(self.prefix, shard, name)))

    def held_counts(self, shard: int, names: Iterable[str]) -> dict[str, int]:
        """Return how many entries each of *names* holds on *shard*, in one round trip.

        (On a Redis Cluster, one call per name: the held sets of a shard
        share its slot, but redis-py's cluster pipeline is not used here.)
        """
        name_list = list(names)
        with store_errors(self.store.url):
            if self.store.cluster:
                counts = [
                    self.store.client.zcard(held_set_key(self.prefix, shard, n)) for n in name_list
                ]
            else:
                with self.store.client.pipeline(transaction=False) as pipe:
                    for name in name_list:
                        pipe.zcard(held_set_key(self.prefix, shard, name))
                    counts = pipe.execute()
        return {name: int(count) for name, count in zip(name_list, counts, strict=True)}

    def claim_held(self, shard: int, name: str, *, limit: int, lease_ms: int) -> ClaimResult:
        """Lease up to *limit* of the entries *name* holds on *shard*, in due order.

        claim.lua, run on the held set instead of the due set: a companion
        that dies after this call loses nothing, its lease expires and the
        entries are due again (then held again if the control still holds).
        """
        keys = self.store.keys(shard)
        with store_errors(self.store.url):
            reply = self.store.scripts.claim(
                keys=[
                    held_set_key(self.prefix, shard, name),
                    keys.msg,
                    keys.lease,
                    keys.leased,
                    keys.tags,
                ],
                args=[lease_ms, limit, 0],
                client=self.store.client,
            )
        return claim_result(reply, offset=4)

    def forget_lane(self, shard: int, name: str) -> bool:
        """Forget *name*'s held set on *shard* if it is empty; return whether it was."""
        with store_errors(self.store.url):
            return bool(
                self._forget(
                    keys=[held_set_key(self.prefix, shard, name), lanes_key(self.prefix, shard)],
                    args=[name],
                    client=self.store.client,
                )
            )


def free_slots(store: Store, slots: Sequence[str], task_ids: Sequence[str]) -> None:
    """Free the concurrency slots of *task_ids* in each of *slots* (slot names).

    One ZREM per slot record (each its own hash tag, so no script spans
    them); Redis deletes a record with its last member. Freeing a slot a
    task did not take changes nothing.
    """
    if not slots or not task_ids:
        return
    keys = control_keys(store.config.key_prefix)
    with store_errors(store.url):
        if store.cluster:
            for slot in slots:
                store.client.zrem(keys.slots(store.config.key_prefix, slot), *task_ids)
            return
        with store.client.pipeline(transaction=False) as pipe:
            for slot in slots:
                pipe.zrem(keys.slots(store.config.key_prefix, slot), *task_ids)
            pipe.execute()


def hold_reason(lane: str, paused: Collection[str]) -> str:
    """Return why *lane* holds entries: ``"pause"``, ``"rate_limit"`` or ``"concurrency"``.

    A pause's lane holds by pause until it is drained; a limit's or a
    concurrency control's, by pause while its control is paused too
    (nothing of it leaves then; for a per-key lane, a paused
    ``limit_key:<glob>`` matching its key), else by rate limit or
    concurrency. A held set outlives its control (a removed limit is
    drained under no limit, a resumed pause at once).
    """
    if lane.startswith(PAUSE_LANE) or lane_control(lane) in paused:
        return "pause"
    if is_key_lane(lane) and key_control(lane[len(LIMIT_KEY) + 1 :], paused) is not None:
        return "pause"
    return "concurrency" if lane.startswith(CONCURRENCY_LANE) else "rate_limit"


class HoldReasons:
    """:func:`hold_reason` for the listings: the pauses are read once, when first asked."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._paused: set[str] | None = None

    def __call__(self, name: str) -> str:
        if self._paused is None:
            self._paused = set(ControlStore(self._store).read().paused)
        return hold_reason(name, self._paused)


def _per_ms(limit: RateLimit) -> str:
    return repr(limit.count / limit.period_ms)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _stored_concurrency(name: str, value: str) -> tuple[int | None, int]:
    """(most or None when removed, Redis ms first set) of a concurrency set at run time."""
    try:
        data = json.loads(value)
        most, at = data["most"], data["at"]
        if most is not None and (isinstance(most, bool) or not isinstance(most, int) or most < 1):
            raise ValueError(most)
        if isinstance(at, bool) or not isinstance(at, int):
            raise ValueError(at)
        return most, at
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigurationError(
            f"The concurrency of {name} stored in Redis is {value[:80]!r}, not a number "
            f"celery-zdelay wrote. Set it again: celery -A proj zdelay concurrency {name} N "
            f"(or off)."
        ) from exc


def _stored_limit(name: str, value: str) -> RateLimit | None:
    if value == REMOVED:
        return None
    data = json.loads(value)
    return parse_limit(data, name=f"the limit of {name} in the store")
