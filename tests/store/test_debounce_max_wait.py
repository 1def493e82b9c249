"""A debounce with ``max_wait`` ends: exact due times from ``park_keyed.lua``.

Through :meth:`Store.park` on a private Redis, no worker or companion, with
absolute due times so every figure is exact. The burst's first call ("f",
Redis clock) and its cap ("w") live in the key owner's record; each
debounce is due at min(what it asked for, f + w):

- the first call of a burst (key free) records f = the Redis clock of the
  call, and is due when it asked unless its own cap is sooner;
- a later call is capped at the *first* call's f + w, not its own time;
- a call without max_wait keeps the burst's cap, a larger one does not
  loosen it, a smaller one tightens it;
- an owner released (in flight) or cancelled ends the burst: the next call
  starts a new one;
- a record without f (an older version's) starts a burst now;
- within one batch, the later call inherits the earlier one's burst.
"""

from __future__ import annotations

import pytest
import redis

from celery_zdelay.schedule import Due
from celery_zdelay.store import Parked, ParkRequest, Store
from celery_zdelay.store.marks import Mark, check_marks, key_owner, marks_of
from tests.helpers import wait_for
from tests.support.clock import redis_ms
from tests.support.keys import SHARD0
from tests.support.store import PAYLOAD

pytestmark = pytest.mark.timeout(60)

HOUR = 3_600_000


def _debounce(task_id: str, ms: int, max_wait_ms: int | None, key: str = "k") -> ParkRequest:
    """A debounce call under *key* due at epoch *ms* (before the cap), with *max_wait_ms*."""
    mark = Mark(key, "debounce", (), 0, max_wait_ms)
    return ParkRequest(task_id, Due("a", ms), PAYLOAD, mark=mark)


def _record(client: redis.Redis, task_id: str) -> str:
    value = client.hget(SHARD0.marks, "i:" + task_id)
    assert value is not None, f"{task_id} has no record"
    return value.decode()


def _burst(client: redis.Redis, task_id: str) -> tuple[int | None, int | None]:
    """(first call ms, max_wait ms) of *task_id*'s record: its head's f and w fields."""
    head = _record(client, task_id).partition("\n")[0]
    fields = {part[0]: int(part[1:]) for part in head.split(" ")[1:]}
    return fields.get("f"), fields.get("w")


def _due(client: redis.Redis, task_id: str) -> int:
    score = client.zscore(SHARD0.due, task_id)
    assert score is not None, f"{task_id} is not in the due set"
    return int(score) // 1024


def _clock_passes(client: redis.Redis, after_ms: int) -> int:
    """Wait (bounded) until the Redis clock is past *after_ms*; return it."""
    wait_for(lambda: redis_ms(client) > after_ms, timeout=5, message="the Redis clock to move")
    return redis_ms(client)


def _first_call(store: Store, client: redis.Redis, max_wait_ms: int | None) -> tuple[int, int]:
    """Park the burst's first call ("first", due in 10 h); return (its f, the clock after it)."""
    before = redis_ms(client)
    (parked,) = store.park([_debounce("first", before + 10 * HOUR, max_wait_ms)])
    after = redis_ms(client)
    assert parked.parked
    first, _ = _burst(client, "first")
    assert first is not None
    assert before <= first <= after
    # Later calls must be told apart from the first one by the clock.
    return first, _clock_passes(client, after + 20)


def test_the_first_call_records_its_redis_time_and_is_due_as_asked_under_the_cap(
    store: Store, redis_client: redis.Redis
) -> None:
    before = redis_ms(redis_client)
    at = before + HOUR

    assert store.park([_debounce("first", at, 2 * HOUR)]) == [Parked("first", at, True)]

    first, wait = _burst(redis_client, "first")
    assert wait == 2 * HOUR
    assert first is not None
    assert before <= first <= redis_ms(redis_client)
    assert _due(redis_client, "first") == at
    assert key_owner(store, "k") == ("first", None)
    # The record still reads as a debounce under its key (Python and Lua agree)
    found = marks_of(store, "first", 0)
    assert found is not None
    assert (found.key, found.on_key) == ("k", "debounce")
    assert check_marks(store) == []


