"""Helpers for testing code that parks delayed tasks."""

from __future__ import annotations

from .redis_server import RedisServer, find_redis_server, free_port

__all__ = ["RedisServer", "find_redis_server", "free_port"]
