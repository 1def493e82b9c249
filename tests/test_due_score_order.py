"""A due score orders entries by due time then parking order, exactly, until year 2248.

Pins :mod:`celery_zdelay.due_score` (see docs/mutation.rst): a score is
the due ms times 1024 plus the sequence number, as park.lua writes it on a
real Redis; every score of a millisecond reads back as that millisecond,
and none of the next; the latest due time the encoding holds keeps its
last sequence number below 2**53, which Redis's doubles hold exactly; and
the score range of ``[after, before)`` takes exactly the entries due in
it, either side open when None.
"""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
import redis
from celery import Celery

from celery_zdelay.due_score import (
    MAX_DUE_MS,
    SEQUENCE_BITS,
    SEQUENCE_SLOTS,
    due_ms_of,
    last_score_of,
    score_of,
    score_range,
)
from celery_zdelay.parking import store_for
from celery_zdelay.schedule import Due
from celery_zdelay.store import ParkRequest
from tests.support.clock import redis_ms
from tests.support.keys import SHARD0

pytestmark = pytest.mark.timeout(60)


def test_a_score_is_the_due_ms_times_1024_plus_the_sequence_as_park_lua_writes_it(
    app: Celery, redis_client: redis.Redis
) -> None:
    assert (SEQUENCE_BITS, SEQUENCE_SLOTS) == (10, 1024)
    at = redis_ms(redis_client) + 3_600_000
    store_for(app).park([ParkRequest(i, Due("a", at), b'{"v":1}\nbody') for i in ("a", "b")])

    assert redis_client.zscore(SHARD0.due, "a") == score_of(at) == at * 1024
    assert redis_client.zscore(SHARD0.due, "b") == score_of(at, 1) == at * 1024 + 1


def test_every_score_of_a_millisecond_reads_back_as_it_and_none_of_the_next() -> None:
    ms = 1_796_000_000_123
    assert last_score_of(ms) == ms * 1024 + 1023
    assert due_ms_of(score_of(ms)) == due_ms_of(last_score_of(ms)) == ms
    assert due_ms_of(float(last_score_of(ms))) == ms
    assert due_ms_of(score_of(ms + 1)) == ms + 1
    assert due_ms_of(last_score_of(ms) + 1) == ms + 1


def test_the_latest_due_time_keeps_its_last_score_exact_in_redis(
    redis_client: redis.Redis,
) -> None:
    assert last_score_of(MAX_DUE_MS) < 2**53 <= last_score_of(MAX_DUE_MS + 1)
    assert datetime.fromtimestamp(MAX_DUE_MS / 1000, tz=timezone.utc).year == 2248
    redis_client.zadd("scores", {"last": last_score_of(MAX_DUE_MS), "first": score_of(MAX_DUE_MS)})
    assert [(m, int(s)) for m, s in redis_client.zrange("scores", 0, -1, withscores=True)] == [
        (b"first", score_of(MAX_DUE_MS)),
        (b"last", last_score_of(MAX_DUE_MS)),
    ]


def test_a_score_range_takes_exactly_the_entries_due_from_after_to_before(
    redis_client: redis.Redis,
) -> None:
    ms = 1_796_000_000_000
    entries = {
        "before-after": last_score_of(ms - 1),
        "first-of-after": score_of(ms),
        "last-of-after": last_score_of(ms),
        "last-before-before": last_score_of(ms + 9),
        "first-of-before": score_of(ms + 10),
    }
    redis_client.zadd("due", entries)  # type: ignore[arg-type]

    def between(after: int | None, before: int | None) -> list[str]:
        low, high = score_range(after, before)
        return [m.decode() for m in redis_client.zrangebyscore("due", low, high)]

    assert between(ms, ms + 10) == ["first-of-after", "last-of-after", "last-before-before"]
    assert between(None, ms + 10) == ["before-after", *between(ms, ms + 10)]
    assert between(ms, None) == [*between(ms, ms + 10), "first-of-before"]
    assert between(None, None) == list(entries)
