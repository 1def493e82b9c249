"""What the model-based test (``test_state_model.py``) found, each as a plain story.

Each test is the counterexample Hypothesis shrank, written out by hand; each
failed on the code of its time and passes since its fix (issue 33).
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
from celery import Celery, states

import celery_zdelay
from celery_zdelay import steering
from celery_zdelay.companion import Companion
from celery_zdelay.parking import store_for
from celery_zdelay.store.marks import key_owner, tagged_ids
from tests.conftest import AppFactory
from tests.support.keys import PREFIX, SHARD0
from tests.support.store import held_sets

pytestmark = pytest.mark.timeout(60)

QUEUES = [{"name": "celery"}, {"name": "emails"}]


def _app(make_test_app: AppFactory) -> Celery:
    return make_test_app(queues=QUEUES)


def _one_pass(app: Celery) -> None:
    """One companion pass, in this process: what is due and paused moves to its held set."""
    with Companion(app) as companion:
        companion.release_due()


def _held(client: redis.Redis, control: str) -> list[str]:
    """The ids *control* holds on shard 0: by its rate limit, then by its pause."""
    return [m.decode() for key in held_sets(0, control, PREFIX) for m in client.zrange(key, 0, -1)]


@pytest.mark.parametrize("mode", ["replace", "debounce"])
def test_a_keyed_replace_cancels_the_owner_a_pause_holds(
    make_test_app: AppFactory, redis_client: redis.Redis, mode: str
) -> None:
    # Given a keyed task due now, held by a pause of its queue
    app = _app(make_test_app)
    record = app.tasks["tests.record"]
    first = record.apply_delayed((1,), countdown=0, queue="emails", key="k1")
    celery_zdelay.pause("queue:emails", app=app)
    _one_pass(app)
    assert _held(redis_client, "queue:emails") == [first.id]

    # When a second call with the key replaces it
    second = record.apply_delayed((2,), countdown=3600, queue="emails", key="k1", on_key=mode)

    # Then the held task is gone (REVOKED) and only the new one is parked
    assert second.id != first.id
    assert _held(redis_client, "queue:emails") == []
    assert celery_zdelay.lookup(first.id, app=app) is None
    assert key_owner(store_for(app), "k1") == (second.id, None)


def test_a_task_replaced_by_key_ends_revoked(make_test_app: AppFactory) -> None:
    # Given a keyed task parked for an hour
    app = _app(make_test_app)
    record = app.tasks["tests.record"]
    first = record.apply_delayed((1,), countdown=3600, key="k1")

    # When a call with on_key="replace" replaces it
    second = record.apply_delayed((2,), countdown=3600, key="k1", on_key="replace")

    # Then the first is REVOKED in the result backend, as every cancel leaves it
    assert second.id != first.id
    assert celery_zdelay.lookup(first.id, app=app) is None
    assert app.backend.get_task_meta(first.id)["status"] == states.REVOKED


def test_an_id_parked_again_without_key_or_tags_drops_its_earlier_key_and_tags(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given a task parked under its own id with a key and a tag
    app = _app(make_test_app)
    record = app.tasks["tests.record"]
    record.apply_delayed((1,), countdown=7200, task_id="id-2", key="k2", tags=["t1"])

    # When the same id is parked again, plainly (a new message: no key, no tag)
    record.apply_delayed((2,), countdown=3600, task_id="id-2")

    # Then the entry is the new one, and the index forgets the old key and tag:
    # the key is free for others and the tag no longer selects the entry
    assert celery_zdelay.lookup("id-2", app=app) is not None
    assert redis_client.hget(SHARD0.marks, "i:id-2") is None
    assert key_owner(store_for(app), "k2") is None
    assert tagged_ids(store_for(app), "t1") == []
    other: Any = record.apply_delayed((3,), countdown=3600, key="k2")
    assert other.id != "id-2"


def test_a_dead_letter_requeued_after_its_key_was_taken_leaves_no_empty_record(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given a keyed task dead-lettered (its queue's list is a string key)
    app = _app(make_test_app)
    record = app.tasks["tests.record"]
    redis_client.set("poison", "not a list")
    dead = record.apply_delayed((1,), countdown=0, key="k1", queue="poison")
    _one_pass(app)
    assert redis_client.zscore(SHARD0.dead, dead.id) is not None

    # ...and a new task that took its key meanwhile
    owner = record.apply_delayed((2,), countdown=3600, key="k1")

    # When the dead letter is requeued: parked again, without the key
    assert steering.requeue_dead([dead.id], app=app) == [True]

    # Then the key stays with the new task, and the requeued entry, with
    # neither key nor tags, has no record in the index (as any unmarked entry)
    assert key_owner(store_for(app), "k1") == (owner.id, None)
    assert redis_client.hget(SHARD0.marks, f"i:{dead.id}") is None


def test_an_id_dead_lettered_again_without_its_key_leaves_no_record_of_the_old_one(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given a keyed task dead-lettered (its queue's list is a string key)
    app = _app(make_test_app)
    record = app.tasks["tests.record"]
    redis_client.set("poison", "not a list")
    record.apply_delayed((1,), countdown=0, task_id="id-1", key="k1", queue="poison")
    _one_pass(app)
    assert redis_client.hget(SHARD0.marks, "d:id-1") is not None

    # When the same id is parked again, plainly, and dead-lettered again
    record.apply_delayed((2,), countdown=0, task_id="id-1", queue="poison")
    _one_pass(app)

    # Then the dead letter is the new one, and the index keeps nothing of the
    # old one: no record a requeue would give back the old key with
    assert redis_client.zscore(SHARD0.dead, "id-1") is not None
    assert redis_client.hget(SHARD0.marks, "d:id-1") is None
    found = celery_zdelay.lookup("id-1", app=app)
    assert found is not None
    assert found.key is None
    assert steering.requeue_dead(["id-1"], app=app) == [True]
    assert key_owner(store_for(app), "k1") is None
    assert redis_client.hget(SHARD0.marks, "i:id-1") is None


def test_an_id_parked_again_while_held_is_in_one_state_only(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given a task due now under its own id, held by a pause of its queue
    app = _app(make_test_app)
    record = app.tasks["tests.record"]
    record.apply_delayed((1,), countdown=0, queue="emails", task_id="id-1")
    celery_zdelay.pause("queue:emails", app=app)
    _one_pass(app)
    assert _held(redis_client, "queue:emails") == ["id-1"]

    # When the same id is parked again, due in an hour
    record.apply_delayed((2,), countdown=3600, queue="emails", task_id="id-1")

    # Then it is parked once: in the due set, due in an hour, and held no more
    # (else the held copy goes out on resume and the new message is lost)
    assert redis_client.zscore(SHARD0.due, "id-1") is not None
    assert _held(redis_client, "queue:emails") == []


def test_tasks_held_by_a_task_pause_go_out_under_their_queues_limit_on_resume(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given a queue limited to 1/h (burst 1) and three of its tasks held by a
    # pause of their task
    app = _app(make_test_app)
    record = app.tasks["tests.record"]
    celery_zdelay.set_rate_limit("queue:emails", "1/h", burst=1, app=app)
    celery_zdelay.pause("task:tests.record", app=app)
    for n in range(3):
        record.apply_delayed((n,), countdown=0, queue="emails")
    _one_pass(app)
    assert len(_held(redis_client, "task:tests.record")) == 3

    # When the task is resumed and a companion makes a pass
    celery_zdelay.resume("task:tests.record", app=app)
    _one_pass(app)

    # Then the queue's limit still holds: one goes out, two wait under it
    assert redis_client.llen("emails") == 1
    assert len(_held(redis_client, "queue:emails")) == 2


def test_a_task_id_with_a_newline_keeps_its_key_or_is_refused(
    make_test_app: AppFactory,
) -> None:
    # Given a keyed task parked under an id with a newline (Celery accepts it)
    app = _app(make_test_app)
    record = app.tasks["tests.record"]
    try:
        record.apply_delayed((1,), countdown=3600, task_id="id\n3", key="k1")
    except celery_zdelay.ConfigurationError:
        return  # refused at the boundary, with a clear error: as good
    # Then the key's owner is that id, parked (not "id", running until 3 ms)
    assert key_owner(store_for(app), "k1") == ("id\n3", None)
    # ...and a keep call with the key parks nothing
    kept = record.apply_delayed((2,), countdown=3600, key="k1", on_key="keep")
    assert kept.id == "id\n3"
