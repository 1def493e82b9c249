"""What the companion says when it starts: where it releases from and to,
with passwords hidden, and a loud warning when Redis can lose parked tasks."""

from __future__ import annotations

import pytest

from celery_zdelay.testing import RedisServer
from tests.conftest import AppFactory

pytestmark = pytest.mark.timeout(60)


def test_an_evicting_redis_gets_a_loud_warning_at_start(
    make_test_app: AppFactory, companion
) -> None:
    with RedisServer(maxmemory="100mb", maxmemory_policy="allkeys-lru") as evicting:
        app = make_test_app(conf={"zdelay_redis_url": f"{evicting.url}/0"})
        process = companion(app)
        process.wait_for_log("Redis eviction policy is allkeys-lru; parked tasks can be evicted")
        assert "WARNING" in process.log().split("eviction policy")[0].rsplit("\n", 1)[-1]


def test_a_redis_without_persistence_gets_a_warning_at_start(app, companion) -> None:
    process = companion(app)
    process.wait_for_log("Redis persistence is off")


def test_the_start_line_hides_passwords(make_test_app: AppFactory, companion) -> None:
    with RedisServer() as protected:
        with protected.client() as admin:
            admin.config_set("requirepass", "hunter2-secret")
        url = f"redis://:hunter2-secret@127.0.0.1:{protected.port}/0"
        app = make_test_app(broker=url, conf={"zdelay_redis_url": url})
        process = companion(app)
        line = next(line for line in process.log().splitlines() if " started: " in line)
        assert f"store redis://:**@127.0.0.1:{protected.port}/0" in line
        assert "handoff on" in line
        assert "hunter2-secret" not in process.log()
