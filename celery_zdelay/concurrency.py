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
    "CONCURRENCY_SETTLE_MS",
    "control_of_slot",
    "effective_concurrency",
    "parse_concurrency",
    "slots_of",
]

#: How long a concurrency control set at run time for a name the settings do
#: not have waits before a companion applies it (ms, Redis clock). Workers
#: free the slots of such names only once they have read them, and read them
#: at most 0.5 s before a run ends (:func:`celery_zdelay.worker.release_slots`):
#: a slot taken later than this after the change is always freed.
CONCURRENCY_SETTLE_MS = 1_000


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
    (freeing a slot a task did not take changes nothing).
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


def effective_concurrency(
    config: Mapping[str, int],
    stored: Mapping[str, tuple[int | None, int]],
    *,
    now_ms: int,
) -> dict[str, int]:
    """Return the concurrency controls in force: *config*, overridden by those *stored*.

    *stored* is what was set at run time (:func:`celery_zdelay.set_concurrency`):
    name -> (most, or None where removed; Redis ms the name was first set).
    A number for a name *config* does not have applies
    :data:`CONCURRENCY_SETTLE_MS` after the name was first set (*now_ms*:
    the Redis clock): a worker that ends a task released under it has read
    the name by then. A later change of its number, or a removal, applies
    at once.
    """
    found = dict(config)
    for name, (most, first_ms) in stored.items():
        if most is None:
            found.pop(name, None)
        elif name in config or now_ms - first_ms >= CONCURRENCY_SETTLE_MS:
            found[name] = most
    return found


def control_of_slot(slot: str) -> str:
    """Return the control name a slot name counts under."""
    return slot.split(" ", 1)[0] if slot.startswith(_LIMIT_KEY) else slot
