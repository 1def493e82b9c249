"""What celery-zdelay does in a Celery worker: a start-up check, and the ETA a task sees.

A worker is where a forgotten companion or a misspelt setting would
otherwise go unnoticed: tasks are parked and never run, or transparent mode
is silently off. :class:`StartupCheck` logs each problem once, at start, and
never stops the worker.

A released message has no ``eta`` header: with one, Celery's worker would
hold it in its timer and raise its prefetch count for it (see
docs/transparent.rst, "The ETA a released task sees"). The ETA Celery would
have sent travels in the :data:`ETA_HEADER` header instead, and
:func:`restore_eta` puts it back into ``self.request.eta`` just before the
task runs, so task code sees what it would have seen without celery-zdelay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from celery import bootsteps, signals

from .config import unknown_settings
from .errors import ZDelayError

if TYPE_CHECKING:
    from celery import Celery

    from .entry import TaskMessage
    from .schedule import Due

__all__ = [
    "ETA_HEADER",
    "StartupCheck",
    "add_bootstep",
    "carry_eta",
    "restore_eta",
    "startup_problems",
]

logger = logging.getLogger(__name__)

#: Header of a parked message holding the ETA Celery would have sent (an
#: ISO 8601 string, as Celery's own ``eta`` header), while ``eta`` is None.
ETA_HEADER = "zdelay_eta"


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
    from .app_state import store_for
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


def carry_eta(app: Celery, messages: Iterable[TaskMessage], due: Due) -> None:
    """Put the ETA Celery would have sent for *due* into the :data:`ETA_HEADER` of *messages*.

    A message that has one already (transparent mode keeps the very string
    Celery wrote) keeps it. A countdown is counted from this host's clock
    and written in the app's time zone, as Celery writes an ``eta``; the
    release itself goes by the Redis clock.
    """
    eta_ms = due.ms if due.mode == "a" else time.time() * 1000 + due.ms
    eta = datetime.fromtimestamp(eta_ms / 1000, tz=app.timezone).isoformat()
    for message in messages:
        message.headers.setdefault(ETA_HEADER, eta)


@signals.task_prerun.connect(weak=False)  # type: ignore[untyped-decorator]
def restore_eta(task: Any = None, **_: Any) -> None:
    """Celery ``task_prerun`` receiver: give a released task its ETA back in ``request.eta``.

    Connected in every process that imports ``celery_zdelay``, for every
    app. The header is taken out of ``request.headers`` too: Celery copies
    those into the message of a ``retry()``, whose own ETA (or none) must
    not be overwritten by this one's when it runs.
    """
    request: Any = getattr(task, "request", None)
    # Celery's Context holds every message header as an attribute (and, on
    # Celery >= 5.3, the custom ones in request.headers as well).
    eta = getattr(request, "__dict__", {}).get(ETA_HEADER)
    if eta is None:
        return
    headers = request.headers
    if isinstance(headers, dict):
        headers.pop(ETA_HEADER, None)
    if request.eta is None:
        request.eta = eta
