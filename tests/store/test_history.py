"""A task id's history: every transition records its event, in order, bounded, kept for a while.

``celery_zdelay.history(task_id, app=app)`` reads what the transitions of
``store/lua/_transitions.lua`` recorded through ``_history.lua``: parked
(which call, due when), rescheduled, held (why), released (by which
companion, how late), cancelled (how, by whom), dead-lettered (why),
requeued, purged. Real Redis, companions run in this process (one pass each);
tests/companion/test_history_story.py runs the same story with a real
companion and worker.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
import redis
from celery import Celery

import celery_zdelay
from celery_zdelay.companion import Companion
from celery_zdelay.parking import store_for
from celery_zdelay.schedule import Due
from celery_zdelay.store.dead_reason import DeadReason
from celery_zdelay.store.history import sweep_history
from celery_zdelay.store.redis_keys import shard_keys
from tests.conftest import AppFactory
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(60)

HOUR = 3_600_000
REASON = DeadReason(reason="bad signature", due_ms=1_700_000_000_000, companion="c-test")


def _events(task_id: str, app: Celery) -> list[str]:
    return [event.event for event in celery_zdelay.history(task_id, app=app)]


def _release(app: Celery) -> str:
    """One companion pass in this process; return the companion's id."""
    with Companion(app) as comp:
        comp.release_due()
        return str(comp.id)


def test_parked_rescheduled_and_cancelled_by_alice_reads_back_in_order(app: Celery) -> None:
    # Given a task parked an hour ahead, moved, then cancelled by alice
    before = datetime.now(timezone.utc) - timedelta(seconds=5)
    result = app.tasks["tests.record"].apply_delayed((1,), countdown=3600)
    assert celery_zdelay.reschedule(result.id, countdown=7200, app=app)
    assert celery_zdelay.cancel(result.id, app=app, by="alice")

    # Then its history says so, oldest first, with when and who
    events = celery_zdelay.history(result.id, app=app)
    assert [e.event for e in events] == ["parked", "rescheduled", "cancelled"]
    parked, moved, cancelled = events
    assert parked.call == "plain"
    assert parked.due is not None
    assert moved.due is not None
    assert timedelta(minutes=59) < parked.due - parked.at < timedelta(minutes=61)
    assert timedelta(minutes=119) < moved.due - moved.at < timedelta(minutes=121)
    assert (cancelled.reason, cancelled.by) == ("id", "alice")
    assert all(before < e.at < datetime.now(timezone.utc) + timedelta(seconds=5) for e in events)
    assert parked.at <= moved.at <= cancelled.at


def test_cancelled_by_tag_says_tag_and_who(app: Celery) -> None:
    tagged = app.tasks["tests.record"].apply_delayed((1,), countdown=3600, tags=["order:7"])

    assert celery_zdelay.cancel_matching(tag="order:7", app=app, by="alice") == 1

    last = celery_zdelay.history(tagged.id, app=app)[-1]
    assert (last.event, last.reason, last.by) == ("cancelled", "tag", "alice")
    assert celery_zdelay.history(tagged.id, app=app)[0].call == "keyed"


def test_a_task_replaced_by_key_is_cancelled_replaced_and_the_new_one_parked(app: Celery) -> None:
    task = app.tasks["tests.record"]
    first = task.apply_delayed((1,), countdown=3600, key="user:7", on_key="replace")
    second = task.apply_delayed((2,), countdown=3600, key="user:7", on_key="replace")

    old = celery_zdelay.history(first.id, app=app)
    assert [(e.event, e.reason) for e in old] == [("parked", None), ("cancelled", "replaced")]
    assert _events(second.id, app) == ["parked"]


def test_a_batch_is_parked_as_bulk(app: Celery) -> None:
    task = app.tasks["tests.record"]
    with celery_zdelay.batch(app):
        results = [task.apply_delayed((n,), countdown=3600) for n in range(3)]

    assert {celery_zdelay.history(r.id, app=app)[0].call for r in results} == {"bulk"}


def test_released_by_the_companion_with_how_late(app: Celery) -> None:
    # Given a task due at once, released by a companion pass (the handoff)
    result = app.tasks["tests.record"].apply_delayed((1,), countdown=0)
    companion_id = _release(app)

    # Then it was released by that companion, not before its due time
    parked, released = celery_zdelay.history(result.id, app=app)
    assert (parked.event, released.event) == ("parked", "released")
    assert released.by == companion_id
    assert released.late_ms is not None
    assert released.late_ms >= 0
    assert parked.due is not None
    assert released.at >= parked.due - timedelta(milliseconds=1)


