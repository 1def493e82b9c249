"""Prometheus gauges of release control, read from Redis at each scrape::

    zdelay_held_tasks{control,reason}   entries held back, all shards; reason
                                        "pause", "rate_limit" or "concurrency"

Held entries are overdue by definition, and count as such in the lateness
of their release; this gauge tells throttling and pauses apart from a slow
companion. The counter ``zdelay_held_total{control,reason}`` (in
:mod:`celery_zdelay.companion.metrics`) counts each time a companion held entries.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from .errors import ZDelayError
from .store import Store
from .store.control import ControlStore, hold_reason, lane_control

__all__ = ["ControlCollector"]

logger = logging.getLogger(__name__)


class ControlCollector:
    """A Prometheus collector of the entries held back by limits and pauses."""

    def __init__(self, store: Store, core: Any) -> None:
        self.control = ControlStore(store)
        self.store = store
        self._core = core

    def _family(self) -> Any:
        return self._core.GaugeMetricFamily(
            "zdelay_held_tasks",
            "Entries held back by a rate limit or a pause, per control.",
            labels=["control", "reason"],
        )

    def describe(self) -> Iterator[Any]:
        yield self._family()

    def collect(self) -> Iterator[Any]:
        family = self._family()
        try:
            paused = self.control.read().paused
            held: dict[tuple[str, str], int] = {}
            for shard, lanes in self.control.lanes(self.store.shards).items():
                for lane in lanes:
                    labels = (lane_control(lane), hold_reason(lane, paused))
                    held[labels] = held.get(labels, 0) + self.control.held_count(shard, lane)
        except ZDelayError as exc:
            logger.warning("Metrics scrape could not read the held entries: %s", exc)
            return
        for labels, count in sorted(held.items()):
            family.add_metric(list(labels), count)
        yield family
