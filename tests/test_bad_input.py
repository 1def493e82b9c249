"""Bad input gets a clear error that says what to do, and nothing half-written."""

from __future__ import annotations

import subprocess
import sys

import pytest
import redis
from celery import Celery, group
from kombu.exceptions import EncodeError

import celery_zdelay
from celery_zdelay.testing import free_port
from tests.conftest import AppFactory
from tests.helpers import ROOT
from tests.project import app_env

pytestmark = pytest.mark.timeout(60)


def test_a_non_serializable_argument_raises_encode_error_and_parks_nothing(
    app: Celery, redis_client: redis.Redis
) -> None:
    with pytest.raises(EncodeError):
        app.tasks["tests.record"].apply_delayed((object(),), countdown=10)
    assert redis_client.keys("{zdelay*") == []


def test_one_bad_member_of_a_group_parks_none_of_it(app: Celery, redis_client: redis.Redis) -> None:
    record = app.tasks["tests.record"]
    with pytest.raises(EncodeError):
        celery_zdelay.apply_delayed(
            group(record.s(1), record.s(object()), record.s(3)), countdown=10
        )
    assert redis_client.keys("{zdelay*") == []


def test_an_unreachable_store_raises_a_zdelay_error_naming_the_url_without_password(
    make_test_app: AppFactory,
) -> None:
    port = free_port()
    app = make_test_app(
        conf={
            "zdelay_redis_url": f"redis://:s3cret@127.0.0.1:{port}/0",
            "zdelay_retry_policy": {"max_retries": 1, "interval_start": 0.01},
        }
    )
    with pytest.raises(celery_zdelay.StoreUnavailableError) as caught:
        app.tasks["tests.record"].apply_delayed((1,), countdown=10)
    message = str(caught.value)
    assert f"127.0.0.1:{port}" in message
    assert "s3cret" not in message
    assert isinstance(caught.value, celery_zdelay.ZDelayError)


@pytest.mark.parametrize(
    ("setting", "value", "expected"),
    [
        ("zdelay_batch_size", "big", "zdelay_batch_size must be an integer"),
        ("zdelay_batch_size", 0, "zdelay_batch_size must be an integer from 1"),
        ("zdelay_lease_seconds", -1, "zdelay_lease_seconds must be a number"),
        ("zdelay_key_prefix", "a{b}", "zdelay_key_prefix must be"),
        ("zdelay_redis_url", "http://x", "zdelay_redis_url must be a redis://"),
        ("zdelay_shards", 0, "zdelay_shards must be an integer"),
        (
            "zdelay_batchsize",
            10,
            "Unknown setting zdelay_batchsize. Did you mean zdelay_batch_size?",
        ),
    ],
)
def test_an_invalid_setting_is_named(
    make_test_app: AppFactory, setting: str, value: object, expected: str
) -> None:
    app = make_test_app(conf={setting: value})
    with pytest.raises(celery_zdelay.ConfigurationError, match=expected.replace("?", r"\?")):
        app.tasks["tests.record"].apply_delayed((1,), countdown=10)


def test_the_companion_refuses_to_start_with_an_invalid_setting(
    make_test_app: AppFactory,
) -> None:
    app = make_test_app(conf={"zdelay_lease_seconds": "soon"})
    completed = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.project.worker_app", "zdelay"],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", **app_env(app)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 78, completed.stderr
    assert "zdelay_lease_seconds must be a number of seconds" in completed.stderr


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"countdown": 5, "eta": "2030-01-01T00:00:00"}, "not both"),
        ({}, "needs countdown="),
        ({"countdown": "soon"}, "countdown must be a number"),
        ({"countdown": float("nan")}, "countdown must be a number"),
        ({"eta": "tomorrow"}, "eta must be a datetime"),
        ({"countdown": 5, "producer": object()}, "producer= is not used"),
    ],
)
def test_a_bad_delay_is_refused_before_anything_is_parked(
    app: Celery, redis_client: redis.Redis, kwargs: dict[str, object], expected: str
) -> None:
    with pytest.raises(celery_zdelay.ConfigurationError, match=expected):
        app.tasks["tests.record"].apply_delayed((1,), **kwargs)
    assert redis_client.keys("{zdelay*") == []
