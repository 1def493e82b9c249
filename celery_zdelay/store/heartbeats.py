"""Companion heartbeats: each companion writes its own, ``status`` reads them all.

A heartbeat is one field of the companions hash, the JSON of a
:class:`CompanionInfo` (without ``alive``), stamped with the Redis clock:
``status`` compares heartbeats with Redis TIME, so a host clock minutes off
must not make a live companion look dead (or a dead one alive). Writing and
reading live here together so the two sides cannot drift apart.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass

from .client import store_errors
from .reading import as_text as _text
from .redis_keys import companions_key
from .store import Store

__all__ = [
    "COMPANION_ALIVE_MS",
    "HEARTBEAT_PRUNE_MS",
    "CompanionInfo",
    "companions",
    "forget_heartbeat",
    "write_heartbeat",
]

logger = logging.getLogger(__name__)

#: A companion whose last heartbeat is older than this is shown as stale, not
#: alive. Companions beat every 5 s; the margin covers a slow pass and clock
#: differences between hosts.
COMPANION_ALIVE_MS = 30_000
#: Heartbeats older than this are removed from the companions hash.
HEARTBEAT_PRUNE_MS = 3_600_000


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
    #: Why the companion gets no wake-ups (a permission Redis refused), or "".
    wakeup: str = ""
    #: It serves the periodic schedules (``--beat``/``zdelay_beat``).
    beat: bool = False


def write_heartbeat(store: Store, info: CompanionInfo) -> int:
    """Write *info* as its companion's heartbeat; return how many companions are alive.

    Heartbeats older than :data:`HEARTBEAT_PRUNE_MS` (companions that were
    killed) are removed on the way. At least 1: the writer itself.
    """
    fields = asdict(info)
    del fields["alive"]
    key = companions_key(store.config.key_prefix)
    now_ms = info.seen_ms
    live = 0
    with store_errors(store.url):
        client = store.client
        client.hset(key, info.id, json.dumps(fields))
        for companion, raw in client.hgetall(key).items():
            seen_ms = json.loads(raw).get("seen_ms", 0)
            if seen_ms < now_ms - HEARTBEAT_PRUNE_MS:
                client.hdel(key, companion)
            elif seen_ms >= now_ms - COMPANION_ALIVE_MS:
                live += 1
    return max(live, 1)


def forget_heartbeat(store: Store, companion_id: str) -> None:
    """Remove the heartbeat of *companion_id*, which stops."""
    with store_errors(store.url):
        store.client.hdel(companions_key(store.config.key_prefix), companion_id)


def companions(store: Store, *, now_ms: int | None = None) -> list[CompanionInfo]:
    """Return the companions that wrote a heartbeat, alive ones first.

    A companion removes its heartbeat when it stops; one that was killed
    leaves it behind, shown as not alive, until a live companion prunes it
    an hour later.
    """
    now = store.time_ms() if now_ms is None else now_ms
    with store_errors(store.url):
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
                    beat=bool(beat.get("beat", False)),
                    alive=now - seen_ms <= COMPANION_ALIVE_MS,
                    wakeup=str(beat.get("wakeup") or ""),
                )
            )
        except (ValueError, TypeError, AttributeError):
            logger.debug("Ignoring an unreadable heartbeat of %s: %r", _text(raw_id), raw)
    found.sort(key=lambda c: (not c.alive, -c.seen_ms, c.id))
    return found