def test_a_first_call_whose_countdown_passes_its_own_cap_is_due_at_the_cap(
    store: Store, redis_client: redis.Redis
) -> None:
    before = redis_ms(redis_client)

    (parked,) = store.park([_debounce("first", before + 2 * HOUR, HOUR)])

    first, _ = _burst(redis_client, "first")
    assert first is not None
    assert parked == Parked("first", first + HOUR, True)
    assert _due(redis_client, "first") == first + HOUR


def test_a_later_call_is_capped_at_the_first_calls_time_plus_max_wait(
    store: Store, redis_client: redis.Redis
) -> None:
    first, now = _first_call(store, redis_client, 2 * HOUR)
    assert _due(redis_client, "first") == first + 2 * HOUR  # 10 h asked, capped

    # Asks for 3 h from now: past the cap, due at first + 2 h (not now + 2 h)
    (parked,) = store.park([_debounce("second", now + 3 * HOUR, 2 * HOUR)])

    assert parked == Parked("second", first + 2 * HOUR, True)
    assert parked.replaced == "first"
    assert _due(redis_client, "second") == first + 2 * HOUR
    assert _burst(redis_client, "second") == (first, 2 * HOUR)
    assert not redis_client.hexists(SHARD0.msg, "first")
    assert key_owner(store, "k") == ("second", None)
    assert check_marks(store) == []


def test_a_countdown_is_capped_as_an_eta_is(store: Store, redis_client: redis.Redis) -> None:
    first, _ = _first_call(store, redis_client, 2 * HOUR)

    # Due 3 h after the Redis clock of the call: past the cap
    request = ParkRequest("late", Due("r", 3 * HOUR), PAYLOAD, mark=Mark("k", "debounce", (), 0))
    (late,) = store.park([request])
    assert late == Parked("late", first + 2 * HOUR, True)

    # Due 1 h after it: before the cap, due as asked (on the Redis clock)
    before = redis_ms(redis_client)
    request = ParkRequest("soon", Due("r", HOUR), PAYLOAD, mark=Mark("k", "debounce", (), 0))
    (soon,) = store.park([request])
    assert soon.due_ms is not None
    assert before + HOUR <= soon.due_ms <= redis_ms(redis_client) + HOUR
    assert _due(redis_client, "soon") == soon.due_ms


def test_a_later_call_due_before_the_cap_is_due_when_it_asked(
    store: Store, redis_client: redis.Redis
) -> None:
    first, now = _first_call(store, redis_client, 2 * HOUR)

    (parked,) = store.park([_debounce("second", now + HOUR, 2 * HOUR)])

    assert parked == Parked("second", now + HOUR, True)
    assert _burst(redis_client, "second") == (first, 2 * HOUR)


def test_a_call_without_max_wait_keeps_the_bursts_cap(
    store: Store, redis_client: redis.Redis
) -> None:
    first, now = _first_call(store, redis_client, 2 * HOUR)

    (parked,) = store.park([_debounce("second", now + 5 * HOUR, None)])

    assert parked == Parked("second", first + 2 * HOUR, True)
    assert _burst(redis_client, "second") == (first, 2 * HOUR)


def test_the_cap_of_a_burst_only_tightens(store: Store, redis_client: redis.Redis) -> None:
    first, now = _first_call(store, redis_client, 2 * HOUR)

    # A larger max_wait does not loosen it...
    (looser,) = store.park([_debounce("looser", now + 5 * HOUR, 4 * HOUR)])
    assert looser == Parked("looser", first + 2 * HOUR, True)
    assert _burst(redis_client, "looser") == (first, 2 * HOUR)
    # ...a smaller one tightens it, still from the first call.
    (tighter,) = store.park([_debounce("tighter", now + 5 * HOUR, HOUR)])
    assert tighter == Parked("tighter", first + HOUR, True)
    assert _burst(redis_client, "tighter") == (first, HOUR)


def test_a_burst_without_a_cap_still_records_its_first_call_for_a_later_max_wait(
    store: Store, redis_client: redis.Redis
) -> None:
    first, now = _first_call(store, redis_client, None)
    assert _burst(redis_client, "first") == (first, None)
    assert _due(redis_client, "first") > first + 9 * HOUR  # asked 10 h: no cap

    (parked,) = store.park([_debounce("second", now + 5 * HOUR, HOUR)])

    assert parked == Parked("second", first + HOUR, True)


