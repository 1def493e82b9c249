"""Cancel removes exactly the parked entries named; reschedule moves one to its new time.

Pins the lines of ``store/lua/cancel.lua`` and ``store/lua/reschedule.lua``
(see docs/mutation.rst), through :meth:`Store.cancel` and
:meth:`Store.reschedule` on a private Redis, with real parking and no
worker: a cancelled entry leaves the due set, its payload, its template
reference, its key and its tags in one script, an id named twice counts
once, and an entry already claimed for release is not cancelled; a
rescheduled entry is due at Redis-now + countdown (or at the eta), keeps
its place among entries of the same millisecond, and wakes the companions
only when it became the earliest.
"""

from __future__ import annotations

import pytest
import redis
from celery import Celery

from celery_zdelay import StoreRefusedError
from celery_zdelay.parking import store_for
from celery_zdelay.schedule import Due
from celery_zdelay.store.marks import check_marks, key_owner, tagged_ids
from tests.support.clock import redis_ms
from tests.support.keys import SHARD0
from tests.support.store import due_ms
from tests.support.wake import wake_ups

pytestmark = pytest.mark.timeout(60)


def _park(app: Celery, *ids: str, countdown: float = 3600) -> None:
    for task_id in ids:
        app.tasks["tests.record"].apply_delayed((task_id,), countdown=countdown, task_id=task_id)


def _template_refs(client: redis.Redis) -> list[bytes]:
    counts: dict[bytes, bytes] = client.hgetall(SHARD0.templates)
    return [v for k, v in counts.items() if k.startswith(b"#")]


# -- cancel.lua ------------------------------------------------------------------------


def test_cancel_removes_the_named_entries_once_and_only_those(
    app: Celery, redis_client: redis.Redis
) -> None:
    _park(app, "a", "b")
    store = store_for(app)
    assert _template_refs(redis_client) == [b"2"]

    assert store.cancel(["a", "never-parked", "a"]) == [True, False, False]

    assert redis_client.zscore(SHARD0.due, "a") is None
    assert not redis_client.hexists(SHARD0.msg, "a")
    assert redis_client.zscore(SHARD0.due, "b") is not None
    assert redis_client.hexists(SHARD0.msg, "b")
    assert _template_refs(redis_client) == [b"1"]
    assert store.cancel(["b"]) == [True]
    assert redis_client.hlen(SHARD0.templates) == 0
    assert redis_client.zcard(SHARD0.due) == 0
    assert redis_client.hlen(SHARD0.msg) == 0


def test_a_cancelled_entry_gives_up_its_key_and_its_tags(app: Celery) -> None:
    record = app.tasks["tests.record"]
    gone = record.apply_delayed(("gone",), countdown=3600, key="order:1", tags=["shop", "eu"])
    kept = record.apply_delayed(("kept",), countdown=3600, key="order:2", tags=["shop"])
    store = store_for(app)

    assert store.cancel([gone.id]) == [True]

    assert key_owner(store, "order:1") is None
    assert key_owner(store, "order:2") == (kept.id, None)
    assert tagged_ids(store, "shop") == [kept.id]
    assert tagged_ids(store, "eu") == []
    assert check_marks(store) == []


def test_an_entry_claimed_for_release_is_not_cancelled(
    app: Celery, redis_client: redis.Redis
) -> None:
    _park(app, "due-now", countdown=0)
    store = store_for(app)
    claimed = store.claim(0, limit=10, lease_ms=60_000)
    assert [e.task_id for e in claimed.entries] == ["due-now"]

    assert store.cancel(["due-now"]) == [False]

    assert redis_client.hexists(SHARD0.msg, "due-now")
    assert redis_client.zscore(SHARD0.lease, "due-now") is not None


def test_a_cancel_finding_a_key_of_another_type_is_refused_with_the_fix_and_writes_nothing(
    app: Celery, redis_client: redis.Redis
) -> None:
    _park(app, "a")
    redis_client.delete(SHARD0.msg)
    redis_client.set(SHARD0.msg, "something else wrote this")
    with pytest.raises(StoreRefusedError, match=r"holds a string, not a hash: something else"):
        store_for(app).cancel(["a"])
    assert redis_client.zscore(SHARD0.due, "a") is not None
    assert redis_client.get(SHARD0.msg) == b"something else wrote this"


