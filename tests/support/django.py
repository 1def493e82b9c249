"""Django for the tests of the Django integration: a migrated database, an app of Django tasks.

``django_db`` is a fixture (this module is loaded as a pytest plugin by
``tests/conftest.py``); :func:`django_task_app` builds the Celery app.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from celery import Celery

from celery_zdelay.testing import RedisServer
from tests.project import close_app

__all__ = ["django_db", "django_task_app"]


@pytest.fixture(scope="module")
def django_db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Django on tests/django_project with a SQLite file of this process, migrated.

    When another project already set Django up in this process (the
    example project's tests), its database is used: these tests need only
    the auth app's tables, which both projects have.
    """
    import django
    from django.conf import settings
    from django.core.management import call_command
    from django.db import connections

    if not settings.configured:
        from tests.django_project import settings as project

        values = {name: getattr(project, name) for name in dir(project) if name.isupper()}
        database = tmp_path_factory.mktemp("django") / "db.sqlite3"
        values["DATABASES"] = {"default": {**project.DATABASES["default"], "NAME": str(database)}}
        settings.configure(**values)
    django.setup()
    call_command("migrate", verbosity=0, interactive=False)
    yield
    connections.close_all()


@contextmanager
def django_task_app(redis_server: RedisServer, main: str) -> Iterator[Celery]:
    """An app whose tasks are celery_zdelay.contrib.django.Task, on the test Redis.

    It has one task, ``shop.welcome``, that returns its argument.
    """
    app = Celery(
        main,
        broker=f"{redis_server.url}/0",
        task_cls="celery_zdelay.contrib.django:Task",
        set_as_current=False,
    )
    app.conf.zdelay_redis_url = f"{redis_server.url}/0"

    @app.task(name="shop.welcome", shared=False)
    def welcome(group_id: int) -> int:
        return group_id

    try:
        yield app
    finally:
        gc.collect()
        close_app(app)
