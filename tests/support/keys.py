"""Key names of the default prefix, from the code that names them.

Tests read and write Redis directly (an attacker, a crash, an operator):
they name keys through :func:`celery_zdelay.store.keys.shard_keys`, so a
renamed key breaks the code and the tests together, not the tests alone.
"""

from __future__ import annotations

from celery_zdelay.store.keys import ShardKeys, shard_keys

__all__ = ["PREFIX", "SHARD0", "keys_of"]

#: ``zdelay_key_prefix``'s default.
PREFIX = "zdelay"
#: The keys of shard 0, where every entry of a one-shard store lives.
SHARD0 = shard_keys(PREFIX, 0)


def keys_of(shard: int, *, prefix: str = PREFIX) -> ShardKeys:
    """Return the key names of *shard*."""
    return shard_keys(prefix, shard)
