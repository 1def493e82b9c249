"""The metrics endpoint listens on loopback unless told to listen wider.

It has no authentication and names schedules, shards and queues, so it
binds as the dashboard does: 127.0.0.1 by default, ``--metrics-addr`` for
a Prometheus on another host. Reaching it at another loopback address
(127.0.0.2, which a socket bound to every interface answers on) tells the
two apart without leaving the machine.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable

import pytest
from celery import Celery

from celery_zdelay.testing import free_port
from tests.helpers import CeleryProcess

pytestmark = pytest.mark.timeout(90)


def _answers(host: str, port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
            return bool(response.status == 200)
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ConnectionRefusedError):
            return False
        raise


def test_the_companion_serves_metrics_on_loopback_by_default(
    app: Celery, companion: Callable[..., CeleryProcess]
) -> None:
    """Catches the old default in ``cli/companion.py``: ``default="0.0.0.0"``."""
    port = free_port()
    process = companion(app, "--metrics-port", str(port))
    assert f"Serving Prometheus metrics on 127.0.0.1:{port}/metrics" in process.log()
    assert _answers("127.0.0.1", port)
    assert not _answers("127.0.0.2", port)


def test_metrics_addr_binds_wider_when_asked(
    app: Celery, companion: Callable[..., CeleryProcess]
) -> None:
    port = free_port()
    companion(app, "--metrics-port", str(port), "--metrics-addr", "0.0.0.0")
    assert _answers("127.0.0.2", port)
