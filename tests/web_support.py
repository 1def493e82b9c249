"""Helpers of the dashboard tests: a served dashboard, raw requests, CSRF tokens.

The headless Chromium they drive is in ``tests/support/browser.py``.
"""

from __future__ import annotations

import http.client
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlencode, urlsplit

from celery import Celery
from werkzeug.serving import make_server

from celery_zdelay.config import get_config
from celery_zdelay.store import Store
from celery_zdelay.web import Dashboard, create_app


class Served:
    """A dashboard served on a free loopback port by a threaded Werkzeug server."""

    def __init__(self, wsgi: Any, dashboard: Dashboard) -> None:
        self.dashboard = dashboard
        self.server = make_server("127.0.0.1", 0, wsgi, threaded=True)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Served:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)
        self.dashboard.close()


@contextmanager
def serve(celery_app: Celery, *, actions: bool = True, wrap: Any = None) -> Iterator[Served]:
    dashboard = create_app(celery_app, actions=actions)
    with Served(wrap(dashboard) if wrap else dashboard, dashboard) as served:
        yield served


def raw_request(
    url: str,
    method: str,
    path: str,
    *,
    headers: dict[str, str] | None = None,
    form: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], str]:
    """Send one request over a real socket with exactly these headers (Host included).

    Returns (status, headers in lower case, body). urllib would put its own
    Host and follow redirects; an attacker's request is sent as it is.
    """
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30)
    try:
        body = urlencode(form).encode() if form is not None else None
        sent = {"Host": parts.netloc, **(headers or {})}
        if body is not None:
            sent["Content-Type"] = "application/x-www-form-urlencoded"
            sent["Content-Length"] = str(len(body))
        connection.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for name, value in sent.items():
            connection.putheader(name, value)
        connection.endheaders(body)
        reply = connection.getresponse()
        received = {name.lower(): value for name, value in reply.getheaders()}
        return reply.status, received, reply.read().decode(errors="replace")
    finally:
        connection.close()


def cookie_of(headers: dict[str, str]) -> str:
    """Return the ``name=value`` of the CSRF cookie a response set."""
    value = headers.get("set-cookie", "")
    assert value.startswith("zdelay_csrf="), headers
    return value.split(";", 1)[0]


def token_in(html: str) -> str:
    """Return the CSRF token of the first form in *html*."""
    found = re.search(r'name="csrf_token" value="([0-9a-f]+)"', html)
    assert found is not None, html[:500]
    return found.group(1)


def open_store(app: Celery) -> Store:
    return Store(get_config(app))
