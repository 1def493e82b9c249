"""Reading the dead-letter set as a test (or an operator) sees it."""

from __future__ import annotations

import json

import redis

from tests.support.keys import SHARD0

__all__ = ["dead_reasons"]


def dead_reasons(client: redis.Redis, *, dead_msg: str = SHARD0.dead_msg) -> dict[str, str]:
    """Return task id -> reason of every dead-lettered entry in *dead_msg*.

    A stored dead letter is its reason JSON, a newline, then the payload.
    """
    return {
        task_id.decode(): json.loads(stored.split(b"\n", 1)[0])["reason"]
        for task_id, stored in client.hgetall(dead_msg).items()
    }
