"""Every Redis key name celery-zdelay uses, in one place.

All keys of one shard share the hash tag ``{<prefix>:<shard>}``, so on a Redis
Cluster a shard lives on one node and each script's keys are in one slot.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass

__all__ = [
    "ControlKeys",
    "PeriodicKeys",
    "ShardKeys",
    "canvas_key",
    "companions_key",
    "control_keys",
    "held_set_key",
    "lanes_key",
    "periodic_keys",
    "seen_key",
    "shard_keys",
    "shard_of",
]


@dataclass(frozen=True)
class ShardKeys:
    """The keys of one shard."""

    #: Shard number.
    shard: int
    #: ZSET id -> due_ms * 1024 + seq: what is parked, in release order.
    due: str
    #: HASH id -> payload: the parked messages.
    msg: str
    #: ZSET id -> lease expiry ms: entries claimed by a companion (in flight).
    lease: str
    #: HASH id -> due score: where an in-flight entry returns if its lease expires.
    leased: str
    #: ZSET id -> ms: dead-lettered entries, by the time they died.
    dead: str
    #: HASH id -> reason JSON, newline, payload.
    dead_msg: str
    #: SET of kombu queue list keys parked entries name, for the handoff.
    dests: str
    #: HASH template id -> template record: what entries of a task share.
    templates: str
    #: STRING counter of handoff delivery tags.
    tags: str
    #: Pub/sub channel: "an earlier entry was parked", wakes sleeping companions.
    wake: str
    #: Prefix of kombu delivery tags the handoff makes (unique per shard).
    tag_prefix: str
    #: STRING companion id owning the shard (with zdelay_shard_leases).
    owner: str
    #: ZSET periodic occurrence id -> ms first parked: parked once, never again.
    ticks: str
    #: HASH of the keys and tags of entries: "i:<id>" record, "d:<id>" record
    #: of a dead letter, "k:<key>" owner (see store/marks.py, lua/_marks.lua).
    marks: str
    #: ZSET "<tag>\n<id>", all scored 0: the entries of a tag, by ZRANGEBYLEX.
    tagged: str
    #: HASH id -> its history: one line per event, oldest first (lua/_history.lua),
    #: expired ``zdelay_history_seconds`` after its last (ignored by reads, swept).
    history: str
    #: ZSET "<id>\n<fingerprint>" -> ms until which it is remembered: the broker
    #: messages ``zdelay adopt`` parked (lua/adopt_once.lua), so that one given
    #: back by the broker after a crash is not parked twice.
    adopted: str

    def marker(self) -> str:
        """Return a new STRING key marking one park call (expires on its own)."""
        # 128 random bits, as a uuid4's hex without its fixed version digits
        # (uuid4() reads os.urandom(16) too, then builds an object: 2 µs a park).
        return f"{self.due[: -len(':due')]}:parked:{os.urandom(16).hex()}"


def shard_keys(prefix: str, shard: int) -> ShardKeys:
    """Return the key names of *shard* under *prefix*."""
    tag = f"{{{prefix}:{shard}}}"
    return ShardKeys(
        shard=shard,
        due=f"{tag}:due",
        msg=f"{tag}:msg",
        lease=f"{tag}:lease",
        leased=f"{tag}:leased",
        dead=f"{tag}:dead",
        dead_msg=f"{tag}:dead_msg",
        dests=f"{tag}:dests",
        templates=f"{tag}:templates",
        tags=f"{tag}:tags",
        wake=f"{tag}:wake",
        tag_prefix=f"{prefix}.{shard}.",
        owner=f"{tag}:owner",
        ticks=f"{tag}:ticks",
        marks=f"{tag}:marks",
        tagged=f"{tag}:tagged",
        history=f"{tag}:history",
        adopted=f"{tag}:adopted",
    )


@dataclass(frozen=True)
class PeriodicKeys:
    """The keys of the periodic schedules (one hash tag: one slot for their scripts)."""

    #: HASH name -> definition JSON.
    defs: str
    #: HASH name -> version, raised on every change (kept after removal).
    versions: str
    #: HASH name -> JSON: newest occurrence parked and the ids parked lately.
    pointers: str
    #: SET of paused names.
    paused: str
    #: SET of occurrence ids to cancel (definitions removed, changed, paused).
    cancel: str
    #: HASH: hash, written_by, written_ms (and made, for django-celery-beat's
    #: rows: their change marker) of the stored beat_schedule.
    meta: str
    #: SET of beat_schedule hashes replaced by a newer one.
    superseded: str
    #: HASH name -> JSON: the last occurrence released, its id and how late.
    runs: str
    #: HASH "<name>\n<counter>" -> ticks counted (see PeriodicStore.count).
    counts: str
    #: Followed by a schedule's name: ZSET of its missed occurrence ids -> their ms.
    missed_prefix: str
    #: ZSET "<name>\n<occurrence id>" -> occurrence ms: occurrences found held
    #: back by a pause or a rate limit, until released or withdrawn.
    held: str
    #: ZSET name -> epoch ms from which a planner pass looks at the schedule:
    #: its pointer's ms, or the earliest occurrence parked that no companion
    #: recorded as run, if earlier (see ``_pointer.lua``). Paused schedules
    #: are not in it. Written by the scripts that write pointers and runs.
    visits: str


def periodic_keys(prefix: str) -> PeriodicKeys:
    """Return the key names of the periodic schedules under *prefix*."""
    tag = f"{{{prefix}:periodic}}"
    return PeriodicKeys(
        defs=f"{tag}:defs",
        versions=f"{tag}:versions",
        pointers=f"{tag}:pointers",
        paused=f"{tag}:paused",
        cancel=f"{tag}:cancel",
        meta=f"{tag}:meta",
        superseded=f"{tag}:superseded",
        runs=f"{tag}:runs",
        counts=f"{tag}:counts",
        missed_prefix=f"{tag}:missed:",
        held=f"{tag}:held",
        visits=f"{tag}:visits",
    )


def companions_key(prefix: str) -> str:
    """Return the HASH of live companions: companion id -> heartbeat JSON."""
    return f"{prefix}:companions"


def seen_key(prefix: str, park_id: str, retries: int) -> str:
    """Return the STRING the worker-side guard keeps for one park and retry of a task.

    "running" or "finished", expiring on its own (see
    :func:`celery_zdelay.worker.refuse_second_delivery`).
    """
    return f"{prefix}:seen:{park_id}:{retries}"


def shard_of(task_id: str, shards: int) -> int:
    """Return the shard of *task_id*: stable across processes and releases."""
    if shards == 1:
        return 0
    return zlib.crc32(task_id.encode()) % shards


def canvas_key(prefix: str, result_id: str) -> str:
    """Return the SET of the parked ids behind a canvas's result id.

    A delayed chain parks its first task, a group its members: the id the
    caller holds (the chain's last task, the group) names no entry, so
    cancel and reschedule look it up here. It expires on its own.
    """
    return f"{prefix}:canvas:{result_id}"


@dataclass(frozen=True)
class ControlKeys:
    """The keys of release control: rate limits, pauses and concurrency (one hash tag: one slot)."""

    #: HASH control name -> limit JSON {"rate", "burst"}, or "off": set at run time.
    limits: str
    #: HASH control name -> ms paused since (Redis clock).
    paused: str
    #: HASH control name -> concurrency JSON {"most", "at"} (``at``: Redis ms
    #: it was set), or "off": set at run time. A name once set stays (as
    #: "off" when removed): workers free the slots of every name here.
    concurrency: str

    def bucket(self, prefix: str, name: str) -> str:
        """Return the HASH token bucket of the limit *name* (a hash tag of its own).

        Each bucket is its own slot, so on a Redis Cluster the buckets spread
        over the nodes; a bucket is only ever touched alone (take_tokens.lua).
        """
        return f"{{{prefix}:bucket:{name}}}"

    def slots(self, prefix: str, slot: str) -> str:
        """Return the ZSET of the tasks that took a slot of *slot* (a hash tag of its own).

        Task id -> ms (Redis clock) its slot ends by itself. Like a bucket,
        only ever touched alone (take_slots.lua, a worker's ZREM); Redis
        deletes it with its last member, and it expires with its last slot.
        """
        return f"{{{prefix}:slots:{slot}}}"

    def slot_keys(self, prefix: str, control: str) -> str:
        """Return the ZSET of the limit keys of a ``limit_key:`` concurrency control with slots.

        Limit key -> ms its latest slot ends: what ``controls()`` sums the
        running count of a glob over. Trimmed by expiry when written.
        """
        return f"{{{prefix}:slotkeys:{control}}}"


def control_keys(prefix: str) -> ControlKeys:
    """Return the key names of release control under *prefix*."""
    tag = f"{{{prefix}:control}}"
    return ControlKeys(
        limits=f"{tag}:limits", paused=f"{tag}:paused", concurrency=f"{tag}:concurrency"
    )


def held_set_key(prefix: str, shard: int, name: str) -> str:
    """Return the ZSET of *shard*'s entries held by control *name* (in the shard's slot).

    id -> due score, as in the due set: held entries keep their place in due order.
    """
    return f"{{{prefix}:{shard}}}:held:{name}"


def lanes_key(prefix: str, shard: int) -> str:
    """Return the SET of control names with a held set on *shard* (in the shard's slot)."""
    return f"{{{prefix}:{shard}}}:lanes"
