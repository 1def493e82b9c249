"""Prometheus gauges of the periodic schedules, read from Redis at each scrape::

zdelay_periodic_next_run_timestamp_seconds{schedule}   next occurrence parked (absent: none)
zdelay_periodic_last_run_timestamp_seconds{schedule}   last occurrence released
zdelay_periodic_last_run_lateness_seconds{schedule}    how late it was released
zdelay_periodic_paused{schedule}                       1 when paused
zdelay_periodic_unserved{schedule}                     1 for a schedule no companion serves
zdelay_periodic_ticks_total{schedule,outcome}          ticks missed, skipped_overlap, late
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from ..errors import ZDelayError
from ..store import Store
from .store import PeriodicStore

__all__ = ["PeriodicCollector"]

logger = logging.getLogger(__name__)


class PeriodicCollector:
    """A Prometheus collector of the schedules stored in one store."""

    def __init__(self, store: Store, core: Any) -> None:
        self.periodic = PeriodicStore(store)
        self._core = core

    def _families(self) -> dict[str, Any]:
        gauge = self._core.GaugeMetricFamily
        label = ["schedule"]
        return {
            "next": gauge(
                "zdelay_periodic_next_run_timestamp_seconds",
                "Time of the next occurrence parked, per periodic schedule.",
                labels=label,
            ),
            "last": gauge(
                "zdelay_periodic_last_run_timestamp_seconds",
                "Time of the last occurrence released, per periodic schedule.",
                labels=label,
            ),
            "lateness": gauge(
                "zdelay_periodic_last_run_lateness_seconds",
                "How late the last occurrence was released, per periodic schedule.",
                labels=label,
            ),
            "paused": gauge(
                "zdelay_periodic_paused", "1 when the periodic schedule is paused.", labels=label
            ),
            "unserved": gauge(
                "zdelay_periodic_unserved",
                "1 for a periodic schedule no companion serves (a bad entry or row: "
                "zdelay periodic list says why).",
                labels=label,
            ),
            "ticks": self._core.CounterMetricFamily(
                "zdelay_periodic_ticks",
                "Ticks of a periodic schedule by outcome: missed (no companion or broker "
                "served it), skipped_overlap (the previous run was unfinished), late (released "
                "more than a second after its time).",
                labels=["schedule", "outcome"],
            ),
        }

    def describe(self) -> Iterator[Any]:
        yield from self._families().values()

    def collect(self) -> Iterator[Any]:
        from .api import schedules_in

        try:
            _, infos = schedules_in(self.periodic)
            unserved = self.periodic.unserved()
        except Exception as exc:
            if isinstance(exc, ZDelayError) and exc.transient:
                return  # the store is down: the store collector says so (zdelay_store_up)
            # Anything else is a fault to fix (a damaged key, a bug), not an
            # outage: say so rather than let the gauges vanish unexplained.
            logger.exception("Metrics scrape could not read the periodic schedules")
            return
        families = self._families()
        for info in infos:
            name = [info.name]
            families["paused"].add_metric(name, 1 if info.paused else 0)
            if info.next_run_ms is not None:
                families["next"].add_metric(name, info.next_run_ms / 1000)
            if info.last_run_ms is not None:
                families["last"].add_metric(name, info.last_run_ms / 1000)
            if info.last_run_lateness_ms is not None:
                families["lateness"].add_metric(name, info.last_run_lateness_ms / 1000)
            for outcome, ticks in info.counts.items():
                families["ticks"].add_metric([info.name, outcome], ticks)
        for unserved_name in sorted(unserved):
            families["unserved"].add_metric([unserved_name], 1)
        yield from families.values()