def test_a_cap_already_passed_makes_the_call_due_at_once_at_the_cap(
    store: Store, redis_client: redis.Redis
) -> None:
    first, now = _first_call(store, redis_client, 5)  # 5 ms: over by now
    assert now > first + 5

    (parked,) = store.park([_debounce("second", now + HOUR, None)])

    assert parked == Parked("second", first + 5, True)
    assert _due(redis_client, "second") == first + 5


def test_a_released_owner_ends_the_burst_and_the_next_call_starts_a_new_one(
    store: Store, redis_client: redis.Redis
) -> None:
    now = redis_ms(redis_client)
    store.park([_debounce("runs", now - 1000, HOUR)])
    claimed = store.claim(0, limit=10, lease_ms=HOUR)
    assert [e.task_id for e in claimed.entries] == ["runs"]
    later = _clock_passes(redis_client, redis_ms(redis_client) + 20)

    (parked,) = store.park([_debounce("next", later + 2 * HOUR, HOUR)])

    first, _ = _burst(redis_client, "next")
    assert first is not None
    assert first >= later
    assert parked == Parked("next", first + HOUR, True)
    assert parked.replaced is None  # being released: never taken out
    assert redis_client.zscore(SHARD0.lease, "runs") is not None


def test_a_cancelled_owner_ends_the_burst(store: Store, redis_client: redis.Redis) -> None:
    first, now = _first_call(store, redis_client, HOUR)
    assert store.cancel(["first"]) == [True]

    (parked,) = store.park([_debounce("next", now + 2 * HOUR, HOUR)])

    restarted, _ = _burst(redis_client, "next")
    assert restarted is not None
    assert restarted >= now > first
    assert parked == Parked("next", restarted + HOUR, True)


def test_an_owner_of_another_mode_starts_a_burst_at_the_debounce(
    store: Store, redis_client: redis.Redis
) -> None:
    at = redis_ms(redis_client) + 10 * HOUR
    store.park([ParkRequest("kept", Due("a", at), PAYLOAD, mark=Mark("k", "replace", (), 0, None))])
    now = _clock_passes(redis_client, redis_ms(redis_client) + 20)

    (parked,) = store.park([_debounce("next", now + 2 * HOUR, HOUR)])

    first, _ = _burst(redis_client, "next")
    assert first is not None
    assert first >= now
    assert parked == Parked("next", first + HOUR, True)
    assert parked.replaced == "kept"


def test_a_record_written_before_max_wait_existed_starts_the_burst_now(
    store: Store, redis_client: redis.Redis
) -> None:
    first, now = _first_call(store, redis_client, HOUR)
    # As an older version wrote it: no fields in the head.
    redis_client.hset(SHARD0.marks, "i:first", "d0\nk")
    assert check_marks(store) == []

    (parked,) = store.park([_debounce("second", now + 2 * HOUR, HOUR)])

    restarted, _ = _burst(redis_client, "second")
    assert restarted is not None
    assert restarted >= now > first
    assert parked == Parked("second", restarted + HOUR, True)


def test_within_one_batch_the_later_call_keeps_the_earlier_calls_burst(
    store: Store, redis_client: redis.Redis
) -> None:
    first, now = _first_call(store, redis_client, 2 * HOUR)

    replies = store.park(
        [
            _debounce("a", now + 3 * HOUR, None),
            _debounce("b", now + 4 * HOUR, None),
            _debounce("other", now + 4 * HOUR, HOUR, key="j"),
        ]
    )

    assert [(p.task_id, p.due_ms, p.parked) for p in replies[:2]] == [
        ("b", first + 2 * HOUR, False),
        ("b", first + 2 * HOUR, True),
    ]
    assert _burst(redis_client, "b") == (first, 2 * HOUR)
    other_first, _ = _burst(redis_client, "other")
    assert other_first is not None
    assert other_first >= now
    assert replies[2] == Parked("other", other_first + HOUR, True)
    assert set(redis_client.zrange(SHARD0.due, 0, -1)) == {b"b", b"other"}
    assert check_marks(store) == []
