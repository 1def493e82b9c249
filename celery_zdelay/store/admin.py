"""Inspect and administer the store: counts, listings, dead letters, health.

This is what ``celery -A proj zdelay status|list|dead`` and the Prometheus
collector read. Every command names the keys of one shard only
(:meth:`Store.keys`), never ``KEYS`` or a multi-key command across shards,
so all of it works on a Redis Cluster. Counting is ``ZCARD``/``ZCOUNT``/
``HLEN`` (O(1) or O(log n)) and listings are bounded with ``LIMIT``, so
inspecting a store of millions of entries costs Redis about what one claim
does. Payloads are read only to show their Celery headers
(:func:`~celery_zdelay.entry.entry_headers`): task arguments are never
decoded.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, cast

import redis

from .._format import duration
from ..config import MAX_SHARDS
from ..entry import TemplateLookup, entry_headers, expand_entry
from ..errors import ConfigurationError, EntryError
from .client import sanitize_url, unavailable_as_error
from .keys import companions_key, shard_keys
from .store import Store

__all__ = [
    "COMPANION_ALIVE_MS",
    "DEFAULT_LIST_LIMIT",
    "MAX_LIST_LIMIT",
    "MAX_SCAN",
    "CompanionInfo",
    "Counts",
    "DeadEntry",
    "Listing",
    "ParkedEntry",
    "ServerHealth",
    "ShardCounts",
    "Status",
    "check",
    "companions",
    "counts",
    "list_dead",
    "list_parked",
    "log_store_warnings",
    "no_companion_warning",
    "purge_dead",
    "requeue_all_dead",
    "requeue_dead",
    "server_health",
    "status",
    "stranded_shards",
    "stranded_warning",
]

logger = logging.getLogger(__name__)

#: A companion whose last heartbeat is older than this is shown as stale, not
#: alive. Companions beat every 5 s; the margin covers a slow pass and clock
#: differences between hosts.
COMPANION_ALIVE_MS = 30_000
#: Entries a listing shows when no limit is given.
DEFAULT_LIST_LIMIT = 100
#: Largest listing, so one command cannot pull a whole store into memory.
MAX_LIST_LIMIT = 10_000
#: Most entries per shard a filtered listing (``task=``) reads before it stops.
MAX_SCAN = 10_000
#: Entries read per round trip when a listing filters by task name.
_PAGE = 500
#: Ids per requeue or purge call, so each call stays short.
_ADMIN_BATCH = 500
#: Score slots per millisecond in the due set (score = due_ms * 1024 + seq).
_SEQ = 1024


# -- counts -------------------------------------------------------------------


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
    numbers = _shards(store, shards)
    now_ms = store.time_ms()
    # An entry is overdue when claim.lua would take it now: score below (now + 1 ms) * 1024.
    due_now = now_ms * _SEQ + _SEQ - 1
    with unavailable_as_error(store.url), store.client.pipeline(transaction=False) as pipe:
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
        ages = [now_ms - int(head[0][1]) // _SEQ] if waiting_late and head else []
        flying_late = [now_ms - due for due in map(_leased_due_ms, leased) if due <= now_ms]
        ages += flying_late
        result.append(
            ShardCounts(
                shard=shard,
                parked=int(parked),
                overdue=waiting_late + len(flying_late),
                oldest_overdue_age_ms=max(*ages, 0) if ages else None,
                in_flight=int(in_flight),
                dead=int(dead),
                next_due_ms=int(upcoming[0][1]) // _SEQ if upcoming else None,
                overdue_in_flight=len(flying_late),
            )
        )
    return Counts(now_ms=now_ms, shards=result)


def _leased_due_ms(record: bytes) -> int:
    """Return the due ms of an in-flight entry from its leased record ("<score> <token>")."""
    return int(bytes(record).split()[0]) // _SEQ


# -- companions ---------------------------------------------------------------


@dataclass(frozen=True)
class CompanionInfo:
    """A companion as its last heartbeat describes it."""

    id: str
    host: str
    pid: int
    version: str
    shards: list[int]
    #: Whether the companion hands entries straight to a Redis broker, and why not.
    handoff: str
    started_ms: int
    #: When the companion last wrote its heartbeat (the Redis clock).
    seen_ms: int
    #: Entries it released since it started.
    released: int
    #: Entries it dead-lettered since it started.
    dead_lettered: int
    #: The heartbeat is younger than :data:`COMPANION_ALIVE_MS`.
    alive: bool


def companions(store: Store, *, now_ms: int | None = None) -> list[CompanionInfo]:
    """Return the companions that wrote a heartbeat, alive ones first.

    A companion removes its heartbeat when it stops; one that was killed
    leaves it behind, shown as not alive, until a live companion prunes it
    an hour later.
    """
    now = store.time_ms() if now_ms is None else now_ms
    with unavailable_as_error(store.url):
        beats = store.client.hgetall(companions_key(store.config.key_prefix))
    found = []
    for raw_id, raw in beats.items():
        try:
            beat = json.loads(raw)
            seen_ms = int(beat.get("seen_ms", 0))
            found.append(
                CompanionInfo(
                    id=str(beat.get("id") or _text(raw_id)),
                    host=str(beat.get("host", "")),
                    pid=int(beat.get("pid", 0)),
                    version=str(beat.get("version", "")),
                    shards=[int(s) for s in beat.get("shards", [])],
                    handoff=str(beat.get("handoff", "")),
                    started_ms=int(beat.get("started_ms", 0)),
                    seen_ms=seen_ms,
                    released=int(beat.get("released", 0)),
                    dead_lettered=int(beat.get("dead_lettered", 0)),
                    alive=now - seen_ms <= COMPANION_ALIVE_MS,
                )
            )
        except (ValueError, TypeError, AttributeError):
            logger.debug("Ignoring an unreadable heartbeat of %s: %r", _text(raw_id), raw)
    found.sort(key=lambda c: (not c.alive, -c.seen_ms, c.id))
    return found


def no_companion_warning(store: Store) -> str | None:
    """Return a warning when no companion of *store* is alive, else None.

    Forgetting the companion is like forgetting beat: parked tasks are
    never released. Workers say so when they start, and producers on their
    first park.

    Raises:
        StoreUnavailableError: Redis cannot be reached.
    """
    if any(c.alive for c in companions(store)):
        return None
    return (
        f"No celery-zdelay companion is running for the store {sanitize_url(store.url)} "
        f"(key prefix {store.config.key_prefix!r}): parked tasks are not released until one "
        "runs. Start it next to your workers: celery -A proj zdelay"
    )


# -- server health ------------------------------------------------------------


@dataclass(frozen=True)
class ServerHealth:
    """The Redis settings parked tasks depend on, with a warning for each unsafe one.

    Fields are ``None`` when the server does not let us read them (managed
    services often disable ``CONFIG``). On a Redis Cluster they are those of
    the node that answered.
    """

    redis_version: str | None
    maxmemory_policy: str | None
    maxmemory: int | None
    appendonly: str | None
    appendfsync: str | None
    save: str | None
    #: One sentence per unsafe setting, each saying what to change.
    warnings: list[str] = field(default_factory=list)


_CONFIG_NAMES = ("maxmemory-policy", "maxmemory", "appendonly", "appendfsync", "save")


def server_health(store: Store) -> ServerHealth:
    """Read the store's eviction and persistence settings and judge them.

    Raises:
        StoreUnavailableError: Redis cannot be reached.
    """
    config: dict[str, str] = {}
    unreadable: str | None = None
    with unavailable_as_error(store.url):
        try:
            # One CONFIG GET per name: Redis before 7.0 takes one pattern only,
            # and a cluster client cannot pipeline CONFIG.
            for name in _CONFIG_NAMES:
                reply = store.client.config_get(name)
                config.update({_text(k): _text(v) for k, v in reply.items()})
        except redis.exceptions.ResponseError as exc:
            unreadable = str(exc)
        try:
            version: str | None = str(store.client.info("server").get("redis_version"))
        except redis.exceptions.ResponseError:
            version = None
        try:
            memory = store.client.info("memory")
            role = store.client.info("replication").get("role")
        except redis.exceptions.ResponseError:
            memory, role = {}, None
    policy = config.get("maxmemory-policy")
    appendonly = config.get("appendonly")
    appendfsync = config.get("appendfsync")
    save = config.get("save")
    warnings = []
    if unreadable is not None:
        warnings.append(
            f"Cannot read the Redis configuration of {sanitize_url(store.url)} "
            f"(CONFIG GET: {unreadable}). Check yourself that maxmemory-policy is "
            "noeviction and appendonly is yes with appendfsync everysec."
        )
    # volatile-* policies only evict keys with a TTL, and zdelay's keys have none.
    if policy is not None and policy.startswith("allkeys-"):
        warnings.append(
            f"Redis eviction policy is {policy}; parked tasks can be evicted. "
            "Set maxmemory-policy noeviction or give zdelay its own instance."
        )
    if appendonly == "no":
        if save:
            warnings.append(
                f'Redis persistence is RDB snapshots only (appendonly no, save "{save}"); '
                "tasks parked since the last snapshot are lost when Redis restarts. "
                "Set appendonly yes and appendfsync everysec."
            )
        elif save is not None:
            warnings.append(
                'Redis persistence is off (appendonly no, save ""); every parked task '
                "is lost when Redis restarts. Set appendonly yes and appendfsync everysec."
            )
    elif appendonly == "yes" and appendfsync == "no":
        warnings.append(
            "Redis appendfsync is no; the operating system decides when the AOF reaches "
            "the disk, so a machine crash can lose recently parked tasks. "
            "Set appendfsync everysec."
        )
    maxmemory = config.get("maxmemory")
    used, limit = memory.get("used_memory"), memory.get("maxmemory")
    if isinstance(used, int) and isinstance(limit, int) and 0 < limit <= used:
        warnings.append(
            f"Redis is out of memory (used {used} bytes, maxmemory {limit}): parking fails "
            "and companions cannot release until memory is freed or maxmemory raised."
        )
    if role == "slave":
        warnings.append(
            "This Redis is a read-only replica: nothing can be parked or released here. "
            "Point zdelay_redis_url at the primary (or a sentinel:// URL)."
        )
    return ServerHealth(
        redis_version=version,
        maxmemory_policy=policy,
        maxmemory=int(maxmemory) if maxmemory is not None and maxmemory.isdigit() else None,
        appendonly=appendonly,
        appendfsync=appendfsync,
        save=save,
        warnings=warnings,
    )


# -- entries beyond the configured shards -------------------------------------


def stranded_shards(store: Store) -> list[int]:
    """Return the shards at or beyond ``zdelay_shards`` that still hold entries.

    Lowering ``zdelay_shards`` does not move what is parked: entries of the
    dropped shards stay under their own keys, where no companion releases
    them and ``cancel`` does not look. One ``EXISTS`` per shard number the
    setting allows beyond the configured count, in one pipeline (on a Redis
    Cluster split by node; a shard's keys share one slot).
    """
    beyond = range(store.config.shards, MAX_SHARDS)
    if not beyond:
        return []
    prefix = store.config.key_prefix
    with unavailable_as_error(store.url), store.client.pipeline(transaction=False) as pipe:
        for shard in beyond:
            keys = shard_keys(prefix, shard)
            pipe.exists(keys.due, keys.lease, keys.dead)
        replies = pipe.execute()
    return [shard for shard, found in zip(beyond, replies, strict=True) if found]


def stranded_warning(stranded: Sequence[int], *, shards: int) -> str | None:
    """Return the warning for :func:`stranded_shards`, or None when there are none."""
    if not stranded:
        return None
    plural = "s" if len(stranded) > 1 else ""
    return (
        f"Shard{plural} {','.join(map(str, stranded))} still hold{'' if plural else 's'} "
        f"entries, but zdelay_shards is {shards}: no companion releases them and cancel "
        f"does not find them. Set zdelay_shards back to at least {max(stranded) + 1}."
    )


def log_store_warnings(store: Store) -> list[str]:
    """Log each :func:`server_health` warning, and stranded shards, at WARNING level.

    Meant for start-up: it never raises, because an unreachable store is
    reported (and retried) by the caller's own first call. Returns the
    warnings logged.
    """
    try:
        warnings = list(server_health(store).warnings)
        stranded = stranded_warning(stranded_shards(store), shards=store.config.shards)
    except Exception as exc:
        logger.debug("Could not check the Redis settings of the store: %r", exc)
        return []
    if stranded is not None:
        warnings.append(stranded)
    for warning in warnings:
        logger.warning("%s", warning)
    return warnings


# -- status -------------------------------------------------------------------


@dataclass(frozen=True)
class Status:
    """Everything ``zdelay status`` shows."""

    url: str
    key_prefix: str
    counts: Counts
    companions: list[CompanionInfo]
    health: ServerHealth
    #: Shards beyond ``zdelay_shards`` that still hold entries (:func:`stranded_shards`).
    stranded: list[int] = field(default_factory=list)

    @property
    def now_ms(self) -> int:
        return self.counts.now_ms

    @property
    def alive(self) -> list[CompanionInfo]:
        return [c for c in self.companions if c.alive]

    @property
    def stranded_problem(self) -> str | None:
        """The warning about :attr:`stranded` shards, if any."""
        # status() counts every configured shard.
        return stranded_warning(self.stranded, shards=len(self.counts.shards))

    @property
    def warnings(self) -> list[str]:
        """The server's warnings, and the stranded shards' one."""
        stranded = self.stranded_problem
        return self.health.warnings + ([] if stranded is None else [stranded])


def status(store: Store) -> Status:
    """Return the counts, companions and server health of *store*."""
    found = counts(store)
    return Status(
        url=sanitize_url(store.url),
        key_prefix=store.config.key_prefix,
        counts=found,
        companions=companions(store, now_ms=found.now_ms),
        health=server_health(store),
        stranded=stranded_shards(store),
    )


def check(current: Status, *, max_overdue_ms: int) -> list[str]:
    """Return what is wrong for a liveness probe; an empty list means healthy.

    Wrong is: no live companion, a shard no live companion releases (a
    stranded one included), or an overdue entry older than *max_overdue_ms*.
    """
    problems = []
    if current.stranded_problem is not None:
        problems.append(current.stranded_problem)
    alive = current.alive
    if not alive:
        problems.append("no companion is alive")
    else:
        covered = {shard for c in alive for shard in c.shards}
        orphans = [s.shard for s in current.counts.shards if s.shard not in covered]
        if orphans:
            problems.append(
                "no live companion releases shard"
                + ("s " if len(orphans) > 1 else " ")
                + ",".join(map(str, orphans))
            )
    age = current.counts.oldest_overdue_age_ms
    if age is not None and age > max_overdue_ms:
        problems.append(
            f"the oldest overdue entry is {duration(age)} overdue "
            f"(limit {duration(max_overdue_ms)})"
        )
    return problems


# -- listing parked entries ---------------------------------------------------


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


@dataclass(frozen=True)
class DeadEntry:
    """A dead-lettered entry: when and why it died, and what it was."""

    task_id: str
    shard: int
    #: When it was dead-lettered (Redis clock).
    died_ms: int
    #: When it was due, from the reason record.
    due_ms: int | None
    reason: str | None
    #: The companion that dead-lettered it.
    companion: str | None
    task: str | None
    queue: str | None
    argsrepr: str | None
    kwargsrepr: str | None
    expires: str | None
    #: Why the message cannot be read, if it cannot.
    error: str | None = None


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
    due_after_ms: int | None = None,
    due_before_ms: int | None = None,
    limit: int = DEFAULT_LIST_LIMIT,
    shards: Iterable[int] | None = None,
    scan_limit: int = MAX_SCAN,
) -> Listing:
    """Return parked entries in due order, at most *limit* of them.

    *due_after_ms* and *due_before_ms* select due times in ``[after,
    before)``; *task* is a task name or a glob pattern (``proj.orders.*``).
    Without *task* each shard costs one bounded range read; with it, each
    shard reads at most *scan_limit* entries, in pages.
    """
    _check_limit(limit)
    numbers = _shards(store, shards)
    now_ms = store.time_ms()
    low = "-inf" if due_after_ms is None else str(due_after_ms * _SEQ)
    high = "+inf" if due_before_ms is None else f"({due_before_ms * _SEQ}"
    found: list[tuple[int, int, ParkedEntry]] = []
    more = False
    for shard in numbers:
        entries, shard_more = _parked_in_shard(store, shard, low, high, task, limit, scan_limit)
        found += entries
        found += _in_flight_in_shard(store, shard, due_after_ms, due_before_ms, task)
        more = more or shard_more
    found.sort(key=lambda item: (item[0], item[1]))
    if len(found) > limit:
        more = True
    return Listing(now_ms=now_ms, entries=[entry for _, _, entry in found[:limit]], more=more)


def _parked_in_shard(
    store: Store,
    shard: int,
    low: str,
    high: str,
    task: str | None,
    limit: int,
    scan_limit: int,
) -> tuple[list[tuple[int, int, ParkedEntry]], bool]:
    """Return up to limit + 1 matching entries of *shard*, and whether the scan was cut short."""
    keys = store.keys(shard)
    matches: list[tuple[int, int, ParkedEntry]] = []
    offset = 0
    while True:
        page = limit + 1 if task is None else min(_PAGE, scan_limit - offset)
        with unavailable_as_error(store.url):
            # The store's client returns bytes (decode_responses=False).
            members = cast(
                "list[tuple[bytes, float]]",
                store.client.zrangebyscore(
                    keys.due, low, high, start=offset, num=page, withscores=True
                ),
            )
            payloads = cast(
                "list[bytes | None]",
                store.client.hmget(keys.msg, [m for m, _ in members]) if members else [],
            )
            missing = [m for (m, _), p in zip(members, payloads, strict=True) if p is None]
            still_parked = _still_in(store, keys.due, missing)
        for (member, score), payload in zip(members, payloads, strict=True):
            task_id = _text(member)
            if payload is None and member not in still_parked:
                continue  # released between the two reads
            entry = _parked_entry(store, task_id, shard, int(score), payload)
            if task is not None and (entry.task is None or not fnmatchcase(entry.task, task)):
                continue
            matches.append((int(score), shard, entry))
        offset += len(members)
        if task is None or len(matches) > limit or len(members) < page:
            return matches, False
        if offset >= scan_limit:
            return matches, True


def _in_flight_in_shard(
    store: Store,
    shard: int,
    due_after_ms: int | None,
    due_before_ms: int | None,
    task: str | None,
) -> list[tuple[int, int, ParkedEntry]]:
    """Return the in-flight entries of *shard* that match, as :func:`_parked_in_shard` does.

    They are listed too: an entry a companion holds while the broker is down
    is still waiting to run, and late if its due time passed. The set is
    bounded by the companions' batches, so it is read whole.
    """
    keys = store.keys(shard)
    with unavailable_as_error(store.url):
        leased = cast("dict[bytes, bytes]", store.client.hgetall(keys.leased))
        members = list(leased)
        payloads = cast(
            "list[bytes | None]", store.client.hmget(keys.msg, members) if members else []
        )
    found = []
    for member, payload in zip(members, payloads, strict=True):
        score = int(bytes(leased[member]).split()[0])
        due_ms = score // _SEQ
        if due_after_ms is not None and due_ms < due_after_ms:
            continue
        if due_before_ms is not None and due_ms >= due_before_ms:
            continue
        entry = _parked_entry(store, _text(member), shard, score, payload, in_flight=True)
        if task is not None and (entry.task is None or not fnmatchcase(entry.task, task)):
            continue
        found.append((score, shard, entry))
    return found


def _parked_entry(
    store: Store,
    task_id: str,
    shard: int,
    score: int,
    payload: bytes | None,
    *,
    in_flight: bool = False,
) -> ParkedEntry:
    headers, queue, error = _describe(payload, store.templates(shard))
    return ParkedEntry(
        task_id=task_id,
        shard=shard,
        due_ms=score // _SEQ,
        task=_optional(headers.get("task")),
        queue=queue,
        argsrepr=_optional(headers.get("argsrepr")),
        kwargsrepr=_optional(headers.get("kwargsrepr")),
        expires=_optional(headers.get("expires")),
        error=error,
        in_flight=in_flight,
    )


# -- dead letters -------------------------------------------------------------


def list_dead(
    store: Store, *, limit: int = DEFAULT_LIST_LIMIT, shards: Iterable[int] | None = None
) -> Listing:
    """Return dead-lettered entries, most recent first, at most *limit* of them."""
    _check_limit(limit)
    numbers = _shards(store, shards)
    now_ms = store.time_ms()
    found: list[DeadEntry] = []
    more = False
    for shard in numbers:
        keys = store.keys(shard)
        with unavailable_as_error(store.url):
            members = cast(
                "list[tuple[bytes, float]]",
                store.client.zrevrange(keys.dead, 0, limit, withscores=True),
            )
            stored = cast(
                "list[bytes | None]",
                store.client.hmget(keys.dead_msg, [m for m, _ in members]) if members else [],
            )
        more = more or len(members) > limit
        for (member, died), record in zip(members, stored, strict=True):
            found.append(_dead_entry(store, _text(member), shard, int(died), record))
    found.sort(key=lambda e: (-e.died_ms, e.shard, e.task_id))
    if len(found) > limit:
        more = True
    return Listing(now_ms=now_ms, entries=found[:limit], more=more)


def _dead_entry(
    store: Store, task_id: str, shard: int, died_ms: int, record: bytes | None
) -> DeadEntry:
    reason: dict[str, Any] = {}
    payload: bytes | None = None
    if record is not None:
        reason_line, _, payload = record.partition(b"\n")
        try:
            parsed = json.loads(reason_line)
            reason = parsed if isinstance(parsed, dict) else {}
        except ValueError:
            reason = {"reason": reason_line.decode(errors="replace")}
    headers, queue, error = _describe(payload or None, store.templates(shard))
    due_ms = reason.get("due_ms")
    return DeadEntry(
        task_id=task_id,
        shard=shard,
        died_ms=died_ms,
        due_ms=int(due_ms) if isinstance(due_ms, (int, float)) else None,
        reason=_optional(reason.get("reason")),
        companion=_optional(reason.get("companion")),
        task=_optional(headers.get("task")),
        queue=queue,
        argsrepr=_optional(headers.get("argsrepr")),
        kwargsrepr=_optional(headers.get("kwargsrepr")),
        expires=_optional(headers.get("expires")),
        error=error,
    )


def requeue_dead(store: Store, task_ids: Sequence[str]) -> list[bool]:
    """Park dead-lettered entries again, due now; return, per id, whether it was.

    An id is not requeued when it is not dead-lettered, has no message (it
    died because the message was missing), or was parked again since (and
    is waiting, or being released right now).
    """
    by_shard: dict[int, list[int]] = {}
    for index, task_id in enumerate(task_ids):
        by_shard.setdefault(store.shard_of(task_id), []).append(index)
    done = [False] * len(task_ids)
    for shard, indexes in by_shard.items():
        for start in range(0, len(indexes), _ADMIN_BATCH):
            chunk = indexes[start : start + _ADMIN_BATCH]
            flags = _requeue_call(store, shard, [task_ids[i] for i in chunk])
            for index, flag in zip(chunk, flags, strict=True):
                done[index] = flag
    return done


def requeue_all_dead(store: Store, shards: Iterable[int] | None = None) -> tuple[int, int]:
    """Requeue every entry dead-lettered so far; return (requeued, left dead-lettered).

    Only entries that died before the call are taken: a requeued entry that a
    running companion dead-letters again is left for the next call, so this
    always ends.
    """
    numbers = _shards(store, shards)
    until_ms = store.time_ms()
    requeued = left = 0
    for shard in numbers:
        keys = store.keys(shard)
        # Entries that cannot be requeued stay in the set: step over them.
        offset = 0
        while True:
            with unavailable_as_error(store.url):
                members = store.client.zrangebyscore(
                    keys.dead, "-inf", until_ms, start=offset, num=_ADMIN_BATCH
                )
            if not members:
                break
            flags = _requeue_call(store, shard, [_text(m) for m in members])
            requeued += sum(flags)
            offset += len(flags) - sum(flags)
        left += offset
    return requeued, left


def _requeue_call(store: Store, shard: int, task_ids: list[str]) -> list[bool]:
    keys = store.keys(shard)
    with unavailable_as_error(store.url):
        reply = store.scripts.requeue(
            keys=[keys.dead, keys.dead_msg, keys.due, keys.msg, keys.lease],
            args=[keys.wake, *task_ids],
            client=store.client,
        )
    flags = [bool(int(flag)) for flag in reply]
    for task_id, flag in zip(task_ids, flags, strict=True):
        if flag:
            logger.info("Requeued dead-lettered %s on shard %d, due now", task_id, shard)
    return flags


def purge_dead(
    store: Store, task_ids: Sequence[str] | None = None, *, shards: Iterable[int] | None = None
) -> int:
    """Delete dead-lettered entries (*task_ids*, or all); return how many were deleted.

    Deletes in batches rather than with one ``DEL``, so purging a large set
    never blocks Redis for long, and removes the message before the index
    entry, so a concurrent requeue finds either both or nothing.
    """
    if task_ids is not None:
        by_shard: dict[int, list[str]] = {}
        for task_id in task_ids:
            by_shard.setdefault(store.shard_of(task_id), []).append(task_id)
        return sum(_purge_call(store, shard, ids) for shard, ids in by_shard.items())
    numbers = _shards(store, shards)
    # Only what died before the call, so a companion dead-lettering as fast
    # as we delete cannot keep this running.
    until_ms = store.time_ms()
    purged = 0
    for shard in numbers:
        while True:
            with unavailable_as_error(store.url):
                members = store.client.zrangebyscore(
                    store.keys(shard).dead, "-inf", until_ms, start=0, num=_ADMIN_BATCH
                )
            if not members:
                break
            purged += _purge_call(store, shard, [_text(m) for m in members])
    return purged


def _purge_call(store: Store, shard: int, task_ids: list[str]) -> int:
    keys = store.keys(shard)
    removed = 0
    for start in range(0, len(task_ids), _ADMIN_BATCH):
        chunk = task_ids[start : start + _ADMIN_BATCH]
        with unavailable_as_error(store.url), store.client.pipeline(transaction=False) as pipe:
            pipe.hdel(keys.dead_msg, *chunk)
            pipe.zrem(keys.dead, *chunk)
            _, count = pipe.execute()
        removed += int(count)
    return removed


# -- helpers ------------------------------------------------------------------


def _describe(
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
    return headers, _routing_key(payload), None


def _routing_key(payload: bytes) -> str | None:
    """Return the routing key in the envelope's ``properties.delivery_info``."""
    _, _, head = payload.partition(b"\n")
    try:
        # The stored envelope stops inside the delivery tag string: close it.
        envelope = json.loads(head + b'"}}')
        key = envelope["properties"]["delivery_info"]["routing_key"]
    except (ValueError, KeyError, TypeError):
        return None
    return key if isinstance(key, str) else None


def _still_in(store: Store, zset: str, members: list[bytes]) -> set[bytes]:
    if not members:
        return set()
    with store.client.pipeline(transaction=False) as pipe:
        for member in members:
            pipe.zscore(zset, member)
        scores = pipe.execute()
    return {m for m, s in zip(members, scores, strict=True) if s is not None}


def _shards(store: Store, shards: Iterable[int] | None) -> list[int]:
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


def _check_limit(limit: int) -> None:
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise ConfigurationError(f"limit must be from 1 to {MAX_LIST_LIMIT}, got {limit}.")


def _optional(value: Any) -> str | None:
    return None if value is None else str(value)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
