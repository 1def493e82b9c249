"""``celery -A proj zdelay web``: serve the dashboard on its own.

Binds 127.0.0.1 unless told otherwise, and is read-only unless ``--actions``
is given. ``--auth user:password`` asks for HTTP basic authentication;
``--auth-header X-Forwarded-User`` lets in what a reverse proxy has
authenticated. The web extra is imported only when this command runs.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import click
from celery.bin.base import CeleryCommand, CeleryOption

__all__ = ["web"]

logger = logging.getLogger(__name__)

_EPILOG = """\b
Examples:
  celery -A proj zdelay web                               read-only, http://127.0.0.1:8080
  celery -A proj zdelay web --port 9000 --actions --auth ops:$ZDELAY_WEB_PASSWORD
  celery -A proj zdelay web --bind 0.0.0.0 --auth-header X-Forwarded-User   behind a proxy

\b
Set ZDELAY_WEB_SECRET to sign CSRF tokens with a fixed key (default: a new
key per start, which logs browsers' open forms out of their actions).
"""


@click.command(cls=CeleryCommand, epilog=_EPILOG, context_settings={"max_content_width": 100})
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8080,
    show_default=True,
    cls=CeleryOption,
    help_group="Server Options",
    help="Port to listen on (0: any free port).",
)
@click.option(
    "--bind",
    default="127.0.0.1",
    show_default=True,
    cls=CeleryOption,
    help_group="Server Options",
    help="Address to listen on. Only loopback by default: put a proxy or --auth in front.",
)
@click.option(
    "--actions",
    is_flag=True,
    cls=CeleryOption,
    help_group="Dashboard Options",
    help="Allow cancel, run now, reschedule, requeue and purge (default: read-only).",
)
@click.option(
    "--auth",
    metavar="USER:PASSWORD",
    cls=CeleryOption,
    help_group="Security Options",
    help="Ask for HTTP basic authentication with this user and password.",
)
@click.option(
    "--auth-header",
    metavar="HEADER",
    cls=CeleryOption,
    help_group="Security Options",
    help="Let in only requests where the reverse proxy set HEADER (e.g. X-Forwarded-User).",
)
@click.pass_context
def web(
    ctx: click.Context,
    port: int,
    bind: str,
    actions: bool,
    auth: str | None,
    auth_header: str | None,
) -> None:
    """Serve the web dashboard of what is parked."""
    user, _, password = (auth or "").partition(":")
    if auth is not None and not (user and password):
        # An empty password would let in anyone who knows (or guesses) the user.
        raise click.BadParameter("use USER:PASSWORD, neither of them empty", param_hint="--auth")
    if auth is not None and auth_header is not None:
        raise click.UsageError("Give --auth or --auth-header, not both.")
    try:
        from werkzeug.serving import make_server

        from . import create_app
        from .security import BasicAuth, ProxyHeaderAuth
    except ImportError as exc:
        click.echo(f"Error: {exc.name} is missing: pip install 'celery-zdelay[web]'", err=True)
        ctx.exit(78)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    dashboard = create_app(
        ctx.obj.app, actions=actions, secret_key=os.environ.get("ZDELAY_WEB_SECRET")
    )
    wsgi: Any = dashboard
    if auth is not None:
        wsgi = BasicAuth(dashboard, user, password)
    elif auth_header is not None:
        wsgi = ProxyHeaderAuth(dashboard, auth_header)
    elif bind not in ("127.0.0.1", "localhost", "::1"):
        logger.warning(
            "The dashboard listens on %s without authentication: anyone who reaches the "
            "port sees what is parked%s. Use --auth or --auth-header.",
            bind,
            " and can cancel it" if actions else "",
        )
    server = make_server(bind, port, wsgi, threaded=True)
    click.echo(
        f"celery-zdelay dashboard on http://{bind}:{server.server_port}/ "
        f"({'actions enabled' if actions else 'read-only'}); Ctrl-C stops it.",
        err=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        dashboard.close()
