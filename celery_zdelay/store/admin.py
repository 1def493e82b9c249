"""Inspect and administer the store: counts, listings, dead letters, health.

One import for all of it; each concern lives in its own module:
:mod:`.counts`, :mod:`.heartbeats` (companions), :mod:`.health` (Redis settings, status),
:mod:`.listing` and :mod:`.deadletters`. Listings and dead letters are
:class:`~.read_model.ParkedTask` entries (``ParkedEntry`` and ``DeadEntry``
are the names they had before, kept as aliases).

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

from .counts import Counts, ShardCounts, counts
from .deadletters import DeadEntry, list_dead, purge_dead, requeue_all_dead, requeue_dead
from .health import (
    ServerHealth,
    Status,
    check,
    log_store_warnings,
    no_companion_warning,
    server_health,
    status,
    stranded_shards,
    stranded_warning,
    wake_problem,
)
from .heartbeats import COMPANION_ALIVE_MS, CompanionInfo, companions
from .listing import MAX_SCAN, Listing, ParkedEntry, list_parked
from .read_model import EntryState, ParkedTask
from .reading import DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT

__all__ = [
    "COMPANION_ALIVE_MS",
    "DEFAULT_LIST_LIMIT",
    "MAX_LIST_LIMIT",
    "MAX_SCAN",
    "CompanionInfo",
    "Counts",
    "DeadEntry",
    "EntryState",
    "Listing",
    "ParkedEntry",
    "ParkedTask",
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
    "wake_problem",
]