def test_released_through_the_generic_path_records_too(make_test_app: AppFactory) -> None:
    # Signed entries take the companion's generic path (push.lua after a check)
    app = make_test_app(conf={"zdelay_signing_key": "k" * 32})
    result = app.tasks["tests.record"].apply_delayed((1,), countdown=0)
    companion_id = _release(app)

    released = celery_zdelay.history(result.id, app=app)[-1]
    assert (released.event, released.by) == ("released", companion_id)
    assert released.late_ms is not None
    assert released.late_ms >= 0


def test_held_by_a_pause_says_pause_and_which_control(app: Celery) -> None:
    celery_zdelay.pause("queue:celery", app=app)
    result = app.tasks["tests.record"].apply_delayed((1,), countdown=0)
    _release(app)

    held = celery_zdelay.history(result.id, app=app)[-1]
    assert (held.event, held.reason, held.by) == ("held", "pause", "queue:celery")

    celery_zdelay.resume("queue:celery", app=app)
    _release(app)
    assert _events(result.id, app) == ["parked", "held", "released"]


@pytest.mark.parametrize(
    ("limits", "by"),
    [
        # A key's own lane keeps the spaces of its key...
        ({"limit_key:ten*": {"rate": "1/h", "burst": 1}}, "limit_key:ten ant 1"),
        # ...and the lane of a key under a queue's limit names the queue alone
        ({"queue:celery": {"rate": "1/h", "burst": 1}}, "queue:celery"),
    ],
    ids=["key-limit", "queue-limit"],
)
def test_held_by_a_rate_limit_names_the_control_whatever_the_limit_key_holds(
    make_test_app: AppFactory, limits: dict[str, object], by: str
) -> None:
    app = make_test_app(conf={"zdelay_rate_limits": limits})
    record = app.tasks["tests.record"]
    results = [record.apply_delayed((i,), countdown=0, limit_key="ten ant 1") for i in range(2)]
    _release(app)

    # (the bucket of one lets one go; the other is held)
    held = [celery_zdelay.history(r.id, app=app)[-1] for r in results]
    assert [(h.event, h.reason, h.by) for h in held if h.event == "held"] == [
        ("held", "rate_limit", by)
    ]


def test_dead_lettered_requeued_and_purged(app: Celery) -> None:
    result = app.tasks["tests.record"].apply_delayed((1,), countdown=0)
    store = store_for(app)
    claimed = store.claim(0, limit=10, lease_ms=HOUR)
    assert store.dead_letter(0, claimed.token, [(result.id, REASON)]) == 1
    assert celery_zdelay.store.deadletters.requeue_dead(store, [result.id]) == [True]
    claimed = store.claim(0, limit=10, lease_ms=HOUR)
    assert store.dead_letter(0, claimed.token, [(result.id, REASON)]) == 1
    assert store.purge_dead(0, [result.id, "never-dead"]) == 1

    events = celery_zdelay.history(result.id, app=app)
    assert [e.event for e in events] == ["parked", "dead", "requeued", "dead", "purged"]
    assert events[1].reason == "bad signature"
    # An id purge was given but never dead: nothing recorded for it
    assert celery_zdelay.history("never-dead", app=app) == []


def test_a_task_rescheduled_many_times_keeps_its_last_fifty_events(
    app: Celery, redis_client: redis.Redis
) -> None:
    result = app.tasks["tests.record"].apply_delayed((1,), countdown=3600)
    store = store_for(app)
    for n in range(80):
        assert store.reschedule(result.id, Due("r", HOUR + n)) is not None

    events = celery_zdelay.history(result.id, app=app)
    assert len(events) == 50
    assert {e.event for e in events} == {"rescheduled"}
    # The newest kept: the last due time given is the last event's
    last = events[-1].due
    assert last is not None
    assert abs((last - events[-1].at) - timedelta(milliseconds=HOUR + 79)) < timedelta(seconds=1)


