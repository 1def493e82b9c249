"""The read model: one :class:`ParkedTask`, its :class:`EntryState`, and how both are built.

Listing (``zdelay list``), lookup (:func:`celery_zdelay.lookup`), dead
letters (``zdelay dead list``), the dashboard and the testing plugin all
read a parked id as a :class:`ParkedTask`: they filter and format one
shape. Its state is worked out in one place, :func:`entry_state`, from
where the store found the id, and spelled one way: the values of
:class:`EntryState`.

The rows a scan reads (:class:`~.reading.ScannedEntry`, raw bytes) become
a :class:`ParkedTask` here (:func:`task_from_row`), as do dead letters
(:func:`dead_task`). Payloads are read only for their Celery headers: task
arguments are never decoded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import Enum
from typing import Any

from ..due_score import due_ms_of
from ..entry import parked_ms
from .control import HoldReasons, lane_control
from .marks import parse_record
from .reading import ScannedEntry, as_text, describe, optional_str
from .store import Store

__all__ = [
    "EntryState",
    "ParkedTask",
    "dead_task",
    "entry_state",
    "header_fields",
    "marks_fields",
    "task_from_row",
]


class EntryState(str, Enum):
    """The one state a task id the store knows is in.

    A ``str`` enum: ``task.state == "parked"`` holds, and JSON carries the
    value (``"in_flight"``).
    """

    #: Waiting in its shard's due set for its due time (or overdue, for a companion).
    PARKED = "parked"
    #: Due, and held back by a pause or a rate limit in its control's held set.
    HELD = "held"
    #: Claimed by a companion and not yet acknowledged (being published).
    IN_FLIGHT = "in_flight"
    #: Dead-lettered, with its reason.
    DEAD = "dead"

    def __str__(self) -> str:
        # The value, on every Python: str() of a str mixin enum names the
        # member ("EntryState.PARKED") before 3.11's StrEnum.
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @property
    def label(self) -> str:
        """The state in words, for people (``"in flight"``); :attr:`value` is for programs."""
        return _LABELS[self]


#: How the dashboard and the CLI's tables say each state.
_LABELS = {
    EntryState.PARKED: "parked",
    EntryState.HELD: "held",
    EntryState.IN_FLIGHT: "in flight",
    EntryState.DEAD: "dead",
}


def entry_state(*, due: bool, held_by: str | None, leased: bool, dead: bool) -> EntryState | None:
    """Return the state of an id from where the store found it; None when nowhere.

    *due*: in its due set; *held_by*: in that control's held set; *leased*:
    in the lease set; *dead*: in the dead-letter set. An id parked again
    after it died is in the due (or a held) set and the dead-letter set at
    once: it is parked, or held, since that is what runs next.
    """
    if held_by is not None:
        return EntryState.HELD
    if due:
        return EntryState.PARKED
    if leased:
        return EntryState.IN_FLIGHT
    if dead:
        return EntryState.DEAD
    return None


@dataclass(frozen=True)
class ParkedTask:
    """A task celery-zdelay holds: as :func:`celery_zdelay.lookup` returns it,
    and as listings, dead letters and the dashboard show it.

    Fields a reader cannot know for its state are None (``died_ms`` while
    parked, ``held_by`` unless held, ``lease_until_ms`` unless in flight).
    """

    #: The id of the parked entry (the first task of a parked chain).
    task_id: str
    #: ``"parked"`` (waiting for its due time, or overdue), ``"held"``
    #: (due, and held back by a pause or a rate limit: see :attr:`held_by`),
    #: ``"in_flight"`` (claimed by a companion, being published) or
    #: ``"dead"`` (dead-lettered): an :class:`EntryState`, equal to its value.
    state: EntryState
    #: When it is (or was) due, in epoch ms on the Redis clock; None if unknown.
    due_ms: int | None
    #: Task name; None when the message cannot be read (see :attr:`error`).
    task: str | None
    #: The queue (routing key) it is published to: the queue name on the default exchange.
    queue: str | None
    shard: int
    #: Why it was dead-lettered (``state == "dead"``), or why its message cannot be read.
    reason: str | None = None
    #: When it was parked, in epoch ms on the Redis clock; None when not
    #: recorded (parked whole, by ``zdelay_whole_messages``, or by an earlier
    #: release, which did not record it).
    parked_ms: int | None = None
    #: Its key (``apply_delayed(key=...)``), while it owns it; else None.
    key: str | None = None
    #: Its ``on_key`` mode, with :attr:`key`.
    on_key: str | None = None
    #: Its tags (``apply_delayed(tags=[...])``).
    tags: tuple[str, ...] = ()
    #: The control holding it back (``"queue:emails"``), when ``state == "held"``.
    held_by: str | None = None
    #: Why: ``"pause"``, ``"rate_limit"`` or ``"concurrency"``, when ``state == "held"``.
    held_reason: str | None = None
    #: Celery's ``argsrepr`` header: ``repr()`` of the positional arguments.
    argsrepr: str | None = None
    #: Celery's ``kwargsrepr`` header.
    kwargsrepr: str | None = None
    #: Celery's ``expires`` header (absolute ISO time), if the task has one.
    expires: str | None = None
    #: Why the message cannot be read, if it cannot (the companion
    #: dead-letters such an entry).
    error: str | None = None
    #: When the companion's lease on it ends, when ``state == "in_flight"``
    #: (epoch ms, Redis clock).
    lease_until_ms: int | None = None
    #: When it was dead-lettered, when ``state == "dead"`` (epoch ms, Redis clock).
    died_ms: int | None = None
    #: The companion that dead-lettered it, when ``state == "dead"``.
    companion: str | None = None
    #: Its Celery headers, as Celery wrote them (never its arguments).
    headers: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def in_flight(self) -> bool:
        """Whether a companion has claimed it and not yet acknowledged it."""
        return self.state is EntryState.IN_FLIGHT

    @property
    def due(self) -> datetime | None:
        """:attr:`due_ms` as an aware UTC datetime."""
        return _datetime(self.due_ms)

    @property
    def parked_at(self) -> datetime | None:
        """:attr:`parked_ms` as an aware UTC datetime."""
        return _datetime(self.parked_ms)


def _datetime(ms: int | None) -> datetime | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, tz=timezone.utc)


def task_from_row(
    store: Store,
    row: ScannedEntry,
    *,
    reasons: HoldReasons | None = None,
    lease_until_ms: int | None = None,
) -> ParkedTask:
    """Return the :class:`ParkedTask` of a row read from a due, held or lease set.

    *reasons* says why a control holds it (the pauses, read once per listing).
    """
    state = entry_state(due=not row.in_flight, held_by=row.held, leased=row.in_flight, dead=False)
    if state is None:  # pragma: no cover - a row is read from one of the three sets
        raise ValueError(f"{row.task_id}: a scanned row is due, held or in flight")
    headers, queue, error = describe(row.payload, store.templates(row.shard))
    return ParkedTask(
        task_id=row.task_id,
        state=state,
        due_ms=due_ms_of(row.score),
        task=optional_str(headers.get("task")),
        queue=queue,
        shard=row.shard,
        reason=error,
        parked_ms=parked_ms(row.payload),
        held_by=None if row.held is None else lane_control(row.held),
        held_reason=None if row.held is None else (reasons or HoldReasons(store))(row.held),
        error=error,
        lease_until_ms=lease_until_ms,
        **header_fields(headers),
        **marks_fields(row.record),
    )


def dead_task(
    store: Store,
    task_id: str,
    shard: int,
    died_ms: int,
    record: bytes | None,
    marks: bytes | None = None,
) -> ParkedTask:
    """Return the dead letter of *task_id* from its stored record (reason line, entry).

    *marks* is its key and tag record (``d:<id>`` in the index), if read.
    """
    reason: dict[str, Any] = {}
    payload: bytes | None = None
    if record is not None:
        reason_line, _, payload = bytes(record).partition(b"\n")
        try:
            parsed = json.loads(reason_line)
            reason = parsed if isinstance(parsed, dict) else {"reason": str(parsed)}
        except ValueError:
            reason = {"reason": reason_line.decode(errors="replace")}
    payload = payload or None
    headers, queue, error = describe(payload, store.templates(shard))
    due_ms = reason.get("due_ms")
    return ParkedTask(
        task_id=task_id,
        state=EntryState.DEAD,
        due_ms=int(due_ms) if isinstance(due_ms, (int, float)) else None,
        task=optional_str(headers.get("task")),
        queue=queue,
        shard=shard,
        reason=optional_str(reason.get("reason")) or error,
        parked_ms=parked_ms(payload),
        error=error,
        died_ms=died_ms,
        companion=optional_str(reason.get("companion")),
        **header_fields(headers),
        **marks_fields(marks),
    )


def header_fields(headers: Mapping[str, Any]) -> dict[str, Any]:
    """The header fields of a :class:`ParkedTask` (argsrepr, kwargsrepr, expires, headers)."""
    return {
        "argsrepr": optional_str(headers.get("argsrepr")),
        "kwargsrepr": optional_str(headers.get("kwargsrepr")),
        "expires": optional_str(headers.get("expires")),
        "headers": headers,
    }


def marks_fields(record: bytes | None) -> dict[str, Any]:
    """The key, on_key and tags fields of a :class:`ParkedTask`, from its index record."""
    if record is None:
        return {}
    marks = parse_record(as_text(record))
    return {"key": marks.key, "on_key": marks.on_key, "tags": marks.tags}
