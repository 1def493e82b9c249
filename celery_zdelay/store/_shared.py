"""What the store's admin reads share: a payload's headers, shard and limit checks.

Payloads are read only for their Celery headers
(:func:`~celery_zdelay.entry.entry_headers`): task arguments are never
decoded.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from fnmatch import fnmatchcase
from typing import Any

from ..entry import TemplateLookup, entry_headers, expand_entry
from ..errors import ConfigurationError, EntryError
from .store import Store

__all__ = ["DEFAULT_LIST_LIMIT", "MAX_LIST_LIMIT", "SEQ"]

#: Entries a listing shows when no limit is given.
DEFAULT_LIST_LIMIT = 100
#: Largest listing, so one command cannot pull a whole store into memory.
MAX_LIST_LIMIT = 10_000
#: Score slots per millisecond in the due set (score = due_ms * 1024 + seq).
SEQ = 1024
#: Ids per admin script call (cancel, requeue, purge), so each call stays short.
ADMIN_BATCH = 500


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


def _matches(name: Any, queue: Any, task_pattern: str | None, queue_pattern: str | None) -> bool:
    """Whether a task *name* routed to *queue* matches the glob patterns (None: any)."""
    if task_pattern is not None and not (isinstance(name, str) and fnmatchcase(name, task_pattern)):
        return False
    return queue_pattern is None or (isinstance(queue, str) and fnmatchcase(queue, queue_pattern))


def _check_limit(limit: int) -> None:
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise ConfigurationError(f"limit must be from 1 to {MAX_LIST_LIMIT}, got {limit}.")


def _optional(value: Any) -> str | None:
    return None if value is None else str(value)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
