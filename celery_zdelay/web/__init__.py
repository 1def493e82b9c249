"""A web dashboard of what is parked: ``celery_zdelay.web.create_app(app)``.

Needs the optional extra: ``pip install 'celery-zdelay[web]'`` (Jinja2 and
Werkzeug). The result is a plain WSGI application; mount it in Django
(:mod:`celery_zdelay.web.django`), in Flask (:mod:`celery_zdelay.web.flask`),
or run it alone with ``celery -A proj zdelay web``.
"""

from __future__ import annotations

try:
    import jinja2  # noqa: F401
    import werkzeug  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on what is installed
    from ..errors import ConfigurationError

    raise ConfigurationError(
        f"The dashboard needs {exc.name}: pip install 'celery-zdelay[web]'"
    ) from exc

from .app import Dashboard, create_app

__all__ = ["Dashboard", "create_app"]
