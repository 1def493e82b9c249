"""The pytest plugin of celery-zdelay: the ``zdelay`` fixture.

Registered through the ``pytest11`` entry point, so installing celery-zdelay
is enough. The fixture binds the test's Celery app to a test store and lets
the test fast-forward what it parks (see :mod:`celery_zdelay.testing` and
``docs/testing.rst``)::

    def test_unpaid_order_is_cancelled(zdelay):
        order = place_order()
        zdelay.advance(30 * 60)
        assert Order.objects.get(pk=order.pk).status == "cancelled"

Configuration (all optional):

``--zdelay-redis-url`` / ini ``zdelay_redis_url``
    Redis to park in during tests. Unset: a private ``redis-server`` is
    started for the session (one per pytest-xdist worker) and stopped after.
``zdelay_app`` (ini)
    The Celery app, as ``"package.module:app"``. Unset: the ``celery_app``
    fixture, if one is defined. Or override the ``zdelay_app`` fixture.

Nothing here runs unless a test asks for the fixture: the plugin costs other
test suites nothing.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from celery import Celery

    from .fastforward import FastForward

__all__ = [
    "pytest_addoption",
    "zdelay",
    "zdelay_app",
    "zdelay_key_prefix",
    "zdelay_redis_url",
]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("celery-zdelay", "celery-zdelay: fast-forward parked tasks")
    group.addoption(
        "--zdelay-redis-url",
        dest="zdelay_redis_url",
        default=None,
        metavar="URL",
        help="Redis the zdelay fixture parks in (default: a private redis-server "
        "started for the session).",
    )
    parser.addini(
        "zdelay_redis_url",
        "Redis the zdelay fixture parks in (default: a private redis-server).",
        default="",
    )
    parser.addini(
        "zdelay_app",
        "The Celery app the zdelay fixture binds, as 'package.module:app' "
        "(default: the celery_app fixture).",
        default="",
    )


@pytest.fixture(scope="session")
def zdelay_redis_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """URL of the Redis the ``zdelay`` fixture parks in.

    ``--zdelay-redis-url`` or the ``zdelay_redis_url`` ini value; without
    either, a private ``redis-server`` (started now, stopped at the end of
    the session; one per pytest-xdist worker).
    """
    url = request.config.getoption("zdelay_redis_url") or request.config.getini("zdelay_redis_url")
    if url:
        yield str(url)
        return
    from .redis_server import RedisServer

    with RedisServer() as server:
        yield f"{server.url}/0"


@pytest.fixture(scope="session")
def zdelay_key_prefix() -> str:
    """Key prefix of this test process: one per pytest-xdist worker and session."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    return f"zdelay-test-{worker}-{secrets.token_hex(4)}"


@pytest.fixture
def zdelay_app(request: pytest.FixtureRequest) -> Celery:
    """The Celery app the ``zdelay`` fixture binds; override it to choose one.

    Default: the app named by the ``zdelay_app`` ini value, else the
    ``celery_app`` fixture.
    """
    path = request.config.getini("zdelay_app")
    if path:
        from celery.utils.imports import symbol_by_name

        app: Celery = symbol_by_name(str(path))
        return app
    try:
        found: Celery = request.getfixturevalue("celery_app")
    except pytest.FixtureLookupError:
        pytest.fail(
            "The zdelay fixture needs your Celery app. Set zdelay_app = "
            '"proj.celery:app" in the [pytest] configuration, or define a '
            "zdelay_app (or celery_app) fixture that returns it.",
            pytrace=False,
        )
    return found


@pytest.fixture
def zdelay(zdelay_app: Any, zdelay_redis_url: str, zdelay_key_prefix: str) -> Iterator[FastForward]:
    """Parked tasks of the test's Celery app, and a clock to release them.

    ``zdelay.parked()`` lists them; ``zdelay.advance(seconds)`` and
    ``zdelay.release_due(now=...)`` release what falls due, through the
    companion's code; ``zdelay.clear()`` drops them. Under
    ``task_always_eager`` delayed calls are parked too, and released tasks
    run in the test as a worker would run them. Everything parked is
    deleted when the test ends.
    """
    from .fastforward import FastForward

    with FastForward(zdelay_app, redis_url=zdelay_redis_url, key_prefix=zdelay_key_prefix) as ff:
        yield ff
