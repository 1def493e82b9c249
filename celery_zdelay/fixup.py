"""The Celery fix-up of celery-zdelay: what importing it does to Celery apps, existing and future.

Every app gets a transparent task sender (:mod:`celery_zdelay.transparent`)
and the worker bootstep (:mod:`celery_zdelay.worker`), so that setting
``zdelay_threshold`` is enough, and a forgotten companion is reported. Apps
created afterwards get them through a Celery fix-up: Celery applies its
``BUILTIN_FIXUPS`` to every new app (the Django fix-up is one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .transparent import hook_sender
from .worker import add_bootstep

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["fixup", "install_everywhere"]

#: The fix-up Celery applies to every app created after celery_zdelay is imported.
_FIXUP = "celery_zdelay.fixup:fixup"


def fixup(app: Celery) -> None:
    """Celery fix-up: hook *app* while Celery creates it.

    Celery calls it before the app's configuration can be read, so it only
    arranges what happens later.
    """
    hook_sender(app)
    add_bootstep(app)


def install_everywhere() -> None:
    """Hook the apps that exist, and have Celery hook every app created later."""
    from celery.app import base

    base.BUILTIN_FIXUPS.add(_FIXUP)
    try:
        from celery._state import _get_active_apps
    except ImportError:  # pragma: no cover - every supported Celery has it
        return
    for app in list(_get_active_apps()):
        fixup(app)
