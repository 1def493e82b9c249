"""A schedule that runs once, at one moment: django-celery-beat's clocked schedules.

Celery has no such schedule class (django-celery-beat's ``clocked`` needs
Django), so this is the one the companions build from a stored
``{"at": epoch ms}`` spec. The planner asks every schedule for "the next
occurrence after *t*" (:func:`~celery_zdelay.periodic.occurrences.next_after`):
before the moment it is the moment, from then on it is :data:`NEVER` away,
past any end date, so nothing more is parked.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from celery.schedules import BaseSchedule, schedstate

__all__ = ["NEVER", "ClockedAt"]

#: "No next occurrence": far enough that no horizon reaches it.
NEVER = timedelta(days=365 * 100)


class ClockedAt(BaseSchedule):  # type: ignore[misc]
    """Run once at *at_ms* (epoch milliseconds)."""

    def __init__(self, at_ms: int, nowfun: Any = None, app: Any = None) -> None:
        super().__init__(nowfun=nowfun, app=app)
        self.at_ms = int(at_ms)

    @property
    def at(self) -> datetime:
        """The moment, as an aware UTC datetime."""
        return datetime.fromtimestamp(self.at_ms / 1000, tz=timezone.utc)

    def remaining_estimate(self, last_run_at: datetime) -> timedelta:
        """Time from *last_run_at* to the moment, or :data:`NEVER` once it is reached."""
        if last_run_at < self.at:
            return self.at - last_run_at
        return NEVER

    def is_due(self, last_run_at: datetime | None) -> schedstate:
        """Due once the moment has come, unless a run at or after it is recorded."""
        ran = last_run_at is not None and self.maybe_make_aware(last_run_at) >= self.at
        if ran:
            return schedstate(is_due=False, next=NEVER.total_seconds())
        left = (self.at - self.now()).total_seconds()
        return schedstate(is_due=left <= 0, next=max(left, 0.0) or NEVER.total_seconds())

    def __repr__(self) -> str:
        return f"<clocked at {self.at.isoformat()}>"

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.__class__, (self.at_ms, self.nowfun))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClockedAt) and other.at_ms == self.at_ms

    def __hash__(self) -> int:
        return hash(self.at_ms)
