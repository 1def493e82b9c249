"""Key names of the default prefix, from the code that names them.

Tests read and write Redis directly (an attacker, a crash, an operator):
they name keys through :func:`celery_zdelay.store.redis_keys.shard_keys`, so a
renamed key breaks the code and the tests together, not the tests alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from celery import Celery

from celery_zdelay.errors import StoreRefusedError
from celery_zdelay.store.redis_keys import ShardKeys, shard_keys

__all__ = ["FOREIGN", "PREFIX", "SHARD0", "forged_tag", "keys_of", "refused_while_written_over"]

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


#: What someone else wrote into a key of ours.
FOREIGN = "something else wrote this"


@contextmanager
def refused_while_written_over(client: redis.Redis, key: str, kind: str) -> Iterator[None]:
    """*key* overwritten with a string: the block's call must be refused with the fix.

    The refusal names the key's type and the type the script needs
    (*kind*), and the key still holds what was written over it: nothing
    was written before the check. Afterwards the key is as it was.
    """
    saved = client.dump(key)
    client.delete(key)
    client.set(key, FOREIGN)
    try:
        with pytest.raises(
            StoreRefusedError, match=rf"holds a string, not a {kind}: something else"
        ):
            yield
        assert client.get(key) == FOREIGN.encode()
    finally:
        client.delete(key)
        if saved is not None:
            client.restore(key, 0, saved)
