"""A limit's bucket grants the tokens it holds and refills on the Redis clock up to its burst.

Pins the lines of ``store/lua/take_tokens.lua`` (see docs/mutation.rst)
through :meth:`ControlStore.take_tokens` and :meth:`ControlStore.give_back`
on a private Redis, no worker or companion: a new bucket is full; a take
gets the whole tokens it holds, at most what it asks, and the wait until
the next whole token when that is short (at least 1 ms); the bucket refills
at the limit's rate from the Redis time it was last written, never past the
burst nor backwards when that time is ahead; tokens given back return, up
to the burst; the bucket expires once it would be full again; and a key of
another type refuses the call before anything is written.
"""

from __future__ import annotations

import pytest
import redis
from celery import Celery

from celery_zdelay.errors import StoreRefusedError
from celery_zdelay.parking import store_for
from celery_zdelay.rates import parse_limit
from celery_zdelay.store.control import ControlStore
from celery_zdelay.store.redis_keys import control_keys
from tests.support.clock import redis_ms
from tests.support.keys import PREFIX

pytestmark = pytest.mark.timeout(60)

NAME = "queue:emails"
BUCKET = control_keys(PREFIX).bucket(PREFIX, NAME)
#: One token a minute: refills by well under one token during a test.
SLOW = parse_limit("1/m", burst=5)
MINUTE = 60_000
#: Refill of SLOW in 5 s, the most a loaded machine takes between two calls here.
SLACK = 5 / 60
HOUR = 3_600_000


@pytest.fixture
def control(app: Celery) -> ControlStore:
    return ControlStore(store_for(app))


def _level(client: redis.Redis) -> float:
    return float(client.hget(BUCKET, "level") or "nan")


def test_a_new_bucket_is_full_and_grants_whole_tokens_up_to_what_is_asked(
    control: ControlStore, redis_client: redis.Redis
) -> None:
    before = redis_ms(redis_client)
    assert control.take_tokens(NAME, SLOW, 3) == (3, 0)
    after = redis_ms(redis_client)
    assert before <= int(redis_client.hget(BUCKET, "ms") or 0) <= after
    assert 2 <= _level(redis_client) < 2 + SLACK

    granted, wait_ms = control.take_tokens(NAME, SLOW, 5)

    assert granted == 2
    # The next whole token is a minute of refill away, less what refilled since
    assert MINUTE * (1 - SLACK) < wait_ms <= MINUTE
    assert 0 <= _level(redis_client) < SLACK
    # The bucket lives as long as it takes to refill to full, and a minute more
    assert 6 * MINUTE - 5000 < redis_client.pttl(BUCKET) <= 6 * MINUTE


def test_the_wait_for_the_next_token_is_at_least_one_ms(
    control: ControlStore, redis_client: redis.Redis
) -> None:
    fast = parse_limit("1000/s", burst=1)  # one token a ms
    assert control.take_tokens(NAME, fast, 2) == (1, 1)


def test_the_bucket_refills_at_the_rate_from_the_redis_time_it_was_written(
    control: ControlStore, redis_client: redis.Redis
) -> None:
    limit = parse_limit("1/s", burst=100)
    # Empty ten seconds ago (Redis clock): ten tokens since, one more for
    # each second a loaded machine takes to make the call
    redis_client.hset(BUCKET, mapping={"level": "0", "ms": str(redis_ms(redis_client) - 10_000)})

    assert 10 <= control.take_tokens(NAME, limit, 50)[0] <= 13

    # Never past the burst, however long it was left
    redis_client.hset(BUCKET, mapping={"level": "0", "ms": str(redis_ms(redis_client) - 10**9)})
    assert control.take_tokens(NAME, limit, 500)[0] == 100


def test_a_bucket_written_ahead_of_the_redis_clock_does_not_refill_backwards(
    control: ControlStore, redis_client: redis.Redis
) -> None:
    redis_client.hset(BUCKET, mapping={"level": "3.5", "ms": str(redis_ms(redis_client) + HOUR)})

    assert control.take_tokens(NAME, SLOW, 5)[0] == 3

    # Not even a millisecond's worth at a token a millisecond
    fast = parse_limit("1000/s", burst=10)
    redis_client.hset(BUCKET, mapping={"level": "3.5", "ms": str(redis_ms(redis_client) + HOUR)})
    assert control.take_tokens(NAME, fast, 9)[0] == 3


def test_a_bucket_that_cannot_be_read_is_full_again(
    control: ControlStore, redis_client: redis.Redis
) -> None:
    redis_client.hset(BUCKET, mapping={"level": "not a number", "ms": "0"})
    assert control.take_tokens(NAME, SLOW, 9)[0] == 5
    redis_client.hset(BUCKET, mapping={"level": "1", "ms": "not a number"})
    assert control.take_tokens(NAME, SLOW, 9)[0] == 5


def test_tokens_given_back_return_up_to_the_burst(
    control: ControlStore, redis_client: redis.Redis
) -> None:
    assert control.take_tokens(NAME, SLOW, 5) == (5, 0)
    control.give_back(NAME, SLOW, 2)
    assert 2 <= _level(redis_client) < 2 + SLACK
    assert control.take_tokens(NAME, SLOW, 5)[0] == 2

    control.give_back(NAME, SLOW, 1)
    assert 1 <= _level(redis_client) < 1 + SLACK
    control.give_back(NAME, SLOW, 50)
    assert _level(redis_client) == 5
    assert control.take_tokens(NAME, SLOW, 9)[0] == 5


def test_a_key_of_another_type_refuses_the_take_and_writes_nothing(
    control: ControlStore, redis_client: redis.Redis
) -> None:
    redis_client.set(BUCKET, "something else wrote this")

    with pytest.raises(StoreRefusedError, match=r"holds a string, not a hash: something else"):
        control.take_tokens(NAME, SLOW, 1)

    assert redis_client.get(BUCKET) == b"something else wrote this"
    assert redis_client.pttl(BUCKET) == -1
