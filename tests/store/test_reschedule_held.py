"""Reschedule moves a held entry out of its held set and into the due set, in one script.

Pins the lines of ``store/lua/reschedule.lua`` that look in the held sets
of pauses and rate limits (see docs/mutation.rst), through
:meth:`Store.reschedule` and the script itself on a private Redis, with real
parking, claiming and holding (``hold.lua``) and no worker: a held entry
ends in the due set only, at its new time, in the order of its millisecond;
an id is "not parked" only when every held set of the shard was looked in;
a held set of another type is refused before anything is written; an entry
coming back to an empty due set wakes the companions.
"""

from __future__ import annotations

import pytest
import redis
from celery import Celery

from celery_zdelay import StoreRefusedError
from celery_zdelay.parking import store_for
from celery_zdelay.schedule import Due
from celery_zdelay.store import Store
from celery_zdelay.store.control import ControlStore
from celery_zdelay.store.marks import check_marks, tagged_ids
from celery_zdelay.store.redis_keys import held_set_key, lanes_key
from tests.support.clock import redis_ms
from tests.support.keys import PREFIX, SHARD0
from tests.support.wake import wake_ups

pytestmark = pytest.mark.timeout(60)

EMAILS = held_set_key(PREFIX, 0, "queue:emails")
SMS = held_set_key(PREFIX, 0, "task:proj.sms")
LANES = lanes_key(PREFIX, 0)
AT = 1_900_000_000_000


def _held(app: Celery, lane: str, *ids: str, tags: list[str] | None = None) -> Store:
    """Park *ids* due now, claim them and hold them in *lane*'s held set, as a companion does."""
    for task_id in ids:
        app.tasks["tests.record"].apply_delayed(
            (task_id,), countdown=0, task_id=task_id, tags=tags or []
        )
    store = store_for(app)
    claimed = store.claim(0, limit=100, lease_ms=60_000)
    assert sorted(e.task_id for e in claimed.entries) == sorted(ids)
    assert ControlStore(store).hold(0, claimed.token, lane, list(ids)) == len(ids)
    return store


def test_a_held_entry_moves_to_the_due_set_alone_at_its_new_time(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = _held(app, "queue:emails", "mail", tags=["welcome"])
    before = redis_ms(redis_client)

    new_due = store.reschedule("mail", Due("r", 90_000))

    assert new_due is not None
    assert before + 90_000 <= new_due <= redis_ms(redis_client) + 90_000
    assert int(redis_client.zscore(SHARD0.due, "mail") or -1) == new_due * 1024
    assert redis_client.zscore(EMAILS, "mail") is None
    assert redis_client.zscore(SHARD0.lease, "mail") is None
    assert redis_client.hexists(SHARD0.msg, "mail")
    assert tagged_ids(store, "welcome") == ["mail"]
    assert check_marks(store) == []


def test_held_entries_moved_to_one_millisecond_keep_the_order_they_were_moved_in(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = _held(app, "queue:emails", "b", "a")
    _held(app, "task:proj.sms", "c")

    for task_id in ("b", "c", "a"):
        assert store.reschedule(task_id, Due("a", AT)) == AT

    scores = {i: int(redis_client.zscore(SHARD0.due, i) or -1) for i in ("a", "b", "c")}
    assert scores == {"b": AT * 1024, "c": AT * 1024 + 1, "a": AT * 1024 + 2}
    assert redis_client.zcard(EMAILS) == 0
    assert redis_client.zcard(SMS) == 0


def test_an_id_is_not_parked_only_when_every_held_set_was_looked_in(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = _held(app, "queue:emails", "mail")
    _held(app, "task:proj.sms", "sms")
    args = [SHARD0.wake, "mail", "a", AT]

    # Given only one of the shard's two held sets, and an id in neither given
    reply = store.scripts.reschedule(
        keys=[SHARD0.due, LANES, SMS], args=[*args, "task:proj.sms"], client=store.client
    )

    # Then the script says the lanes changed, and writes nothing
    assert reply == -2
    assert redis_client.zscore(EMAILS, "mail") is not None
    assert redis_client.zscore(SHARD0.due, "mail") is None
    # ...and with every held set given, an id in none is not parked
    assert store.reschedule("never-parked", Due("a", AT)) is None
    assert redis_client.zcard(SHARD0.due) == 0


def test_a_held_set_of_another_type_is_refused_before_anything_is_written(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = _held(app, "queue:emails", "mail")
    redis_client.sadd(LANES, "queue:broken")
    broken = held_set_key(PREFIX, 0, "queue:broken")
    redis_client.set(broken, "something else wrote this")

    with pytest.raises(StoreRefusedError, match=r"holds a string, not a zset: something else"):
        store.reschedule("mail", Due("a", AT))

    assert redis_client.zscore(EMAILS, "mail") is not None
    assert redis_client.zscore(SHARD0.due, "mail") is None


def test_a_lanes_key_of_another_type_is_refused_with_the_fix(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    redis_client.set(LANES, "something else wrote this")
    # (The script itself: Store.reschedule reads the lanes first, and is refused there.)
    with pytest.raises(redis.ResponseError, match=r"holds a string, not a set: something else"):
        store.scripts.reschedule(
            keys=[SHARD0.due, LANES], args=[SHARD0.wake, "x", "a", AT], client=store.client
        )


def test_a_held_entry_back_in_an_empty_due_set_wakes_the_companions(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = _held(app, "queue:emails", "first", "second")
    with wake_ups(redis_client) as seen:
        # The due set is empty: the entry is the earliest, companions must wake.
        assert store.reschedule("first", Due("a", AT)) == AT
        # Later than the one now in the due set: nothing to wake for.
        assert store.reschedule("second", Due("a", AT + 1000)) == AT + 1000
    assert seen == [str(AT).encode()]
