"""Mount the dashboard in a Flask application.

::

    from celery_zdelay.web.flask import mount
    mount(flask_app, celery_app, "/zdelay", actions=True)

The dashboard is a separate WSGI application dispatched by Werkzeug's
``DispatcherMiddleware``, so Flask's own views, blueprints and
``before_request`` hooks do not run for it: protect the prefix where the
rest of the site is protected (a reverse proxy, or *wrap*).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery import Celery
from werkzeug.middleware.dispatcher import DispatcherMiddleware

from ..errors import ConfigurationError
from .app import Dashboard, create_app

__all__ = ["mount"]


def mount(
    flask_app: Any,
    celery_app: Celery,
    prefix: str = "/zdelay",
    *,
    actions: bool = False,
    secret_key: str | bytes | None = None,
    wrap: Callable[[Dashboard], Any] | None = None,
) -> Dashboard:
    """Serve the dashboard of *celery_app* under *prefix* of *flask_app*.

    *secret_key* defaults to the Flask app's ``SECRET_KEY``. *wrap* takes the
    dashboard and returns the WSGI application to mount, e.g. an
    authentication middleware (:class:`~celery_zdelay.web.security.BasicAuth`).
    """
    mounted_at = prefix.rstrip("/")
    if not mounted_at.startswith("/"):
        # DispatcherMiddleware matches paths starting with "/": any other
        # prefix (and "/" itself, stripped to "") would never be served.
        raise ConfigurationError(
            f"Mount the dashboard under a path prefix such as '/zdelay', not {prefix!r}."
        )
    key = secret_key if secret_key is not None else flask_app.config.get("SECRET_KEY")
    dashboard = create_app(celery_app, actions=actions, secret_key=key)
    mounted = wrap(dashboard) if wrap is not None else dashboard
    flask_app.wsgi_app = DispatcherMiddleware(flask_app.wsgi_app, {mounted_at: mounted})
    return dashboard
