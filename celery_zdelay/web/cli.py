"""``celery -A proj zdelay web``: serve the dashboard on its own.

Binds 127.0.0.1 unless told otherwise, and is read-only unless ``--actions``
is given. ``--auth user:password`` asks for HTTP basic authentication;
``--auth-header X-Forwarded-User`` lets in what a reverse proxy has
authenticated; actions without either need ``--no-auth``, said out loud.
Only the loopback names and the bound address are served as ``Host``
(``--allowed-host`` adds more): that is what defeats DNS rebinding, where
a page of another site has the browser reach 127.0.0.1 under its own name.
The web extra is imported only when this command runs.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import click
from celery.bin.base import CeleryCommand, CeleryOption

from ..cli.companion import zdelay

__all__ = ["web"]

logger = logging.getLogger(__name__)

_EPILOG = """\b
Examples:
  celery -A proj zdelay web                               read-only, http://127.0.0.1:8080
  celery -A proj zdelay web --port 9000 --actions --auth ops:$ZDELAY_WEB_PASSWORD
  celery -A proj zdelay web --bind 0.0.0.0 --auth-header X-Forwarded-User \\
      --allowed-host ops.example.com                       behind a proxy
  celery -A proj zdelay web --actions --no-auth            a laptop, knowingly

\b
Set ZDELAY_WEB_SECRET to sign CSRF tokens with a fixed key (default: a new
key per start, which logs browsers' open forms out of their actions).
"""


@zdelay.command(cls=CeleryCommand, epilog=_EPILOG, context_settings={"max_content_width": 100})
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
@click.option(
    "--no-auth",
    "no_auth",
    is_flag=True,
    cls=CeleryOption,
    help_group="Security Options",
    help="Allow --actions without --auth or --auth-header: anyone who reaches the port "
    "can cancel and purge.",
)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    metavar="NAME",
    cls=CeleryOption,
    help_group="Security Options",
    help="Also serve requests for this Host (repeatable; .example.com: its subdomains too). "
    "Default: localhost, 127.0.0.1, ::1 and the --bind address.",
)
@click.option(
    "--trusted-origin",
    "trusted_origins",
    multiple=True,
    metavar="URL",
    cls=CeleryOption,
    help_group="Security Options",
    help="Accept actions from this origin besides the dashboard's own host (repeatable), "
    "e.g. https://ops.example.com behind a proxy that rewrites Host.",
)
@click.pass_context
def web(
    ctx: click.Context,
    port: int,
    bind: str,
    actions: bool,
    auth: str | None,
    auth_header: str | None,
    no_auth: bool,
    allowed_hosts: tuple[str, ...],
    trusted_origins: tuple[str, ...],
) -> None:
    """Serve the web dashboard of what is parked."""
    user, _, password = (auth or "").partition(":")
    if auth is not None and not (user and password):
        # An empty password would let in anyone who knows (or guesses) the user.
        raise click.BadParameter("use USER:PASSWORD, neither of them empty", param_hint="--auth")
    if auth is not None and auth_header is not None:
        raise click.UsageError("Give --auth or --auth-header, not both.")
    authenticated = auth is not None or auth_header is not None
    if no_auth and authenticated:
        raise click.UsageError("Give --no-auth or --auth/--auth-header, not both.")
    if actions and not authenticated and not no_auth:
        # Loopback is no boundary: every local process, and every web page
        # the operator opens (DNS rebinding), reaches 127.0.0.1.
        raise click.UsageError(
            "--actions without --auth or --auth-header lets anything that reaches the "
            "port cancel, reschedule and purge. Add --auth USER:PASSWORD, or --no-auth "
            "to choose that knowingly."
        )
    try:
        from werkzeug.serving import make_server

        from . import create_app
        from .security import LOOPBACK_HOSTS, BasicAuth, ProxyHeaderAuth
    except ImportError as exc:
        click.echo(f"Error: {exc.name} is missing: pip install 'celery-zdelay[web]'", err=True)
        ctx.exit(78)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    hosts = [*LOOPBACK_HOSTS, *allowed_hosts]
    if bind not in ("0.0.0.0", "::", ""):
        hosts.append(bind)
    dashboard = create_app(
        ctx.obj.app,
        actions=actions,
        secret_key=os.environ.get("ZDELAY_WEB_SECRET"),
        allowed_hosts=hosts,
        trusted_origins=trusted_origins,
    )
    wsgi: Any = dashboard
    if auth is not None:
        wsgi = BasicAuth(dashboard, user, password)
    elif auth_header is not None:
        wsgi = ProxyHeaderAuth(dashboard, auth_header)
    if actions and no_auth:
        logger.warning(
            "ACTIONS WITHOUT AUTHENTICATION (--no-auth): any local user or process that "
            "reaches %s:%s can cancel, reschedule, requeue and purge parked tasks.",
            bind,
            port,
        )
    elif not authenticated and bind not in ("127.0.0.1", "localhost", "::1"):
        logger.warning(
            "The dashboard listens on %s without authentication: anyone who reaches the "
            "port sees what is parked%s. Use --auth or --auth-header.",
            bind,
            " and can cancel it" if actions else "",
        )
    server = make_server(bind, port, wsgi, threaded=True)
    click.echo(
        f"celery-zdelay dashboard on http://{bind}:{server.server_port}/ "
        f"({'actions enabled' if actions else 'read-only'}); serving the hosts "
        f"{', '.join(hosts)}; Ctrl-C stops it.",
        err=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        dashboard.close()
