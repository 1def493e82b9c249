"""Helpers of the dashboard tests: a served dashboard and a headless Chromium.

The browser is Debian's ``chromium`` (``make install`` installs it), driven by
Playwright's Python package through ``executable_path``: Playwright never
downloads a browser of its own here.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

from celery import Celery
from werkzeug.serving import make_server

from celery_zdelay.config import get_config
from celery_zdelay.store import Store
from celery_zdelay.web import Dashboard, create_app

CHROMIUM = os.environ.get("ZDELAY_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
#: Set to a directory (e.g. docs/_static) to keep the screenshots the tests take.
SCREENSHOTS = os.environ.get("ZDELAY_WEB_SCREENSHOTS")


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


@contextmanager
def chromium(*args: str) -> Iterator[Any]:
    """A headless Chromium launched by Playwright with CHROMIUM_ARGS and *args*."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=chromium_path(), headless=True, args=[*CHROMIUM_ARGS, *args]
        )
        try:
            yield launched
        finally:
            launched.close()


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


def chromium_path() -> str:
    """Return the system Chromium, failing (never skipping) when it is missing."""
    if not Path(CHROMIUM).exists() and shutil.which("chromium") is None:
        raise AssertionError(
            f"{CHROMIUM} is missing: run make install (it runs apt-get install -y chromium)."
        )
    return CHROMIUM if Path(CHROMIUM).exists() else str(shutil.which("chromium"))


def open_store(app: Celery) -> Store:
    return Store(get_config(app))


def make_dead_letter(store: Store, task_id: str, reason: str) -> None:
    """Move a parked entry to the dead-letter set, as the companion does when it refuses one."""
    keys = store.keys(store.shard_of(task_id))
    payload = store.client.hget(keys.msg, task_id)
    assert payload is not None, task_id
    died_ms = store.time_ms()
    store.client.zrem(keys.due, task_id)
    store.client.hdel(keys.msg, task_id)
    record = json.dumps({"reason": reason, "due_ms": died_ms, "companion": "test"})
    store.client.hset(keys.dead_msg, task_id, record.encode() + b"\n" + payload)
    store.client.zadd(keys.dead, {task_id: died_ms})


def screenshot(page: Any, name: str, tmp_path: Path) -> Path:
    """Take a screenshot of the viewport; keep it in SCREENSHOTS when that is set."""
    target = Path(SCREENSHOTS) if SCREENSHOTS else tmp_path
    target.mkdir(parents=True, exist_ok=True)
    path = target / name
    for attempt in range(3):
        try:
            page.screenshot(path=str(path))
            break
        except Exception as exc:  # Chromium under load: "Unable to capture screenshot"
            if attempt == 2 or "Unable to capture screenshot" not in str(exc):
                raise
            page.wait_for_timeout(500)
    assert path.stat().st_size > 1000
    return path
