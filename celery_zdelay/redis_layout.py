"""How kombu's Redis transport names its queue lists.

The Redis handoff pushes released messages straight into the lists workers
read, so it must name them exactly as kombu does: queue name, priority step
suffix (``sep`` + step), ``global_keyprefix``. Rather than restate those
rules, this asks kombu's own Redis channel class, on an instance that never
connects.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from kombu.transport import redis as kombu_redis

__all__ = ["RedisLayout"]

_LAYOUT_OPTIONS = ("sep", "priority_steps", "global_keyprefix")


class _NamingChannel(kombu_redis.Channel):  # type: ignore[misc]
    """kombu's Redis channel, used only for its queue naming; never connects."""

    def __init__(self, transport_options: Mapping[str, Any]) -> None:
        for name in _LAYOUT_OPTIONS:
            if name in transport_options:
                setattr(self, name, transport_options[name])


class RedisLayout:
    """Queue list naming of one Redis broker configuration."""

    def __init__(self, transport_options: Mapping[str, Any]) -> None:
        self._channel = _NamingChannel(transport_options)
        described = [
            self._channel.sep,
            list(self._channel.priority_steps),
            self._channel.global_keyprefix,
        ]
        #: Short digest of the naming rules; handoff.lua hands off only entries
        #: parked under the same rules as the companion's broker uses.
        self.fingerprint = hashlib.sha1(json.dumps(described).encode()).hexdigest()[:8]

    def list_key(self, queue: str, priority: int | None) -> str:
        """Return the Redis key of the list a message for *queue* lands in."""
        message = {"properties": {"priority": priority}}
        step = self._channel._get_message_priority(message, reverse=False)
        key: str = self._channel.global_keyprefix + self._channel._q_for_pri(queue, step)
        return key
