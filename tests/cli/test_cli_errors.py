"""``celery -A proj zdelay`` when the store is not there or not what it
should be: exit codes, messages that say the fix, a companion that waits
for its store. ``test_cli.py`` has the commands themselves.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery

from celery_zdelay.cli import (
    EXIT_CONFIG,
    EXIT_OK,
    EXIT_UNAVAILABLE,
)
from celery_zdelay.testing import RedisServer, free_port
from tests.conftest import AppFactory
from tests.helpers import CeleryProcess
from tests.support.cli import run

pytestmark = pytest.mark.timeout(90)


# -- errors -------------------------------------------------------------------------------


def test_an_unreachable_store_exits_69_naming_it_without_the_password(
    make_test_app: AppFactory,
) -> None:
    port = free_port()
    app = make_test_app(
        conf={
            "zdelay_redis_url": f"redis://:s3cret@127.0.0.1:{port}/0",
            "zdelay_retry_policy": {"max_retries": 0},
        }
    )

    for args in (["status"], ["list"], ["cancel", "x"], ["dead", "list"]):
        result = run(app, *args)
        assert result.exit_code == EXIT_UNAVAILABLE, args
        assert f"127.0.0.1:{port}" in result.stderr
        assert "s3cret" not in result.output


def test_an_invalid_setting_exits_78(make_test_app: AppFactory) -> None:
    app = make_test_app(conf={"zdelay_shards": 0})

    result = run(app, "status")

    assert result.exit_code == EXIT_CONFIG
    assert "zdelay_shards must be an integer from 1 to 1024" in result.stderr


# -- the companion through store outages, at start too --------------------------------------


def test_a_companion_started_before_its_store_waits_for_it_then_runs(
    make_test_app: AppFactory, processes: list[CeleryProcess]
) -> None:
    # The docs say the companion keeps running through outages; it exited 69
    # at once when the store was down at start.
    server = RedisServer(port=free_port())
    app = make_test_app(broker=f"{server.url}/0", conf={"zdelay_redis_url": f"{server.url}/0"})
    process = CeleryProcess(app, "zdelay", "-l", "INFO").start()
    processes.append(process)
    try:
        process.wait_for_log("The companion starts when the store answers")
        server.start()
        process.wait_for_log("The store answers again: starting the companion.", timeout=60)
        process.wait_for_log(" started: ")

        server.kill()
        process.wait_for_log("Store unreachable, retrying with backoff")
        server.start()
        process.wait_for_log("Store and broker answer again: releasing", timeout=60)
    finally:
        code = process.terminate()
        server.stop()
    assert code == EXIT_OK


# -- messages that say the fix --------------------------------------------------------------


@pytest.fixture
def locked_redis() -> Iterator[RedisServer]:
    """A private Redis whose default user needs the password "sekret"."""
    server = RedisServer().start()
    client = server.client()
    client.config_set("requirepass", "sekret")
    client.close()
    yield server
    server.stop()


def _plain_app(url: str) -> Celery:
    return Celery("messages", broker=url, set_as_current=False)


def test_a_database_the_server_does_not_have_is_a_clean_configuration_error(
    redis_server: RedisServer,
) -> None:
    # Regression: /99 printed a 40-line traceback and exited 1.
    result = run(_plain_app(f"{redis_server.url}/99"), "status")

    assert result.exit_code == EXIT_CONFIG
    assert "names database 99, which that Redis does not have" in result.stderr
    assert "Traceback" not in result.output


def test_a_wrong_password_is_called_a_wrong_password(locked_redis: RedisServer) -> None:
    url = f"redis://:wrong@127.0.0.1:{locked_redis.port}/0"

    result = run(_plain_app(url), "status")

    assert result.exit_code == EXIT_UNAVAILABLE
    assert "refused the password" in result.stderr
    assert "Check that Redis is running" not in result.stderr
    assert "wrong" not in result.stderr.replace("is wrong", "")  # the password stays hidden


def test_a_missing_password_is_asked_for_in_plain_words(locked_redis: RedisServer) -> None:
    # Regression: redis-py's "HELLO must be called with the client already
    # authenticated..." was shown as is.
    result = run(_plain_app(f"{locked_redis.url}/0"), "status")

    assert result.exit_code == EXIT_UNAVAILABLE
    assert "requires a password, and none is given" in result.stderr
    assert "HELLO" not in result.stderr


def test_an_unreachable_store_is_one_sentence_per_period() -> None:
    # Regression: "Connection refused.." (redis-py's period, then ours).
    result = run(_plain_app(f"redis://127.0.0.1:{free_port()}/0"), "status")

    assert result.exit_code == EXIT_UNAVAILABLE
    assert "Connection refused. Check that Redis is running" in result.stderr
    assert ".." not in result.stderr
