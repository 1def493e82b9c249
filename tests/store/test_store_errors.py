"""Redis errors reach every caller as celery-zdelay's own, translated once in ``store/``.

A refusal that is the server's state (out of memory, read-only, busy with a
script) is ``transient``: the companion waits it out and releases afterwards,
and a producer's message says what to do. One that is the call's (a key of
another type) is not.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
import redis

from celery_zdelay import StoreRefusedError, StoreUnavailableError
from celery_zdelay.companion import Companion
from celery_zdelay.store.client import store_errors
from celery_zdelay.testing import RedisServer
from tests.conftest import AppFactory
from tests.helpers import wait_for
from tests.support.logs import error_lines

pytestmark = pytest.mark.timeout(120)

#: Runs until the Unix time in ARGV[1] without writing: SCRIPT KILL ends it.
BUSY_LOOP = "local stop = tonumber(ARGV[1]) while tonumber(redis.call('TIME')[1]) < stop do end"


def test_a_store_busy_with_a_script_pauses_releases_and_tells_producers_to_wait(
    make_test_app: AppFactory, broker_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="celery_zdelay")
    with RedisServer() as store_server:
        app = make_test_app(
            broker=f"{broker_server.url}/0", conf={"zdelay_redis_url": f"{store_server.url}/0"}
        )
        add = app.tasks["tests.add"]
        ids = [add.apply_delayed((i, i), countdown=0).id for i in range(10)]
        companion = Companion(app)
        # Given another client runs a script longer than busy-reply-threshold
        admin = store_server.client()
        admin.config_set("lua-time-limit", 50)
        busy = threading.Thread(
            target=_run_busy_script, args=(store_server, time.time() + 60), daemon=True
        )
        busy.start()
        wait_for(lambda: _is_busy(store_server), message="the store busy with a script")

        thread = threading.Thread(target=companion.run, daemon=True)
        thread.start()
        try:
            # Then the companion says why releases wait, and what ends the wait
            wait_for(lambda: error_lines(caplog, "busy running a script") >= 2, timeout=60)
            assert thread.is_alive()
            assert broker_server.client(0).llen("celery") == 0

            # ... and a producer hears it is the server's state, and what to do
            with pytest.raises(StoreRefusedError, match="busy running a script") as refused:
                add.apply_delayed((1, 1), countdown=600)
            assert refused.value.transient
            assert "SCRIPT KILL" in str(refused.value)

            # When the script ends, the companion releases what was due
            admin.script_kill()
            busy.join(timeout=30)
            wait_for(lambda: broker_server.client(0).llen("celery") == len(ids), timeout=60)
            assert thread.is_alive()
        finally:
            companion.stop()
            thread.join(timeout=30)
            companion.store.close()


def _run_busy_script(server: RedisServer, until: float) -> None:
    client = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=None)
    try:
        client.eval(BUSY_LOOP, 0, int(until))
    except redis.exceptions.ResponseError:
        pass  # killed by the test: the expected end
    finally:
        client.close()


def _is_busy(server: RedisServer) -> bool:
    try:
        server.client().ping()
    except redis.exceptions.ResponseError as exc:
        return str(exc).startswith("BUSY")
    return False


def test_a_store_out_of_memory_is_transient_for_every_caller(
    make_test_app: AppFactory,
) -> None:
    with RedisServer(maxmemory_policy="noeviction") as server:
        app = make_test_app(conf={"zdelay_redis_url": f"{server.url}/0"})
        app.tasks["tests.add"].apply_delayed((1, 1), countdown=600)
        client = server.client()
        client.config_set("maxmemory", 1)

        # A write refused for want of memory: the caller may wait for memory
        with pytest.raises(StoreRefusedError, match="out of memory") as refused:
            app.tasks["tests.add"].apply_delayed((2, 2), countdown=600)
        assert refused.value.transient
        with (
            pytest.raises(StoreRefusedError, match="out of memory") as raw,
            store_errors(server.url),
        ):
            client.set("x", "y")
        assert raw.value.transient
        client.config_set("maxmemory", 0)


def test_a_refusal_that_is_the_call_s_fault_is_not_transient() -> None:
    with RedisServer() as server:
        client = server.client()
        client.set("not-a-list", "a string")
        with pytest.raises(StoreRefusedError) as refused, store_errors(server.url):
            client.lpush("not-a-list", "x")
        assert not refused.value.transient
        assert "WRONGTYPE" in str(refused.value)


def test_an_unreachable_store_is_transient_and_says_repeating_is_safe() -> None:
    with RedisServer() as server:
        url = server.url
    client = redis.Redis.from_url(url, socket_connect_timeout=1)
    with (
        pytest.raises(StoreUnavailableError, match="repeating it is safe") as down,
        store_errors(url),
    ):
        client.ping()
    assert down.value.transient
    client.close()
