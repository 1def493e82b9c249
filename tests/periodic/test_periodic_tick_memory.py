"""An occurrence parked once is never parked again for an hour (issue 21).

``park_once`` remembers each occurrence it parked, by the Redis time it was
parked, and forgets it only an hour later: a companion that stalls between
reading a schedule and parking what follows it (GC, swap, a frozen VM) must
not run a tick again when it wakes. The test shifts the remembered time
back instead of waiting an hour.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
from celery import Celery

from celery_zdelay.parking import store_for
from celery_zdelay.periodic.server import PeriodicServer, occurrence_id
from tests.support.clock import redis_ms
from tests.support.keys import SHARD0
from tests.support.periodic import occurrence_ms

pytestmark = pytest.mark.timeout(60)

TICKS = SHARD0.ticks
MINUTE_MS = 60_000


def _served(app: Celery) -> tuple[PeriodicServer, Any]:
    app.conf.beat_schedule = {"a": {"task": "tests.record", "schedule": 600.0}}
    server = PeriodicServer(app, store_for(app), companion_id="c")
    server.reconcile()
    return server, server.periodic.snapshot().definitions["a"]


def _park(server: PeriodicServer, definition: Any, ms: int) -> bool:
    (request,) = server._requests(definition, occurrence_id("a", 1, ms), ms)
    return server.periodic.park_once(request, occurrence_ms=ms)


def test_an_occurrence_parked_59_minutes_ago_is_not_parked_again(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given an occurrence parked (and released since: nothing of it is parked)
    server, definition = _served(app)
    tick_ms = redis_ms(redis_client) + 600_000
    assert _park(server, definition, tick_ms)
    tick_id = occurrence_id("a", 1, tick_ms)
    server.periodic.store.cancel([tick_id])

    # When it was parked 59 minutes ago, and parking another occurrence
    # since made the store forget what is older than its memory
    redis_client.zadd(TICKS, {tick_id: redis_ms(redis_client) - 59 * MINUTE_MS})
    assert _park(server, definition, tick_ms + 600_000)

    # Then a companion that stalled all that time cannot park it again
    assert not _park(server, definition, tick_ms)
    assert occurrence_ms(tick_id) == tick_ms

    # (The memory has a bound: parked 61 minutes ago, it is forgotten.)
    redis_client.zadd(TICKS, {tick_id: redis_ms(redis_client) - 61 * MINUTE_MS})
    assert _park(server, definition, tick_ms + 1_200_000)
    assert _park(server, definition, tick_ms)
