"""The test Redis (:class:`celery_zdelay.testing.RedisServer`) restarts without
running anyone's finalisers while it is down.

A garbage collection inside :meth:`RedisServer.restart` runs ``__del__``
methods of whatever cyclic garbage there is, and some talk to the server
being restarted: Celery 5.3's ``AsyncResult.__del__`` unsubscribes from the
result backend, retries for 20 s and then raises. In the same thread as the
restart, those 20 s hold up the very restart it waits for (the state model's
Redis restart failed so in CI's oldest-dependencies run).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_zdelay.testing import RedisServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def collect_often() -> Iterator[None]:
    """The collector runs at (almost) every allocation, as it may by chance."""
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    yield
    gc.set_threshold(*threshold)


def test_no_finaliser_runs_while_a_restart_has_the_server_down(collect_often: None) -> None:
    server = RedisServer(appendonly="yes").start()
    # One try per ping: a finaliser that finds the server down says so at once.
    client = redis.Redis.from_url(server.url, retry=Retry(NoBackoff(), 0))
    answered: list[bool] = []
    making = True

    class Garbage:
        """A cycle only the collector frees; freeing it asks the server, and
        leaves a new one for the next collection while the test is making them."""

        def __init__(self) -> None:
            self.me = self

        def __del__(self) -> None:
            try:
                answered.append(bool(client.ping()))
            except redis.ConnectionError:
                answered.append(False)
            if making:
                Garbage()

    try:
        Garbage()
        server.restart()
        making = False
        gc.collect()
        gc.collect()
        assert answered, "the collector never ran a finaliser: the test proves nothing"
        assert all(answered), (
            f"{answered.count(False)} finalisers ran while the server was down "
            f"({len(answered)} in all)"
        )
    finally:
        making = False
        gc.collect()
        client.close()
        server.stop()
