"""Concurrency slots are granted to at most *limit* live tasks, and end by themselves.

Pins ``store/lua/take_slots.lua`` (see docs/mutation.rst) through
:meth:`ControlStore.take_slots` on a private Redis, no worker or companion:
the first ids in order get the free slots and no more; an id that took a
live slot keeps it without taking a second, its end moved on; a slot past
its end is free and leaves the record; the record expires with its last
slot; and bad arguments or a key of another type are refused before any
write.
"""

from __future__ import annotations

import pytest
import redis
from celery import Celery

from celery_zdelay.errors import StoreRefusedError
from celery_zdelay.parking import store_for
from celery_zdelay.store.control import ControlStore
from celery_zdelay.store.redis_keys import control_keys
from tests.support.clock import redis_ms
from tests.support.keys import PREFIX

pytestmark = pytest.mark.timeout(60)

SLOT = "task:proj.export"
HOUR = 3_600_000


@pytest.fixture
def control(app: Celery) -> ControlStore:
    return ControlStore(store_for(app))


@pytest.fixture
def record() -> str:
    return control_keys(PREFIX).slots(PREFIX, SLOT)


def test_the_first_ids_in_order_take_the_free_slots_and_no_more(
    control: ControlStore, record: str, redis_client: redis.Redis
) -> None:
    assert control.take_slots(SLOT, 2, ["a", "b", "c"], max_run_ms=HOUR) == ["a", "b"]
    assert control.take_slots(SLOT, 2, ["c", "d"], max_run_ms=HOUR) == []
    assert control.take_slots(SLOT, 3, ["c", "d"], max_run_ms=HOUR) == ["c"]
    assert {m.decode() for m in redis_client.zrange(record, 0, -1)} == {"a", "b", "c"}
    assert control.live_slots(SLOT) == 3


def test_an_id_with_a_slot_keeps_it_and_takes_no_second_its_end_moved_on(
    control: ControlStore, record: str, redis_client: redis.Redis
) -> None:
    # Given a and b with the two slots, a's ending soon
    assert control.take_slots(SLOT, 2, ["a", "b"], max_run_ms=HOUR) == ["a", "b"]
    soon = redis_ms(redis_client) + 60_000
    redis_client.zadd(record, {"a": soon})

    # When a is released again (a retry) beside a newcomer
    before = redis_ms(redis_client)
    assert control.take_slots(SLOT, 2, ["a", "c"], max_run_ms=HOUR) == ["a"]

    # Then a still has one slot, now ending an hour on; c got none
    score = redis_client.zscore(record, "a")
    assert score is not None
    assert before + HOUR <= score <= redis_ms(redis_client) + HOUR
    assert redis_client.zcard(record) == 2


def test_a_slot_past_its_end_is_free_and_leaves_the_record(
    control: ControlStore, record: str, redis_client: redis.Redis
) -> None:
    # Given a slot whose end has passed (its worker died) and a live one
    assert control.take_slots(SLOT, 2, ["dead", "live"], max_run_ms=HOUR) == ["dead", "live"]
    redis_client.zadd(record, {"dead": redis_ms(redis_client) - 1})
    assert control.live_slots(SLOT) == 1

    # When another task asks
    assert control.take_slots(SLOT, 2, ["next"], max_run_ms=HOUR) == ["next"]

    # Then it has the freed slot, and the ended one is gone
    assert {m.decode() for m in redis_client.zrange(record, 0, -1)} == {"live", "next"}
    # And an ended slot's id asking again is a newcomer: no slot free now
    assert control.take_slots(SLOT, 2, ["dead"], max_run_ms=HOUR) == []


def test_the_record_expires_with_its_last_slot(
    control: ControlStore, record: str, redis_client: redis.Redis
) -> None:
    control.take_slots(SLOT, 5, ["a"], max_run_ms=HOUR)
    control.take_slots(SLOT, 5, ["b"], max_run_ms=2 * HOUR)
    ttl = redis_client.pttl(record)
    assert 2 * HOUR - 5_000 < ttl <= 2 * HOUR
    # Nothing granted: nothing written, the expiry is not touched
    redis_client.persist(record)
    assert control.take_slots(SLOT, 2, ["c"], max_run_ms=HOUR) == []
    assert redis_client.pttl(record) == -1


@pytest.mark.parametrize(("limit", "max_run_ms"), [(0, HOUR), (2, 0), (-1, HOUR)])
def test_a_limit_or_max_run_that_is_not_positive_is_refused(
    control: ControlStore, record: str, redis_client: redis.Redis, limit: int, max_run_ms: int
) -> None:
    with pytest.raises(Exception, match="limit and max run ms must be positive"):
        control.take_slots(SLOT, limit, ["a"], max_run_ms=max_run_ms)
    assert not redis_client.exists(record)


def test_a_record_of_another_type_is_refused_before_any_write(
    control: ControlStore, record: str, redis_client: redis.Redis
) -> None:
    redis_client.set(record, "someone else's")
    # (the guard's words, which say what to do; not Redis's own WRONGTYPE)
    with pytest.raises(StoreRefusedError, match="something else wrote it"):
        control.take_slots(SLOT, 2, ["a"], max_run_ms=HOUR)
    assert redis_client.get(record) == b"someone else's"


def test_a_limit_of_one_grants_one(control: ControlStore) -> None:
    assert control.take_slots(SLOT, 1, ["a", "b"], max_run_ms=1) == ["a"]


@pytest.mark.parametrize(("limit", "max_run_ms"), [("x", HOUR), (2, "y"), ("nan", HOUR)])
def test_a_limit_or_max_run_that_is_not_a_number_is_refused_by_the_script(
    control: ControlStore, record: str, redis_client: redis.Redis, limit: object, max_run_ms: object
) -> None:
    with pytest.raises(redis.ResponseError, match="limit and max run ms must be positive"):
        control.store.scripts.take_slots(
            keys=[record], args=[limit, max_run_ms, "a"], client=control.store.client
        )
    assert not redis_client.exists(record)
