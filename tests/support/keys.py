"""Key names of the default prefix, from the code that names them.

Tests read and write Redis directly (an attacker, a crash, an operator):
they name keys through :func:`celery_zdelay.store.keys.shard_keys`, so a
renamed key breaks the code and the tests together, not the tests alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery import Celery

from celery_zdelay.store.keys import ShardKeys, shard_keys

__all__ = ["PREFIX", "SHARD0", "forged_tag", "keys_of"]

#: ``zdelay_key_prefix``'s default.
PREFIX = "zdelay"
#: The keys of shard 0, where every entry of a one-shard store lives.
SHARD0 = shard_keys(PREFIX, 0)


def keys_of(shard: int, *, prefix: str = PREFIX) -> ShardKeys:
    """Return the key names of *shard*."""
    return shard_keys(prefix, shard)


def forged_tag(make_test_app: Callable[..., Celery], redis_client: Any) -> tuple[Celery, Any, Any]:
    """Return a signing app, an entry signed with tag order:1, and an honest order:9 one.

    Someone with write access to Redis has pointed tag order:9 at the first
    entry too (an index entry its signed message does not carry).
    """
    app = make_test_app(conf={"zdelay_signing_key": "k" * 32})
    record = app.tasks["tests.record"]
    signed = record.apply_delayed((1,), countdown=3600, tags=["order:1"])
    honest = record.apply_delayed((2,), countdown=3600, tags=["order:9"])
    redis_client.zadd(SHARD0.tagged, {f"order:9\n{signed.id}": 0})
    return app, signed, honest
