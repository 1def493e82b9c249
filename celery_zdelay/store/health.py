"""Is the store in good hands: live companions, Redis settings, stranded shards, status.

What ``zdelay status`` (and ``--check``), workers at start-up and the
Prometheus collector read besides the counts.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis

from .._format import duration
from ..config import MAX_SHARDS
from .client import sanitize_url, store_errors
from .counts import Counts, counts
from .heartbeats import CompanionInfo, companions
from .reading import as_text as _text
from .redis_keys import shard_keys
from .store import Store

__all__ = [
    "ServerHealth",
    "Status",
    "check",
    "log_store_warnings",
    "no_companion_warning",
    "server_health",
    "status",
    "stranded_shards",
    "stranded_warning",
    "wake_problem",
    "wake_refusal",
]

logger = logging.getLogger(__name__)


# -- companions (their heartbeats: see heartbeats.py) -------------------------


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


# -- wake-ups -----------------------------------------------------------------


def wake_refusal(exc: Exception, channels: Sequence[str], *, action: str) -> str:
    """The message for Redis refusing *action* ("subscribe to", "publish to") *channels*."""
    pattern = _channel_pattern(channels)
    return (
        f"Redis refused to let this ACL user {action} the wake-up channels "
        f"({', '.join(channels[:2])}{', ...' if len(channels) > 2 else ''}): "
        f"{str(exc).rstrip('.')}. Parked tasks are still released, up to a second late "
        f"(the companion's idle timer). Grant the channels: ACL SETUSER <user> {pattern}"
    )


def _channel_pattern(channels: Sequence[str]) -> str:
    """An ACL channel pattern that covers *channels*: ``&{zdelay:*}:wake`` for every shard."""
    if not channels:
        return "&*"
    # Every shard's channel is "{<prefix>:<shard>}:wake" (store/redis_keys.py).
    return "&" + re.sub(r":\d+\}:wake$", ":*}:wake", channels[0])


def wake_problem(store: Store) -> str | None:
    """Return why this client cannot wake companions, or None when it can.

    Scripts publish on the wake channels after they write, as a best effort
    (a refusal never fails a park). So a producer whose ACL user lacks the
    channels is told once, on its first park, by publishing an empty wake-up
    (it costs a companion one extra look at its shards).

    Raises:
        StoreUnavailableError: Redis cannot be reached.
    """
    channels = [store.keys(shard).wake for shard in store.shards]
    with store_errors(store.url):
        if store.cluster:
            # PUBLISH reaches every node from any one: the first channel tells.
            replies: list[object] = []
            try:
                store.client.publish(channels[0], "0")
            except redis.exceptions.ResponseError as exc:
                replies.append(exc)
        else:
            with store.client.pipeline(transaction=False) as pipe:
                for channel in channels:
                    pipe.publish(channel, "0")
                replies = pipe.execute(raise_on_error=False)
    for reply in replies:
        if isinstance(reply, redis.exceptions.ResponseError):
            return wake_refusal(reply, channels, action="publish to")
    return None


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
    with store_errors(store.url):
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
    with store_errors(store.url), store.client.pipeline(transaction=False) as pipe:
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


def check(current: Status, *, max_overdue_ms: int, active_schedules: int = 0) -> list[str]:
    """Return what is wrong for a liveness probe; an empty list means healthy.

    Wrong is: no live companion, a shard no live companion releases (a
    stranded one included), a live companion Redis refuses its wake-up
    channels (tasks released up to a second late), an overdue entry older
    than *max_overdue_ms*, or periodic schedules (*active_schedules* stored
    and not paused) that no live companion serves.
    """
    problems = []
    if active_schedules and current.alive and not any(c.beat for c in current.alive):
        problems.append(
            f"{active_schedules} periodic schedule{'' if active_schedules == 1 else 's'} "
            "stored but no live companion serves them (start companions with --beat "
            "or zdelay_beat = True)"
        )
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
    problems += [f"companion {c.id}: {c.wakeup}" for c in alive if c.wakeup]
    age = current.counts.oldest_overdue_age_ms
    if age is not None and age > max_overdue_ms:
        problems.append(
            f"the oldest overdue entry is {duration(age)} overdue "
            f"(limit {duration(max_overdue_ms)})"
        )
    return problems