def test_history_seconds_zero_records_nothing_and_touches_no_key(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = make_test_app(conf={"zdelay_history_seconds": 0})
    task = app.tasks["tests.record"]
    cancelled = task.apply_delayed((1,), countdown=3600, tags=["t"])
    celery_zdelay.cancel(cancelled.id, app=app, by="alice")
    released = task.apply_delayed((2,), countdown=0)
    _release(app)

    assert celery_zdelay.history(cancelled.id, app=app) == []
    assert celery_zdelay.history(released.id, app=app) == []
    keys = shard_keys(store_for(app).config.key_prefix, 0)
    assert redis_client.exists(keys.history) == 0


def test_an_expired_history_is_not_read_and_the_sweep_deletes_it_and_no_other(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given a task whose history is kept 2 s, and one parked 1.2 s later
    app = make_test_app(conf={"zdelay_history_seconds": 2})
    store = store_for(app)
    old = app.tasks["tests.record"].apply_delayed((1,), countdown=3600)
    assert _events(old.id, app) == ["parked"]
    parked_ms = store.time_ms()
    wait_for(lambda: store.time_ms() > parked_ms + 1200, timeout=5)
    new = app.tasks["tests.record"].apply_delayed((2,), countdown=3600)
    keys = store.keys(0)

    # When the first one's time is over: read as gone, before any sweep
    wait_for(lambda: celery_zdelay.history(old.id, app=app) == [], timeout=10)
    assert redis_client.hexists(keys.history, old.id)

    # Then a sweep (a whole scan) deletes it, and keeps the one not expired
    deleted, cursor = 0, 0
    while True:
        cursor, step = sweep_history(store, 0, cursor, 10)
        deleted += step
        if cursor == 0:
            break
    assert deleted == 1
    assert not redis_client.hexists(keys.history, old.id)
    assert _events(new.id, app) == ["parked"]


def test_a_new_event_keeps_the_record_longer(make_test_app: AppFactory) -> None:
    # Kept for zdelay_history_seconds after the *last* event: a record whose
    # first event is older than that, but not its last, is read and kept
    app = make_test_app(conf={"zdelay_history_seconds": 1})
    store = store_for(app)
    result = app.tasks["tests.record"].apply_delayed((1,), countdown=3600)
    parked_ms = store.time_ms()
    wait_for(lambda: store.time_ms() > parked_ms + 700, timeout=5)
    celery_zdelay.cancel(result.id, app=app)
    wait_for(lambda: store.time_ms() > parked_ms + 1100, timeout=5)

    assert _events(result.id, app) == ["parked", "cancelled"]
    assert sweep_history(store, 0, 0, 1000) == (0, 0)


def test_a_history_key_of_another_type_is_refused_before_anything_moves(
    app: Celery, redis_client: redis.Redis
) -> None:
    result = app.tasks["tests.record"].apply_delayed((1,), countdown=3600)
    store = store_for(app)
    keys = store.keys(store.shard_of(result.id))
    redis_client.delete(keys.history)
    redis_client.set(keys.history, "not a hash")

    with pytest.raises(celery_zdelay.ZDelayError, match="WRONGTYPE"):
        celery_zdelay.cancel(result.id, app=app)

    assert redis_client.zscore(keys.due, result.id) is not None


def test_held_by_a_rate_limit_says_rate_limit_and_which_control(app: Celery) -> None:
    # A limit of one a minute, burst 1: of two tasks due now, one goes, one is held
    celery_zdelay.set_rate_limit("task:tests.record", {"rate": "1/m", "burst": 1}, app=app)
    task = app.tasks["tests.record"]
    results = [task.apply_delayed((n,), countdown=0) for n in range(2)]
    _release(app)

    last = {r.id: celery_zdelay.history(r.id, app=app)[-1] for r in results}
    assert sorted(e.event for e in last.values()) == ["held", "released"]
    (held,) = [e for e in last.values() if e.event == "held"]
    assert (held.reason, held.by) == ("rate_limit", "task:tests.record")


def test_held_by_a_concurrency_control_says_concurrency_and_which_control(
    make_test_app: AppFactory,
) -> None:
    # One at a time per tenant: of two tasks of tenant a due now, one goes, one waits
    control = "limit_key:tenant:*"
    app = make_test_app(conf={"zdelay_concurrency": {control: 1}})
    task = app.tasks["tests.record"]
    results = [
        task.apply_delayed((n,), countdown=0, headers={"zdelay_limit_key": "tenant:a"})
        for n in range(2)
    ]
    _release(app)

    last = {r.id: celery_zdelay.history(r.id, app=app)[-1] for r in results}
    assert sorted(e.event for e in last.values()) == ["held", "released"]
    (held,) = [e for e in last.values() if e.event == "held"]
    # The control, not the lane's slot name (which adds the limit key)
    assert (held.reason, held.by) == ("concurrency", control)
