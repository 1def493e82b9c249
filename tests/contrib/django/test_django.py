"""``celery_zdelay.contrib.django.Task`` in a real Django project, real transactions.

Given a task parked with ``apply_delayed_on_commit`` inside a database
transaction, when the transaction commits, then the task is parked with the
id returned at call time; when it rolls back (or only its savepoint does),
then nothing is parked. Celery's own ``delay_on_commit`` and
``apply_async_on_commit`` keep working.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from celery import Celery

from celery_zdelay import StoreUnavailableError
from celery_zdelay.companion import Companion
from celery_zdelay.parking import store_for
from celery_zdelay.store.admin import ParkedTask, list_parked
from celery_zdelay.testing import RedisServer, free_port
from tests.support.clock import redis_ms
from tests.support.django import django_task_app

pytestmark = pytest.mark.timeout(60)


@contextmanager
def rolled_back() -> Iterator[None]:
    """A transaction (or savepoint) that rolls back when the block ends."""
    from django.db import transaction

    with transaction.atomic():
        yield
        transaction.set_rollback(True)


@pytest.fixture
def groups(django_db: None) -> Iterator[Any]:
    """The auth Group model; rows the test wrote are deleted afterwards."""
    from django.contrib.auth.models import Group

    yield Group
    Group.objects.filter(name__startswith="zdelay-").delete()


@pytest.fixture
def django_app(redis_server: RedisServer) -> Iterator[Celery]:
    """An app whose tasks are celery_zdelay.contrib.django.Task, on the test Redis."""
    with django_task_app(redis_server, "djangotest") as app:
        yield app


def _parked(app: Celery) -> list[ParkedTask]:
    """What is parked, in due order, as ``celery -A proj zdelay list`` shows it."""
    return list_parked(store_for(app)).entries


def test_a_committed_transaction_parks_the_task_with_the_id_returned_at_once(
    django_app: Celery, groups: Any, redis_client: redis.Redis
) -> None:
    from django.db import transaction

    welcome = django_app.tasks["shop.welcome"]
    # Given a task parked with a 30-minute countdown inside a transaction
    with transaction.atomic():
        group = groups.objects.create(name="zdelay-committed")
        result = welcome.apply_delayed_on_commit((group.pk,), countdown=1800)
        # Then its id is known at once, and nothing is parked before the commit
        assert result.id
        assert _parked(django_app) == []
        before_commit = redis_ms(redis_client)
    after_commit = redis_ms(redis_client)

    # And once committed it is parked, due 30 minutes after the commit
    (parked,) = _parked(django_app)
    assert (parked.task_id, parked.task) == (result.id, "shop.welcome")
    assert parked.argsrepr == repr((group.pk,))
    assert before_commit + 1_800_000 <= parked.due_ms <= after_commit + 1_800_000


def test_a_rolled_back_transaction_parks_nothing(
    django_app: Celery, groups: Any, redis_client: redis.Redis
) -> None:

    welcome = django_app.tasks["shop.welcome"]
    with rolled_back():
        group = groups.objects.create(name="zdelay-rolled-back")
        result = welcome.apply_delayed_on_commit((group.pk,), countdown=1800)

    assert result.id
    assert not groups.objects.filter(name="zdelay-rolled-back").exists()
    assert _parked(django_app) == []


def test_a_rolled_back_savepoint_drops_only_the_tasks_parked_inside_it(
    django_app: Celery, groups: Any, redis_client: redis.Redis
) -> None:
    from django.db import transaction

    welcome = django_app.tasks["shop.welcome"]
    with transaction.atomic():
        kept = groups.objects.create(name="zdelay-kept")
        outer = welcome.apply_delayed_on_commit((kept.pk,), countdown=60)
        with rolled_back():
            dropped = groups.objects.create(name="zdelay-dropped")
            welcome.apply_delayed_on_commit((dropped.pk,), countdown=60)

    assert [p.task_id for p in _parked(django_app)] == [outer.id]
    assert list(
        groups.objects.filter(name__startswith="zdelay-").values_list("name", flat=True)
    ) == ["zdelay-kept"]


def test_outside_a_transaction_the_task_is_parked_at_once(
    django_app: Celery, groups: Any, redis_client: redis.Redis
) -> None:
    welcome = django_app.tasks["shop.welcome"]
    result = welcome.apply_delayed_on_commit((1,), countdown=60, task_id="welcome-1")

    assert result.id == "welcome-1"
    assert [p.task_id for p in _parked(django_app)] == ["welcome-1"]


@pytest.mark.parametrize("robust", [False, True])
@pytest.mark.parametrize(
    "options",
    [{"key": ""}, {"key": "k", "on_key": "sometimes"}, {"tags": "order:42"}, {"on_key": "keep"}],
)
def test_a_bad_key_or_tag_is_refused_at_the_call_not_after_the_commit(
    django_app: Celery, groups: Any, options: dict[str, Any], robust: bool
) -> None:
    from django.db import transaction

    from celery_zdelay import ConfigurationError

    welcome = django_app.tasks["shop.welcome"]

    # Given a call with a bad key, tag or mode inside a transaction
    def transact() -> None:
        with transaction.atomic():
            group = groups.objects.create(name="zdelay-bad-key")
            welcome.apply_delayed_on_commit((group.pk,), countdown=60, robust=robust, **options)

    with pytest.raises(ConfigurationError):
        transact()

    # Then the call raised there, so the transaction rolled back and nothing was parked
    # (raised at the commit, the rows would be committed and, robust, the error only logged)
    assert not groups.objects.filter(name="zdelay-bad-key").exists()
    assert _parked(django_app) == []


def test_the_parked_task_is_released_to_the_broker_with_its_id(
    django_app: Celery, groups: Any, redis_client: redis.Redis
) -> None:
    from django.db import transaction

    welcome = django_app.tasks["shop.welcome"]
    with transaction.atomic():
        group = groups.objects.create(name="zdelay-released")
        result = welcome.apply_delayed_on_commit((group.pk,), countdown=0)

    with Companion(django_app) as companion:
        assert companion.release_due().released == 1
    (raw,) = redis_client.lrange("celery", 0, -1)
    assert json.loads(raw)["headers"]["id"] == result.id


def test_celerys_own_on_commit_methods_still_work(
    django_app: Celery, groups: Any, redis_client: redis.Redis
) -> None:
    from django.db import transaction

    welcome = django_app.tasks["shop.welcome"]
    with rolled_back():
        welcome.delay_on_commit(1)
    with transaction.atomic():
        assert welcome.delay_on_commit(2) is None
        welcome.apply_async_on_commit((3,))
        assert redis_client.llen("celery") == 0

    sent = [json.loads(raw)["headers"]["argsrepr"] for raw in redis_client.lrange("celery", 0, -1)]
    assert sorted(sent) == ["(2,)", "(3,)"]
    assert _parked(django_app) == []


def test_when_parking_fails_at_commit_the_data_is_committed_and_the_error_raised(
    django_app: Celery,
    groups: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from django.db import transaction

    nothing_listens = f"redis://127.0.0.1:{free_port()}/0"
    django_app.conf.update(zdelay_redis_url=nothing_listens, zdelay_retry_policy={"max_retries": 0})
    welcome = django_app.tasks["shop.welcome"]

    def create_and_park() -> None:
        with transaction.atomic():
            groups.objects.create(name="zdelay-raises")
            welcome.apply_delayed_on_commit((1,), countdown=60)

    with pytest.raises(StoreUnavailableError):
        create_and_park()
    assert groups.objects.filter(name="zdelay-raises").exists()

    # robust=True: Django logs the error and runs the commit's other callbacks.
    with caplog.at_level(logging.ERROR, logger="django.db.backends.base"), transaction.atomic():
        groups.objects.create(name="zdelay-robust")
        welcome.apply_delayed_on_commit((2,), countdown=60, robust=True)
    assert groups.objects.filter(name="zdelay-robust").exists()
    assert "shop.welcome[" in caplog.text
    assert "StoreUnavailableError" in caplog.text


# -- manage.py check ----------------------------------------------------------------


def _check(tmp_path: Any, **settings: object) -> subprocess.CompletedProcess[str]:
    """Run ``django-admin check`` on a project with celery-zdelay in INSTALLED_APPS."""
    lines = [
        'SECRET_KEY = "test"',
        'INSTALLED_APPS = ["celery_zdelay.contrib.django"]',
        *(f"{name} = {value!r}" for name, value in settings.items()),
    ]
    (tmp_path / "checked_settings.py").write_text("\n".join(lines) + "\n")
    return subprocess.run(
        [sys.executable, "-m", "django", "check", "--settings=checked_settings"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_manage_py_check_names_a_misspelt_setting_as_django_spells_it(tmp_path: Any) -> None:
    # Regression: a misspelt CELERY_ZDELAY_TRESHOLD passed manage.py check.
    result = _check(tmp_path, CELERY_BROKER_URL="redis://127.0.0.1:1/0", CELERY_ZDELAY_TRESHOLD=60)

    assert result.returncode == 1
    assert "celery_zdelay.E001" in result.stderr
    assert "Did you mean CELERY_ZDELAY_THRESHOLD?" in result.stderr


def test_manage_py_check_asks_for_the_store_when_the_broker_is_not_redis(tmp_path: Any) -> None:
    result = _check(tmp_path, CELERY_BROKER_URL="amqp://guest:guest@127.0.0.1:1//")

    assert result.returncode == 1
    assert "celery_zdelay.E002" in result.stderr
    assert "set CELERY_ZDELAY_REDIS_URL" in result.stderr


def test_manage_py_check_passes_a_working_configuration(tmp_path: Any) -> None:
    result = _check(
        tmp_path,
        CELERY_BROKER_URL="amqp://guest:guest@127.0.0.1:1//",
        CELERY_ZDELAY_REDIS_URL="redis://127.0.0.1:1/1",
        CELERY_ZDELAY_THRESHOLD=60,
    )

    assert result.returncode == 0, result.stderr
    assert "no issues" in result.stdout
