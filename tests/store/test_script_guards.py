"""The checks every script runs before its first write refuse what would fail it, and say what.

Pins the lines of ``store/lua/_guard.lua`` (loaded in front of every
script; see docs/mutation.rst) that the scripts' own kill tests do not
reach, on a private Redis, no worker or companion: a batch parked across
three shards is refused on every shard, before any writes, when any one of
the last shard's eight keys holds another type; a keyed park is refused
before its key is recorded when the destination set cannot take its
queue; an entry whose due time is neither absolute nor relative is
refused; the Redis clock is read to the millisecond, never behind; a
template without a count it can read is kept and never counted; a counter
field (a periodic
schedule's version) counts up to 18 digits, which ``HINCRBY`` can always add
one to, and is refused beyond; and a counter that cannot count is quoted in
the refusal by its first 40 characters.
"""

from __future__ import annotations

import hashlib

import pytest
import redis
from celery import Celery

from celery_zdelay.errors import StoreRefusedError
from celery_zdelay.parking import store_for
from celery_zdelay.periodic.definition import Definition, from_beat_entry
from celery_zdelay.periodic.store import PeriodicStore
from celery_zdelay.schedule import Due
from celery_zdelay.store import ParkRequest
from celery_zdelay.store.marks import Mark
from tests.conftest import AppFactory
from tests.support.clock import redis_ms
from tests.support.keys import SHARD0
from tests.support.store import ids_on_shard

pytestmark = pytest.mark.timeout(60)

HOUR = 3_600_000
#: What someone else wrote, longer than a refusal quotes.
LONG = "something else wrote this, and went on writing well past forty characters"


def _schedule(name: str, seconds: float) -> Definition:
    return from_beat_entry(name, {"task": "tests.record", "schedule": seconds}, source="config")


@pytest.mark.parametrize(
    ("kind", "wrong_type"),
    [
        ("due", "zset"),
        ("msg", "hash"),
        ("lease", "zset"),
        ("leased", "hash"),
        ("dests", "set"),
        ("templates", "hash"),
        ("marks", "hash"),
        ("tagged", "zset"),
    ],
)
def test_a_batch_over_three_shards_is_refused_before_any_write_when_the_last_cannot_take_it(
    make_test_app: AppFactory, kind: str, wrong_type: str
) -> None:
    app = make_test_app(conf={"zdelay_shards": 3})
    store = store_for(app)
    client = store.client
    ids = [ids_on_shard(store, shard, 1)[0] for shard in (0, 1, 2)]
    at = redis_ms(client) + HOUR
    # The last shard is the second other shard each of the first two checks
    client.set(getattr(store.keys(2), kind), "something else wrote this")

    with pytest.raises(StoreRefusedError, match=f"holds a string, not a {wrong_type}"):
        store.park([ParkRequest(i, Due("a", at), b'{"v":1}\nbody', "q1") for i in ids])

    for shard in (0, 1):
        keys = store.keys(shard)
        assert client.zcard(keys.due) == client.hlen(keys.msg) == client.scard(keys.dests) == 0


def test_a_counter_field_counts_up_to_eighteen_digits_and_is_refused_beyond(app: Celery) -> None:
    periodic_store = PeriodicStore(store_for(app))
    client = periodic_store.store.client
    assert periodic_store.put(_schedule("a", 10.0), writer="api") is True

    client.hset(periodic_store.keys.versions, "a", "9" * 18)
    assert periodic_store.put(_schedule("a", 20.0), writer="api") is True
    assert periodic_store.snapshot().pointers["a"].version == 10**18

    client.hset(periodic_store.keys.versions, "a", "1" * 19)
    with pytest.raises(StoreRefusedError, match=f"counter a of .* holds {'1' * 19}, not a count"):
        periodic_store.put(_schedule("a", 30.0), writer="api")
    assert periodic_store.snapshot().definitions["a"] == _schedule("a", 20.0)


