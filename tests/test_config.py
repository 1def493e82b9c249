"""Settings are read once, validated, and read again when they change."""

from __future__ import annotations

import types

import pytest
from celery import Celery

from celery_zdelay.config import DEFAULT_BATCH_SIZE, get_config

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
