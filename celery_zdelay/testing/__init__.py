"""Test support: fast-forward parked tasks, and private Redis servers.

:class:`FastForward` (the ``zdelay`` pytest fixture, registered by this
package's pytest plugin) binds a Celery app to a test store and releases
what it parks when the test advances the clock; see ``docs/testing.rst``.
:class:`RedisServer` runs a private ``redis-server`` for tests and demos.
"""

from __future__ import annotations

from .fastforward import FastForward, ParkedTask, ReleasedTask
from .redis_server import RedisServer, find_redis_server, free_port

__all__ = [
    "FastForward",
    "ParkedTask",
    "RedisServer",
    "ReleasedTask",
    "find_redis_server",
    "free_port",
]