def test_a_counter_that_cannot_count_is_quoted_by_its_first_forty_characters(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    redis_client.set(SHARD0.tags, LONG)
    with pytest.raises(StoreRefusedError, match=f"holds {LONG[:40]}, not a count: delete"):
        store.claim(0, limit=1, lease_ms=HOUR)

    periodic_store = PeriodicStore(store)
    assert periodic_store.put(_schedule("a", 10.0), writer="api") is True
    redis_client.hset(periodic_store.keys.versions, "a", LONG)
    with pytest.raises(StoreRefusedError, match=f"holds {LONG[:40]}, not a count: delete"):
        periodic_store.put(_schedule("a", 20.0), writer="api")


def test_a_keyed_park_is_refused_before_its_key_is_recorded_when_the_queue_set_cannot_take_it(
    app: Celery, redis_client: redis.Redis
) -> None:
    redis_client.set(SHARD0.dests, "something else wrote this")
    at = redis_ms(redis_client) + HOUR
    request = ParkRequest("a", Due("a", at), b'{"v":1}\nbody', "q1", mark=Mark("k", "keep", (), 0))

    with pytest.raises(StoreRefusedError, match="holds a string, not a set: something else"):
        store_for(app).park([request])

    assert redis_client.keys("*") == [SHARD0.dests.encode()]


def test_an_entry_whose_due_time_is_neither_absolute_nor_relative_is_refused(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    at = redis_ms(redis_client) + HOUR
    keys, args = store.park_arguments(0, [ParkRequest("t1", Due("a", at), b'{"v":1}\nbody')])
    args[args.index("t1") + 1] = "x"  # the entry's mode follows its id

    with pytest.raises(redis.ResponseError, match="entry t1 has no valid due time"):
        store.scripts.park(keys=keys, args=args, client=store.client)

    assert redis_client.zcard(SHARD0.due) == 0


def test_the_redis_clock_is_read_to_the_millisecond_never_behind(
    app: Celery, redis_client: redis.Redis
) -> None:
    # A countdown of 0 is due at the script's Redis-now, between two reads
    # of the clock; a reading even 1 ms behind would let an entry out early.
    # Most calls land in the millisecond of the read before them.
    store = store_for(app)
    for n in range(200):
        before = redis_ms(redis_client)
        (parked,) = store.park([ParkRequest(f"t{n}", Due("r", 0), b'{"v":1}\nbody')])
        assert parked.due_ms is not None
        assert before <= parked.due_ms <= redis_ms(redis_client)


def test_a_template_without_a_readable_count_is_kept_for_good_and_never_counted(
    app: Celery, redis_client: redis.Redis
) -> None:
    # As parked by an earlier release (no count), or with a count someone
    # else wrote: counting from there could delete it while entries use it.
    record = b'{"c":1}\n{"body":\x00\x01}'
    uncounted = hashlib.sha1(record).hexdigest()[:16]
    forged = hashlib.sha1(record + b" ").hexdigest()[:16]
    redis_client.hset(SHARD0.templates, mapping={uncounted: record, forged: record + b" "})
    redis_client.hset(SHARD0.templates, f"#{forged}", "1e3")
    at = redis_ms(redis_client) + HOUR

    for tid in (uncounted, forged):
        payload = b'{"v":1,"t":"%s","n":4}\n"x"\x00' % tid.encode()
        store_for(app).park([ParkRequest(f"uses-{tid}", Due("a", at), payload)])

    assert redis_client.hget(SHARD0.templates, f"#{uncounted}") is None
    assert redis_client.hget(SHARD0.templates, f"#{forged}") == b"1e3"


def test_a_park_without_a_template_count_is_refused_with_what_is_missing(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    at = redis_ms(redis_client) + HOUR
    keys, args = store.park_arguments(0, [ParkRequest("t1", Due("a", at), b'{"v":1}\nbody')])
    args[2] = "none"  # the number of templates the call stores

    with pytest.raises(redis.ResponseError, match="park: no template count"):
        store.scripts.park(keys=keys, args=args, client=store.client)

    assert redis_client.zcard(SHARD0.due) == 0


def test_a_park_without_a_held_set_count_is_refused_with_what_is_missing(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    at = redis_ms(redis_client) + HOUR
    keys, args = store.park_arguments(0, [ParkRequest("t1", Due("a", at), b'{"v":1}\nbody')])
    args[3] = "none"  # the number of held sets the call gives

    with pytest.raises(redis.ResponseError, match="park: no held set count"):
        store.scripts.park(keys=keys, args=args, client=store.client)

    assert redis_client.zcard(SHARD0.due) == 0


def test_a_keyed_batch_another_shard_cannot_take_records_no_key_on_any_shard(
    make_test_app: AppFactory,
) -> None:
    app = make_test_app(conf={"zdelay_shards": 2})
    store = store_for(app)
    client = store.client
    (on_0,), (on_1,) = (ids_on_shard(store, shard, 1) for shard in (0, 1))
    at = redis_ms(client) + HOUR
    client.set(store.keys(1).due, "something else wrote this")
    requests = [
        ParkRequest(i, Due("a", at), b'{"v":1}\nbody', mark=Mark(f"key-{i}", "keep", ("t",), 0))
        for i in (on_0, on_1)
    ]

    with pytest.raises(StoreRefusedError, match="holds a string, not a zset: something else"):
        store.park(requests)

    keys = store.keys(0)
    assert client.zcard(keys.due) == client.hlen(keys.marks) == client.zcard(keys.tagged) == 0
