"""Concurrency controls, parsed: what ``zdelay_concurrency`` accepts and which slots a task takes.

``app.conf.zdelay_concurrency = {"limit_key:tenant:*": 2, "task:proj.export": 1,
"queue:reports": 5}`` lets companions release at most that many tasks of
each control that were released and have not finished. A ``task:`` or
``queue:`` control counts all its tasks together; a ``limit_key:<glob>``
control counts each distinct limit key matching the glob on its own (the
key a task was parked with, carried in the ``zdelay_limit_key`` header:
``store.headers.LIMIT_KEY_HEADER``).

A *slot name* says which count a task takes a slot in: the control name, or
for a glob the control name, a space and the limit key (control names hold
no whitespace, so the first space splits them). The store keeps one record
per slot name (see :meth:`~celery_zdelay.store.control.ControlStore.take_slots`).
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import Any

from .errors import ConfigurationError
from .rates import control_name

__all__ = [
    "control_of_slot",
    "parse_concurrency",
    "slots_of",
]

_LIMIT_KEY = "limit_key:"


def parse_concurrency(value: Any, *, setting: str = "zdelay_concurrency") -> dict[str, int]:
    """Return ``zdelay_concurrency`` parsed: control name -> most released and not finished.

    Raises:
        ConfigurationError: not a dict, a name is not a control name, or a
            number is not a whole number of at least 1.
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigurationError(
            f"{setting} must be a dict of control name -> number of tasks, e.g. "
            f"{{'limit_key:tenant:*': 2, 'task:proj.export': 1}}, got {value!r}."
        )
    parsed: dict[str, int] = {}
    for key, number in value.items():
        name = control_name(key)
        if isinstance(number, bool) or not isinstance(number, int) or number < 1:
            raise ConfigurationError(
                f"{setting}[{key!r}] must be a whole number of tasks of at least 1 (how many "
                f"may be released and not finished at once), got {number!r}. To lift the "
                f"limit, remove the entry."
            )
        parsed[name] = number
    return parsed


def slots_of(
    controls: Mapping[str, int], *, task: str, queue: str | None, limit_key: Any
) -> list[tuple[str, int]]:
    """Return the slots a task takes, (slot name, most at once) each, in a fixed order.

    *queue* None means "any queue": the worker, which does not know which
    queue the companion saw, frees the task's slot in every queue control
    (freeing a slot a task does not hold changes nothing).
    """
    found: list[tuple[str, int]] = []
    for name in sorted(controls):
        kind, _, rest = name.partition(":")
        if (kind == "task" and rest == task) or (
            kind == "queue" and (queue is None or rest == queue)
        ):
            found.append((name, controls[name]))
        elif kind == "limit_key" and isinstance(limit_key, str) and fnmatchcase(limit_key, rest):
            found.append((f"{name} {limit_key}", controls[name]))
    return found


def control_of_slot(slot: str) -> str:
    """Return the control name a slot name counts under."""
    return slot.split(" ", 1)[0] if slot.startswith(_LIMIT_KEY) else slot
