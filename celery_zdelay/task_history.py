"""``celery_zdelay.history()``: did it fire, when, and who cancelled it?

What happened to a task id, as the store recorded it
(``zdelay_history_seconds`` after its last event; 0 records nothing).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import celery

from ._format import duration
from .app_state import store_for
from .names import validate_task_id
from .store import Store
from .store.history import HistoryLine, read_history

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["HistoryEvent", "describe", "event_json", "history", "history_in"]


@dataclass(frozen=True)
class HistoryEvent:
    """One event of a task's history.

    ``event`` is ``"parked"``, ``"rescheduled"``, ``"held"``,
    ``"released"``, ``"cancelled"``, ``"dead"``, ``"requeued"`` or
    ``"purged"``; ``at`` when (an aware UTC datetime, Redis clock). The
    other fields are set where they apply, else None.
    """

    event: str
    at: datetime
    #: Who: the companion that released it; the ``by=`` of a cancel, when
    #: given; the control that held it (``queue:<q>``, ``task:<name>``).
    by: str | None = None
    #: Released: ms after its due time (Redis clock).
    late_ms: int | None = None
    #: Held: ``"pause"``, ``"rate_limit"`` or ``"concurrency"``; cancelled: ``"id"``, ``"tag"``,
    #: ``"matching"`` (other filters), ``"replaced"`` (by a keyed park) or
    #: ``"withdrawn"`` (a periodic occurrence), ``"stale"`` (dropped by a companion
    #: past its ``max_late``); dead: the dead letter's reason.
    reason: str | None = None
    #: Parked: which call, ``"plain"``, ``"keyed"``, ``"bulk"`` or ``"periodic"``
    #: (an occurrence of a periodic schedule).
    call: str | None = None
    #: Parked and rescheduled: the due time it was given.
    due: datetime | None = None


def history(task_id: str, *, app: Celery | None = None) -> list[HistoryEvent]:
    """Return what happened to *task_id*, oldest first; [] if nothing is recorded.

    Kept ``zdelay_history_seconds`` after the last event (at most the last
    50 events of an id). Parked (when, which call, due when), rescheduled,
    held (why), released (by which companion, how late), cancelled (how,
    by whom), dead-lettered (why), requeued, purged.
    """
    task_id = validate_task_id(task_id, done="looked up")
    app = app if app is not None else celery.current_app._get_current_object()
    return history_in(store_for(app), task_id)


def history_in(store: Store, task_id: str) -> list[HistoryEvent]:
    """:func:`history` read from *store* (the dashboard's and the CLI's own)."""
    return [_event(line) for line in read_history(store, task_id)]


def describe(event: HistoryEvent) -> str:
    """Return what *event* says beside its name, for people (the CLI, the dashboard).

    ``plain call, due 2025-06-01T12:30:03Z``, ``pause (queue:emails)``,
    ``by <companion>, 12ms late``, ``tag, by alice``, the dead letter's reason.
    """
    parts: list[str] = []
    if event.call:
        parts.append(f"{event.call} call")
    if event.due is not None:
        parts.append(f"due {event.due.strftime('%Y-%m-%dT%H:%M:%SZ')}")
    if event.event == "held":
        return f"{event.reason or '?'} ({event.by})" if event.by else event.reason or ""
    if event.event == "dead":
        return event.reason or ""
    if event.reason:
        parts.append(event.reason)
    if event.by:
        parts.append(f"by {event.by}")
    if event.late_ms is not None:
        # Negative: released that long ahead (zdelay_release_ahead_seconds),
        # for the worker's ETA timer to start it at its due time.
        parts.append(f"{duration(event.late_ms)} {'ahead' if event.late_ms < 0 else 'late'}")
    return ", ".join(parts)


def event_json(event: HistoryEvent) -> dict[str, Any]:
    """Return *event* as JSON fields (times as ISO 8601 UTC; fields that do not apply: null)."""
    return {
        "event": event.event,
        "at": event.at.isoformat(timespec="milliseconds"),
        "by": event.by,
        "late_ms": event.late_ms,
        "reason": event.reason,
        "call": event.call,
        "due": event.due.isoformat(timespec="milliseconds") if event.due else None,
    }


def _event(line: HistoryLine) -> HistoryEvent:
    at = datetime.fromtimestamp(line.at_ms / 1000, tz=timezone.utc)
    fields = [*line.fields, "", ""]
    if line.event == "parked":
        return HistoryEvent("parked", at, call=fields[1] or None, due=_time(_int(fields[0])))
    if line.event == "rescheduled":
        return HistoryEvent("rescheduled", at, due=_time(_int(fields[0])))
    if line.event == "held":
        return HistoryEvent("held", at, reason=fields[0] or None, by=fields[1] or None)
    if line.event == "released":
        return HistoryEvent("released", at, by=fields[0] or None, late_ms=_int(fields[1]))
    if line.event == "cancelled":
        return HistoryEvent("cancelled", at, reason=fields[0] or None, by=fields[1] or None)
    if line.event == "dead":
        return HistoryEvent("dead", at, reason=_dead_reason(fields[0]))
    return HistoryEvent(line.event, at)


def _int(text: str) -> int | None:
    # A release ahead is negative ms late (zdelay_release_ahead_seconds).
    return int(text) if text.removeprefix("-").isdigit() else None


def _time(ms: int | None) -> datetime | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, tz=timezone.utc)


def _dead_reason(raw: str) -> str | None:
    """The reason of a dead letter's record (its JSON as stored, when unreadable)."""
    try:
        reason = json.loads(raw)["reason"]
    except (ValueError, KeyError, TypeError):
        return raw or None
    return str(reason)