def test_a_reschedule_finding_a_key_of_another_type_is_refused_with_the_fix(
    app: Celery, redis_client: redis.Redis
) -> None:
    redis_client.set(SHARD0.due, "something else wrote this")
    with pytest.raises(StoreRefusedError, match=r"holds a string, not a zset: something else"):
        store_for(app).reschedule("a", Due("a", 1_900_000_000_000))
    assert redis_client.get(SHARD0.due) == b"something else wrote this"


# -- reschedule.lua ----------------------------------------------------------------------


def test_a_rescheduled_entry_is_due_at_redis_now_plus_the_countdown(
    app: Celery, redis_client: redis.Redis
) -> None:
    _park(app, "moved")
    store = store_for(app)
    before = redis_ms(redis_client)
    new_due = store.reschedule("moved", Due("r", 90_000))
    after = redis_ms(redis_client)
    assert new_due is not None
    assert before + 90_000 <= new_due <= after + 90_000
    assert due_ms(store, "moved") == new_due
    # An eta is an epoch time, whatever the clock says.
    assert store.reschedule("moved", Due("a", 1_900_000_000_000)) == 1_900_000_000_000
    assert due_ms(store, "moved") == 1_900_000_000_000
    assert redis_client.hexists(SHARD0.msg, "moved")


def test_rescheduling_an_entry_not_parked_moves_nothing(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    assert store.reschedule("never-parked", Due("a", 1_900_000_000_000)) is None
    assert redis_client.zcard(SHARD0.due) == 0


def test_entries_moved_to_one_millisecond_keep_the_order_they_were_moved_in(
    app: Celery, redis_client: redis.Redis
) -> None:
    _park(app, "first", "second", "third")
    store = store_for(app)
    at = 1_900_000_000_000
    for task_id in ("second", "first", "third"):
        assert store.reschedule(task_id, Due("a", at)) == at
    scores = {
        i: int(redis_client.zscore(SHARD0.due, i) or -1) for i in ("second", "first", "third")
    }
    assert scores == {"second": at * 1024, "first": at * 1024 + 1, "third": at * 1024 + 2}
    # Moving one again takes the next slot of that millisecond, after the others.
    assert store.reschedule("second", Due("a", at)) == at
    assert int(redis_client.zscore(SHARD0.due, "second") or -1) == at * 1024 + 3


def test_an_entry_of_the_next_millisecond_does_not_push_a_moved_one_to_the_end(
    app: Celery, redis_client: redis.Redis
) -> None:
    _park(app, "moved")
    at = 1_900_000_000_000
    redis_client.zadd(SHARD0.due, {"next-ms": (at + 1) * 1024})
    assert store_for(app).reschedule("moved", Due("a", at)) == at
    assert int(redis_client.zscore(SHARD0.due, "moved") or -1) == at * 1024
    # Moved again to the same millisecond, alone in it: the same first slot,
    # not the one after its own old place.
    assert store_for(app).reschedule("moved", Due("a", at)) == at
    assert int(redis_client.zscore(SHARD0.due, "moved") or -1) == at * 1024


def test_a_full_millisecond_keeps_every_entry_in_it(app: Celery, redis_client: redis.Redis) -> None:
    _park(app, "moved")
    at = 1_900_000_000_000
    # 1,024 entries already fill the millisecond's sequence slots.
    redis_client.zadd(SHARD0.due, {f"filler-{n}": at * 1024 + n for n in range(1024)})
    assert store_for(app).reschedule("moved", Due("a", at)) == at
    assert int(redis_client.zscore(SHARD0.due, "moved") or -1) == at * 1024 + 1023


def test_a_reschedule_wakes_the_companions_only_when_it_moves_the_earliest_due_time_earlier(
    app: Celery, redis_client: redis.Redis
) -> None:
    _park(app, "early", countdown=600)
    _park(app, "late", countdown=3600)
    store = store_for(app)
    with wake_ups(redis_client) as seen:
        # Later than the earliest: no companion needs to wake.
        store.reschedule("late", Due("r", 7200_000))
        # Earlier than the earliest: the companions wake for its due time.
        at = redis_ms(redis_client) + 60_000
        assert store.reschedule("late", Due("a", at)) == at
        # The earliest moved later, still ahead of the next one, or moved to
        # the very slot it had: nothing to wake for.
        assert store.reschedule("late", Due("a", at + 1000)) == at + 1000
        assert due_ms(store, "late") == at + 1000
        assert store.reschedule("late", Due("a", at + 1000)) == at + 1000
        store.reschedule("early", Due("r", 9000_000))
    assert seen == [str(at).encode()]
