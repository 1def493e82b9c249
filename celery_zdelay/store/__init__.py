"""The Redis store of parked entries."""

from __future__ import annotations

from .redis_keys import ShardKeys, shard_keys
from .store import Claimed, ClaimResult, Parked, ParkRequest, Store

__all__ = ["ClaimResult", "Claimed", "ParkRequest", "Parked", "ShardKeys", "Store", "shard_keys"]
