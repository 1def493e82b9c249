"""``celery -A proj zdelay``: run the companion, and inspect or steer the store.

The commands only parse options and wire the pieces together; the work is
done by :mod:`celery_zdelay.companion`, :mod:`celery_zdelay.steering`,
:mod:`celery_zdelay.store.admin` and :mod:`celery_zdelay.companion.metrics`, and the
printing by :mod:`celery_zdelay._views`. One module per group of commands:
:mod:`.companion` (the ``zdelay`` group itself), :mod:`.inspect` (status,
list), :mod:`.steer` (cancel, reschedule), :mod:`.dead`, :mod:`.limit` (limit,
pause, resume); what they share is in :mod:`._base`. Another package adds
its group at the end of this file: one import and one ``zdelay.add_command``
line.
"""

from __future__ import annotations

from . import dead, inspect, limit, steer  # noqa: F401  (each registers its commands)
from ._base import (
    _CONTEXT,
    EXIT_CHECK_FAILED,
    EXIT_CONFIG,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    ZDelayCommand,
    ZDelayGroup,
    _echo_json,
    _exit_codes,
    _json_option,
)
from .companion import zdelay

__all__ = [
    "EXIT_CHECK_FAILED",
    "EXIT_CONFIG",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "_CONTEXT",
    "ZDelayCommand",
    "ZDelayGroup",
    "_echo_json",
    "_exit_codes",
    "_json_option",
    "zdelay",
]


def _add_subcommand_groups() -> None:
    # Imported here: the group modules build on the helpers above.
    from ..periodic.cli import periodic
    from ..web.cli import web

    zdelay.add_command(periodic)
    # The dashboard (celery_zdelay.web); its extra is imported only when it runs.
    zdelay.add_command(web)


_add_subcommand_groups()
