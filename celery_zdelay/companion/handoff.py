"""The atomic handoff: is the broker the store's own Redis database?

When it is, handoff.lua moves due entries straight into kombu's queue lists
in the same script that removes them from the store: exactly once, with no
window in which a crash could lose or duplicate a task.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..bulk_limit import DEFAULT_BULK_LIMIT, bulk_limit
from ..redis_layout import RedisLayout
from .publish import broker_connection

if TYPE_CHECKING:
    from celery import Celery

    from ..store import Store

__all__ = ["Handoff", "detect_handoff"]

logger = logging.getLogger(__name__)


@dataclass
class Handoff:
    """The broker lists the companion may push to, per shard."""

    layout: RedisLayout
    #: The server's proto-max-bulk-len: push.lua cannot take a longer envelope.
    bulk_limit: int = DEFAULT_BULK_LIMIT
    _dests: dict[int, list[str]] = field(default_factory=dict)

    def dests(self, store: Store, shard: int, *, refresh: bool = False) -> list[str]:
        """Return the list keys parked entries of *shard* name (cached)."""
        if refresh or shard not in self._dests:
            self._dests[shard] = store.dests(shard)
        return self._dests[shard]


def detect_handoff(app: Celery, store: Store, *, wait: float) -> tuple[Handoff | None, str]:
    """Return the handoff for *app* if its broker is the store's Redis database.

    The second value says why (not), for the companion's start-up line. A
    broker that does not answer within *wait* seconds raises (kombu's own
    connect would retry for minutes, a silent one forever).
    """
    connection = broker_connection(app, wait)
    try:
        transport = connection.transport
        if transport.driver_type != "redis":
            return None, f"off (the broker is {transport.driver_type}, not Redis)"
        if store.cluster:
            # kombu has no Redis Cluster transport: the broker is elsewhere.
            return None, "off (the store is a Redis Cluster, the broker is not)"
        connection.ensure_connection(max_retries=1)
        broker = connection.default_channel.client
        same_server = _run_id(broker) == _run_id(store.client)
        broker_db, store_db = _db(broker), _db(store.client)
        if not same_server:
            return None, "off (the broker is another Redis server than the store)"
        if broker_db != store_db:
            return None, f"off (the broker uses database {broker_db}, the store {store_db})"
        handoff = Handoff(RedisLayout(connection.transport_options), bulk_limit(broker))
        return handoff, "on (atomic, exactly once)"
    finally:
        connection.release()


def _run_id(client: Any) -> str:
    return str(client.info("server")["run_id"])


def _db(client: Any) -> int:
    return int(client.connection_pool.connection_kwargs.get("db", 0) or 0)
