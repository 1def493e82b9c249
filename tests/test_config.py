"""Settings are read once, validated, and read again when they change."""

from __future__ import annotations

import types

import pytest
from celery import Celery

import celery_zdelay
from celery_zdelay.cli import EXIT_CONFIG
from celery_zdelay.config import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_MAX_RUN_SECONDS,
    get_config,
    unknown_settings,
)
from celery_zdelay.errors import ConfigurationError
from tests.support.cli import run

pytestmark = pytest.mark.timeout(30)


def _app(**conf: object) -> Celery:
    app = Celery("config-test", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.update(conf)
    return app


def test_defaults_and_the_broker_url_as_the_store() -> None:
    config = get_config(_app())
    assert config.redis_url == "redis://127.0.0.1:1/0"
    assert config.key_prefix == "zdelay"
    assert config.batch_size == DEFAULT_BATCH_SIZE
    assert config.lease_ms == 30_000
    assert config.threshold_ms is None


def test_a_setting_set_anew_after_first_use_is_read_again() -> None:
    app = _app(zdelay_key_prefix="first")
    get_config(app)  # Celery finishes configuring the app on first access
    first = get_config(app)
    assert first.key_prefix == "first"
    assert get_config(app) is first  # cached while nothing changes

    app.conf.zdelay_key_prefix = "second"
    assert get_config(app).key_prefix == "second"
    app.conf.broker_url = "redis://127.0.0.1:2/3"
    assert get_config(app).redis_url == "redis://127.0.0.1:2/3"


def test_a_django_namespace_spells_settings_with_its_prefix() -> None:
    app = Celery("config-test", set_as_current=False)
    settings = types.SimpleNamespace(
        CELERY_BROKER_URL="redis://127.0.0.1:1/5",
        CELERY_ZDELAY_KEY_PREFIX="shop",
        CELERY_ZDELAY_SHARDS=4,
    )
    app.config_from_object(settings, namespace="CELERY")
    config = get_config(app)
    assert config.key_prefix == "shop"
    assert config.shards == 4
    assert config.redis_url == "redis://127.0.0.1:1/5"


def test_a_sentinel_broker_lends_its_master_name_to_the_store() -> None:
    app = _app(
        broker_url="sentinel://127.0.0.1:26379;sentinel://127.0.0.1:26380",
        broker_transport_options={"master_name": "mymaster"},
    )
    config = get_config(app)
    assert config.redis_url == "sentinel://127.0.0.1:26379;sentinel://127.0.0.1:26380"
    assert config.redis_options["master_name"] == "mymaster"


# -- no silent no-ops ---------------------------------------------------------


def test_a_broker_that_is_not_redis_needs_zdelay_redis_url(redis_server) -> None:
    # Regression: parking went silently into whatever Redis answered on
    # localhost:6379/0 (someone else's).
    app = Celery("rabbit", broker="amqp://guest:secret@127.0.0.1:1//", set_as_current=False)
    app.conf.task_cls = "celery_zdelay:Task"

    with pytest.raises(ConfigurationError) as excinfo:
        celery_zdelay.send_delayed(app, "proj.remind", countdown=60)

    message = str(excinfo.value)
    assert "set zdelay_redis_url" in message
    assert "secret" not in message
    app.conf.zdelay_redis_url = f"{redis_server.url}/0"
    result = celery_zdelay.send_delayed(app, "proj.remind", countdown=60)
    assert celery_zdelay.cancel(result.id, app=app)
    celery_zdelay.parking.store_for(app).close()


def test_the_missing_store_url_is_named_as_a_django_project_spells_it() -> None:
    app = Celery("config-test", set_as_current=False)
    settings = types.SimpleNamespace(CELERY_BROKER_URL="sqs://")
    app.config_from_object(settings, namespace="CELERY")

    config = get_config(app)
    with pytest.raises(ConfigurationError, match='CELERY_ZDELAY_REDIS_URL = "redis://'):
        _ = config.redis_url


def test_the_companion_refuses_to_start_without_a_store_url() -> None:
    app = Celery("rabbit", broker="amqp://127.0.0.1:1//", set_as_current=False)

    result = run(app)

    assert result.exit_code == EXIT_CONFIG
    assert "set zdelay_redis_url" in result.output


def test_a_misspelt_setting_is_named_with_the_namespace_spelling() -> None:
    # Regression: a Django user was told "Did you mean zdelay_threshold?".
    app = Celery("config-test", set_as_current=False)
    settings = types.SimpleNamespace(
        CELERY_BROKER_URL="redis://127.0.0.1:1/5", CELERY_ZDELAY_TRESHOLD=60
    )
    app.config_from_object(settings, namespace="CELERY")

    (message,) = unknown_settings(app)

    assert (
        "Unknown setting CELERY_ZDELAY_TRESHOLD. Did you mean CELERY_ZDELAY_THRESHOLD?" in message
    )
    assert "zdelay_threshold" not in message
    with pytest.raises(ConfigurationError, match="CELERY_ZDELAY_THRESHOLD"):
        get_config(app)


def test_a_misspelt_setting_of_a_plain_app_keeps_the_lowercase_spelling() -> None:
    (message,) = unknown_settings(_app(zdelay_treshold=60))

    assert "Did you mean zdelay_threshold?" in message


def test_the_companion_refuses_to_start_with_a_misspelt_setting() -> None:
    app = _app(zdelay_treshold=60)

    result = run(app)

    assert result.exit_code == EXIT_CONFIG
    assert "Unknown setting zdelay_treshold. Did you mean zdelay_threshold?" in result.output


# -- zdelay_key_hold_seconds, renamed zdelay_max_run_seconds ------------------------


def test_the_max_run_is_an_hour_by_default_and_set_by_its_name_without_a_warning() -> None:
    assert get_config(_app()).max_run_ms == DEFAULT_MAX_RUN_SECONDS * 1000 == 3_600_000
    # (warnings are errors here: a DeprecationWarning would fail this line)
    assert get_config(_app(zdelay_max_run_seconds=90)).max_run_ms == 90_000


def test_the_old_name_still_sets_the_max_run_and_warns_and_logs_the_new_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = _app(zdelay_key_hold_seconds=90)
    with pytest.warns(DeprecationWarning, match="zdelay_max_run_seconds") as warned:
        config = get_config(app)
    assert config.max_run_ms == 90_000
    (warning,) = warned
    assert str(warning.message) == (
        "zdelay_key_hold_seconds is deprecated: rename it to zdelay_max_run_seconds "
        "(same meaning, same value)."
    )
    assert str(warning.message) in caplog.text
    # Read again after a change: warned once per app (warnings are errors here)
    app.conf.zdelay_key_prefix = "other"
    assert get_config(app).max_run_ms == 90_000
    # Not reported as unknown, and checked as the new name is
    assert unknown_settings(app) == []
    with (
        pytest.warns(DeprecationWarning, match="zdelay_max_run_seconds"),
        pytest.raises(ConfigurationError) as bad,
    ):
        get_config(_app(zdelay_key_hold_seconds=-1))
    assert "zdelay_max_run_seconds must be a number of seconds" in str(bad.value)


def test_the_old_name_in_a_django_project_is_named_as_it_spells_it() -> None:
    app = Celery("config-test", set_as_current=False)
    settings = types.SimpleNamespace(
        CELERY_BROKER_URL="redis://127.0.0.1:1/5", CELERY_ZDELAY_KEY_HOLD_SECONDS=30
    )
    app.config_from_object(settings, namespace="CELERY")
    with pytest.warns(DeprecationWarning, match="rename it to CELERY_ZDELAY_MAX_RUN_SECONDS"):
        assert get_config(app).max_run_ms == 30_000
    assert unknown_settings(app) == []


def test_both_the_old_and_the_new_name_set_is_an_error_naming_both() -> None:
    app = _app(zdelay_key_hold_seconds=60, zdelay_max_run_seconds=90)
    with pytest.raises(ConfigurationError) as both:
        get_config(app)
    assert str(both.value) == (
        "zdelay_key_hold_seconds and zdelay_max_run_seconds are both set: "
        "zdelay_key_hold_seconds is the old name of zdelay_max_run_seconds. "
        "Keep zdelay_max_run_seconds only."
    )
