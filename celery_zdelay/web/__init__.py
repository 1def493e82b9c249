"""A web dashboard of what is parked: ``celery_zdelay.web.create_app(app)``.

Needs the optional extra: ``pip install 'celery-zdelay[web]'`` (Jinja2 and
Werkzeug), imported only when the dashboard is built, so ``celery -A proj
zdelay`` works without it. The result is a plain WSGI application; mount it
in Django (:mod:`celery_zdelay.web.django`), in Flask
(:mod:`celery_zdelay.web.flask`), or run it alone with ``celery -A proj
zdelay web``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import Dashboard, create_app

__all__ = ["Dashboard", "create_app"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        app = importlib.import_module(".app", __name__)
    except ImportError as exc:
        if exc.name not in ("jinja2", "werkzeug"):
            raise
        from ..errors import ConfigurationError

        raise ConfigurationError(
            f"The dashboard needs {exc.name}: pip install 'celery-zdelay[web]'"
        ) from exc
    return getattr(app, name)
