"""What celery-zdelay checks when a Celery worker starts: a bootstep.

A worker is where a forgotten companion or a misspelt setting would
otherwise go unnoticed: tasks are parked and never run, or transparent mode
is silently off. :class:`StartupCheck` logs each problem once, at start, and
never stops the worker.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from celery import bootsteps

from .config import unknown_settings
from .errors import ZDelayError

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["StartupCheck", "add_bootstep", "startup_problems"]

logger = logging.getLogger(__name__)


def startup_problems(app: Celery) -> list[str]:
    """Return what a worker of *app* should warn about: unknown settings, no store, no companion.

    An app that does not use celery-zdelay (no ``zdelay_*`` setting, not its
    task class) gets no warning, though importing ``celery_zdelay`` hooks it.
    """
    if not _uses_zdelay(app):
        return []
    problems = unknown_settings(app)
    if problems:
        return problems
    from .parking import store_for
    from .store import admin

    try:
        warning = admin.no_companion_warning(store_for(app))
    except ZDelayError as exc:
        return [str(exc)]
    return [warning] if warning else []


def _uses_zdelay(app: Celery) -> bool:
    from .task import DelayedTaskMixin

    for key in list(app.conf.keys()):
        name = str(key).lower()
        if name.startswith(("zdelay_", "celery_zdelay_")):
            return True
    return isinstance(app.Task, type) and issubclass(app.Task, DelayedTaskMixin)


class StartupCheck(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker bootstep: log unknown ``zdelay_*`` settings and a missing companion."""

    label = "celery-zdelay startup check"

    def start(self, worker: Any) -> None:
        for problem in startup_problems(worker.app):
            logger.warning("%s", problem)


def add_bootstep(app: Celery) -> None:
    """Add :class:`StartupCheck` to the workers of *app* (once)."""
    app.steps["worker"].add(StartupCheck)
