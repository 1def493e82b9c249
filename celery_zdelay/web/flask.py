"""Mount the dashboard in a Flask application.

::

    from celery_zdelay.web.flask import mount
    mount(flask_app, celery_app, "/zdelay", actions=True)

The dashboard is a separate WSGI application dispatched by Werkzeug's
``DispatcherMiddleware``, so Flask's own views, blueprints and
``before_request`` hooks do not run for it: protect the prefix where the
rest of the site is protected (a reverse proxy, or *wrap*). The dashboard
checks the ``Host`` of every request and the origin of every action itself,
as it does standalone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from celery import Celery
from werkzeug.middleware.dispatcher import DispatcherMiddleware

from ..errors import ConfigurationError
from .app import Dashboard, create_app

__all__ = ["mount"]

logger = logging.getLogger(__name__)


def mount(
    flask_app: Any,
    celery_app: Celery,
    prefix: str = "/zdelay",
    *,
    actions: bool = False,
    secret_key: str | bytes | None = None,
    wrap: Callable[[Dashboard], Any] | None = None,
    allowed_hosts: Iterable[str] | None = None,
    trusted_origins: Iterable[str] = (),
) -> Dashboard:
    """Serve the dashboard of *celery_app* under *prefix* of *flask_app*.

    *secret_key* defaults to the Flask app's ``SECRET_KEY``. *wrap* takes the
    dashboard and returns the WSGI application to mount, e.g. an
    authentication middleware (:class:`~celery_zdelay.web.security.BasicAuth`).
    *allowed_hosts* defaults to the Flask app's ``TRUSTED_HOSTS`` when set,
    else the loopback names; *trusted_origins* as for
    :func:`~celery_zdelay.web.create_app`.
    """
    mounted_at = prefix.rstrip("/")
    if not mounted_at.startswith("/"):
        # DispatcherMiddleware matches paths starting with "/": any other
        # prefix (and "/" itself, stripped to "") would never be served.
        raise ConfigurationError(
            f"Mount the dashboard under a path prefix such as '/zdelay', not {prefix!r}."
        )
    key = secret_key if secret_key is not None else flask_app.config.get("SECRET_KEY")
    if allowed_hosts is None:
        allowed_hosts = flask_app.config.get("TRUSTED_HOSTS") or None
    dashboard = create_app(
        celery_app,
        actions=actions,
        secret_key=key,
        allowed_hosts=allowed_hosts,
        trusted_origins=trusted_origins,
    )
    if actions and wrap is None:
        logger.warning(
            "The dashboard at %s has actions and no wrap=: Flask's own login checks do not "
            "run for it, so whoever reaches the prefix can cancel and purge parked tasks "
            "unless a reverse proxy authenticates it.",
            mounted_at,
        )
    mounted = wrap(dashboard) if wrap is not None else dashboard
    flask_app.wsgi_app = DispatcherMiddleware(flask_app.wsgi_app, {mounted_at: mounted})
    return dashboard
