"""The dead-letter set as a test reads it, and dead letters written as a companion does."""

from __future__ import annotations

import json

import redis

from celery_zdelay.store import Store
from tests.support.keys import SHARD0

__all__ = ["dead_reasons", "make_dead_letter"]


def dead_reasons(client: redis.Redis, *, dead_msg: str = SHARD0.dead_msg) -> dict[str, str]:
    """Return task id -> reason of every dead-lettered entry in *dead_msg*.

    A stored dead letter is its reason JSON, a newline, then the payload.
    """
    return {
        task_id.decode(): json.loads(stored.split(b"\n", 1)[0])["reason"]
        for task_id, stored in client.hgetall(dead_msg).items()
    }


def make_dead_letter(store: Store, task_id: str, reason: str, *, companion: str = "test") -> None:
    """Move a parked entry to the dead-letter set, as a companion does when it refuses one."""
    keys = store.keys(store.shard_of(task_id))
    payload = store.client.hget(keys.msg, task_id)
    assert payload is not None, task_id
    died_ms = store.time_ms()
    store.client.zrem(keys.due, task_id)
    store.client.hdel(keys.msg, task_id)
    record = json.dumps({"reason": reason, "due_ms": died_ms, "companion": companion})
    store.client.hset(keys.dead_msg, task_id, record.encode() + b"\n" + payload)
    store.client.zadd(keys.dead, {task_id: died_ms})
