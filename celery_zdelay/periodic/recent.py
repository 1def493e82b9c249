"""A bounded map that keeps the entries used last: the periodic part's caches.

A companion serving 100,000 schedules cannot keep one of everything per
schedule (a decoded definition took 1.8 KB, a crontab object 3 to 5 KB),
and needs few at a time: a pass visits the schedules due soon. Each cache
keeps a fixed number, the one used longest ago going first.
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

__all__ = ["Recent"]

K = TypeVar("K")
V = TypeVar("V")


class Recent(Generic[K, V]):
    """At most *size* entries, the one used longest ago dropped first.

    Thread-safe: the rows' reader and the pass share some (see
    :mod:`celery_zdelay.periodic.definition`).
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a Recent cache keeps at least one entry, not {size}")
        self.size = size
        self._items: dict[K, V] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: K) -> V | None:
        """The value of *key* (now the one used last), or None."""
        with self._lock:
            value = self._items.pop(key, None)
            if value is not None:
                self._items[key] = value  # the most recently used, last
            return value

    def put(self, key: K, value: V) -> V:
        """Keep *value* under *key*, dropping the entry used longest ago when full."""
        with self._lock:
            self._items.pop(key, None)
            return self._add(key, value)

    def keep(self, key: K, value: V) -> V:
        """The value kept under *key*, else *value*, kept from now on: one object for equal keys."""
        with self._lock:
            kept = self._items.pop(key, None)
            return self._add(key, value if kept is None else kept)

    def _add(self, key: K, value: V) -> V:
        """Add *key* (not kept now) as the one used last, making room first. Under the lock."""
        while len(self._items) >= self.size:
            del self._items[next(iter(self._items))]
        self._items[key] = value
        return value

    def pop(self, key: K) -> None:
        """Forget *key*, if kept."""
        with self._lock:
            self._items.pop(key, None)
