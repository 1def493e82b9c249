"""``celery -A proj zdelay``: run the companion, and inspect or steer the store.

The commands only parse options and wire the pieces together; the work is
done by :mod:`celery_zdelay.companion`, :mod:`celery_zdelay.steering`,
:mod:`celery_zdelay.store.admin`, :mod:`celery_zdelay.adoption` and
:mod:`celery_zdelay.companion.metrics`, and the
printing by :mod:`.views`. One module per group of commands:
:mod:`.companion` (the ``zdelay`` group itself), :mod:`.inspect` (status,
list), :mod:`.steer` (cancel, reschedule), :mod:`.dead`, :mod:`.history`,
:mod:`.adopt` (ETA tasks sent the native way, into the store), :mod:`.limit`
(limit, pause, resume), and the ``periodic`` and ``web`` groups of their packages;
what they share is in :mod:`._base`. Every one registers its commands the
same way, with ``@zdelay.command`` or ``@zdelay.group``: a new one is a module
with those decorators and one import line below.
"""

from __future__ import annotations

# Each module hangs its commands on the zdelay group when imported.
from ..periodic import cli as periodic_cli  # noqa: F401
from ..web import cli as web_cli  # noqa: F401
from . import adopt, dead, history, inspect, limit, steer  # noqa: F401
from ._base import (
    EXIT_CHECK_FAILED,
    EXIT_CONFIG,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    ZDelayCommand,
    ZDelayGroup,
)
from .companion import zdelay

__all__ = [
    "EXIT_CHECK_FAILED",
    "EXIT_CONFIG",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "ZDelayCommand",
    "ZDelayGroup",
    "zdelay",
]
