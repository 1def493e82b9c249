"""How ``status``, ``periodic list`` and the metrics show periodic schedules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._format import utc
from ..store import Store
from .api import ScheduleInfo, schedules_in
from .store import PeriodicStore

__all__ = [
    "STATUS_SCHEDULES",
    "StatusSchedules",
    "counts_text",
    "schedule_json",
    "schedule_lines",
    "status_schedules",
    "unserved_lines",
    "unserved_problems",
]


#: How many schedules ``zdelay status`` shows: all of them up to this many,
#: else this many of the soonest to run, and how many more are stored
#: (``periodic list`` shows them all). So status costs the same with 100,000
#: schedules as with 50. "Soonest" is the planner's order (the visits zset):
#: a schedule whose next run is more than an hour ahead is looked at half an
#: hour to an hour before it (``PARK_LEAD_MS``), so among those the order is
#: within that half hour.
STATUS_SCHEDULES = 50


@dataclass(frozen=True)
class StatusSchedules:
    """What ``zdelay status`` shows of the periodic schedules."""

    #: Schedules stored, and paused among them.
    stored: int
    paused: int
    #: All of them, by name, or the :data:`STATUS_SCHEDULES` soonest to run.
    shown: list[ScheduleInfo]

    @property
    def active(self) -> int:
        """Schedules stored and not paused (what ``status --check`` wants served)."""
        return max(self.stored - self.paused, 0)


def status_schedules(store: Store) -> StatusSchedules:
    """Return the schedules ``zdelay status`` shows, read for what it shows."""
    periodic = PeriodicStore(store)
    stored, paused, soonest = periodic.overview(STATUS_SCHEDULES)
    _, shown = schedules_in(periodic, None if stored <= STATUS_SCHEDULES else soonest)
    if stored <= STATUS_SCHEDULES:
        # Everything was read: count from it (a paused name of a removed
        # schedule is not counted).
        stored, paused = len(shown), sum(1 for info in shown if info.paused)
    return StatusSchedules(stored=stored, paused=paused, shown=shown)


def unserved_problems(store: Store) -> list[str]:
    """What ``status --check`` reports: one line per configured entry no companion serves."""
    return [
        f"periodic task {name!r} is not served: {reason}"
        for name, reason in sorted(PeriodicStore(store).unserved().items())
    ]


def unserved_lines(unserved: dict[str, str]) -> list[str]:
    """Return two lines per entry no companion serves, for people."""
    lines = []
    for name, reason in sorted(unserved.items()):
        lines += [f"{name}  [not served]", f"    {reason}"]
    return lines


def schedule_json(info: ScheduleInfo) -> dict[str, Any]:
    """Return one schedule as ``periodic list --json`` and ``status --json`` show it."""
    return {
        "name": info.name,
        "display_name": info.display_name,
        "task": info.task,
        "schedule": info.schedule,
        "source": info.source,
        "missed": info.missed,
        "paused": info.paused,
        "version": info.version,
        "next_run_ms": info.next_run_ms,
        "last_run_ms": info.last_run_ms,
        "last_run_lateness_ms": info.last_run_lateness_ms,
        "last_run_id": info.last_run_id,
        "overlap": info.overlap,
        "counts": info.counts,
        "args": info.args,
        "kwargs": info.kwargs,
        "options": info.options,
    }


def schedule_lines(infos: list[ScheduleInfo]) -> list[str]:
    """Return three lines per schedule for people, each under the name people know it by."""
    lines = []
    for info in infos:
        state = "paused" if info.paused else "active"
        next_run = utc(info.next_run_ms) if info.next_run_ms is not None else "-"
        last_run = utc(info.last_run_ms) if info.last_run_ms is not None else "-"
        late = (
            f" ({info.last_run_lateness_ms} ms late)"
            if info.last_run_lateness_ms is not None
            else ""
        )
        # A row's name in the admin first; its schedule name when another.
        stored_as = f", stored as {info.name}" if info.display_name != info.name else ""
        lines.append(
            f"{info.display_name}  {info.task}  {info.schedule}  "
            f"[{state}, {info.source}, v{info.version}{stored_as}]"
        )
        last_id = f" {info.last_run_id}" if info.last_run_id else ""
        lines.append(f"    next {next_run}  last {last_run}{late}{last_id}")
        lines.append("    " + counts_text(info))
    return lines


def counts_text(info: ScheduleInfo) -> str:
    """The tick counters of one schedule, as ``periodic list`` and the dashboard show them."""
    counts = info.counts
    return (
        f"missed {counts.get('missed', 0)}  skipped by overlap {counts.get('skipped_overlap', 0)}"
        f"  late {counts.get('late', 0)}"
    )
