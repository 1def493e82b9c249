"""Test setup of the shop: Django on an in-memory SQLite database, tasks eager.

The ``zdelay`` fixture comes from celery-zdelay's pytest plugin (installed
with the package). It needs to know the Celery app: the ``zdelay_app``
fixture below names it, with ``task_always_eager`` on, so released tasks
run in the test itself. No Redis needs to be configured: the plugin starts
a private ``redis-server`` for the test session.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import django
import pytest
from celery import Celery
from django.core.management import call_command

_database_before = os.environ.get("SHOP_DATABASE")
os.environ["SHOP_DATABASE"] = ":memory:"
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")
django.setup()
# Only because this repository runs other projects' tests in the same
# process: now that Django is set up, drop the variables again, lest Celery
# apps and worker subprocesses of other test modules turn into Django ones.
if _database_before is None:
    del os.environ["SHOP_DATABASE"]
else:
    os.environ["SHOP_DATABASE"] = _database_before
if os.environ.get("DJANGO_SETTINGS_MODULE") == "example_project.settings":
    del os.environ["DJANGO_SETTINGS_MODULE"]

from example_project import celery_app  # noqa: E402
from example_project.shop.models import Order  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _database() -> None:
    call_command("migrate", verbosity=0)


@pytest.fixture(autouse=True)
def _no_orders_left() -> Iterator[None]:
    # Tests commit for real (on_commit must fire), so they clean up after themselves.
    yield
    Order.objects.all().delete()


@pytest.fixture
def zdelay_app(monkeypatch: pytest.MonkeyPatch) -> Celery:
    """The shop's Celery app, bound by the zdelay fixture; tasks run eagerly."""
    monkeypatch.setitem(celery_app.conf, "task_always_eager", True)
    monkeypatch.setitem(celery_app.conf, "task_eager_propagates", True)
    # Shared tasks resolve against the current app. In a project there is
    # one; this repository's test run builds many apps in one process.
    celery_app.set_current()
    return celery_app
