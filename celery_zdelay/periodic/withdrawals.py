"""An occurrence its schedule took back is recorded as every cancel is.

A change, a removal or a pause of a schedule takes back the occurrences it
had parked (``define.lua``, ``pause.lua``, or later from the cancel set):
they never run. Like a cancel by id, each ends ``REVOKED`` in the result
backend, with a ``task-revoked`` event and a line in the audit log
(:func:`celery_zdelay.steering.announce_cancelled`), so that Flower and
``AsyncResult`` do not show it pending for ever.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..steering import announce_cancelled

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["WHY", "announcer"]

#: The audit line's reason.
WHY = " (withdrawn: its schedule was changed, paused or removed)"


def announcer(app: Celery, by: str | None) -> Callable[[list[str]], None]:
    """What :class:`~.store.PeriodicStore` calls with the ids it took back (``on_withdrawn``)."""

    def announce(task_ids: list[str]) -> None:
        announce_cancelled(app, task_ids, by, why=WHY)

    return announce
