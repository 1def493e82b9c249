"""Signing that cannot be bypassed (issue 11, items 8 to 11).

The attacker can write to Redis but has no key. The rule: what is published
is byte for byte what the companion verified, bound to its entry id, on every
path. Each test plays one attack against a real Redis.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis
from celery import Celery

from celery_zdelay.companion import Companion
from celery_zdelay.parking import store_for
from celery_zdelay.store.admin import requeue_dead
from tests.conftest import AppFactory
from tests.support.deadletters import dead_reasons
from tests.support.keys import SHARD0

pytestmark = pytest.mark.timeout(90)

KEY = "k" * 32
DUE = SHARD0.due
MSG = SHARD0.msg
LEASE = SHARD0.lease
TEMPLATES = SHARD0.templates
DEAD_MSG = SHARD0.dead_msg


def _signed_app(make_test_app: AppFactory) -> Celery:
    return make_test_app(conf={"zdelay_signing_key": KEY})


def _queued(client: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in client.lrange("celery", 0, -1)]


def _template_ids(client: redis.Redis) -> list[bytes]:
    # The hash also holds each template's reference count, under "#<id>".
    return [key for key in client.hkeys(TEMPLATES) if not key.startswith(b"#")]


def test_a_template_swapped_after_the_companion_cached_it_is_never_published(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given a companion that has released one signed task (its template cached),
    app = _signed_app(make_test_app)
    record = app.tasks["tests.record"]
    record.apply_delayed(("first",), countdown=0)
    with Companion(app) as companion:
        assert companion.release_due().handed_off == 1
        redis_client.delete("celery")

        # when a legitimate call of the task is parked and an attacker then
        # rewrites its template record in Redis (same id, another task name),
        legit = record.apply_delayed(("second",), countdown=0)
        (template_id,) = _template_ids(redis_client)
        record_bytes = redis_client.hget(TEMPLATES, template_id)
        assert record_bytes is not None
        assert b'"task":"tests.record"' in record_bytes
        swapped = record_bytes.replace(b'"task":"tests.record"', b'"task":"tests.add"')
        redis_client.hset(TEMPLATES, template_id, swapped)
        report = companion.release_due()

    # then the message queued is the one that was signed and verified.
    assert report.handed_off == 1
    (message,) = _queued(redis_client)
    assert message["headers"]["id"] == legit.id
    assert message["headers"]["task"] == "tests.record"


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_a_cold_companion_refuses_a_swapped_template_as_missing(
    make_test_app: AppFactory, redis_client: redis.Redis, signed: bool
) -> None:
    # Unsigned entries promise no protection from someone who can write to
    # Redis, but a template record must still hash to its id, in Lua (the
    # handoff unsigned entries take) as in Python: a rewritten one is
    # missing, never expanded into another task.
    app = _signed_app(make_test_app) if signed else make_test_app()
    task_id = app.tasks["tests.record"].apply_delayed((1,), countdown=0).id
    (template_id,) = _template_ids(redis_client)
    record_bytes = redis_client.hget(TEMPLATES, template_id)
    assert record_bytes is not None
    redis_client.hset(
        TEMPLATES,
        template_id,
        record_bytes.replace(b'"task":"tests.record"', b'"task":"tests.add"'),
    )
    with Companion(app) as companion:
        companion.release_due()
    assert _queued(redis_client) == []
    assert dead_reasons(redis_client)[task_id].startswith("template missing")


def test_a_payload_rewritten_between_verification_and_push_is_not_published(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given an attacker's unsigned payload for the victim's id (captured from
    # an app without the key), and the victim's signed entry parked,
    record_unsigned = make_test_app().tasks["tests.record"]
    victim_id = "victim-0001"
    record_unsigned.apply_delayed(("forged",), countdown=3600, task_id=victim_id)
    forged = redis_client.hget(MSG, victim_id)
    assert forged is not None
    app = _signed_app(make_test_app)
    app.tasks["tests.record"].apply_delayed(("genuine",), countdown=0, task_id=victim_id)

    # when the attacker writes the forged payload right after the companion
    # verified the claimed one, before it pushes (check, then read),
    with Companion(app) as companion:
        real_push = companion.store.push

        def attacker_writes_then_push(*args: Any, **kwargs: Any) -> Any:
            redis_client.hset(MSG, victim_id, forged)
            return real_push(*args, **kwargs)

        companion.store.push = attacker_writes_then_push  # type: ignore[method-assign]
        report = companion.release_due()
        del companion.store.push  # no reference cycle left holding a connection

    # then what is queued is the verified, genuine message.
    assert report.handed_off == 1
    (message,) = _queued(redis_client)
    assert message["headers"]["id"] == victim_id
    assert message["headers"]["argsrepr"] == "('genuine',)"


def test_a_signed_payload_copied_under_other_ids_is_refused_as_a_replay(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given a signed entry and three copies of its payload an attacker wrote
    # under new ids,
    app = _signed_app(make_test_app)
    genuine = app.tasks["tests.record"].apply_delayed(("once",), countdown=0).id
    payload = redis_client.hget(MSG, genuine)
    assert payload is not None
    copies = [f"replay-{i}" for i in range(3)]
    for copy in copies:
        redis_client.hset(MSG, copy, payload)
        redis_client.zadd(DUE, {copy: 0})

    # when a companion releases them,
    with Companion(app) as companion:
        report = companion.release_due()

    # then the task is queued once, and each copy is dead-lettered as a replay.
    assert report.handed_off == 1
    assert [m["headers"]["id"] for m in _queued(redis_client)] == [genuine]
    reasons = dead_reasons(redis_client)
    assert set(reasons) == set(copies)
    assert all(reason.startswith("replayed entry") for reason in reasons.values())


def test_a_template_deleted_under_a_warm_companion_does_not_livelock(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given a companion with the template cached, and an entry parked whose
    # template record was then deleted from Redis,
    app = _signed_app(make_test_app)
    record = app.tasks["tests.record"]
    record.apply_delayed(("first",), countdown=0)
    with Companion(app) as companion:
        companion.release_due()
        redis_client.delete("celery")
        second = record.apply_delayed(("second",), countdown=0).id
        redis_client.delete(TEMPLATES)

        # when it releases, the entry is published from the verified bytes,
        # not skipped in silence and left to cycle between lease and due.
        report = companion.release_due()

    assert report.handed_off == 1
    assert [m["headers"]["id"] for m in _queued(redis_client)] == [second]
    assert redis_client.zcard(LEASE) == 0
    assert redis_client.zcard(DUE) == 0


def test_a_requeued_forgery_is_verified_again_and_dead_lettered_again(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = _signed_app(make_test_app)
    forged = make_test_app().tasks["tests.record"].apply_delayed(("x",), countdown=0).id
    with Companion(app) as companion:
        companion.release_due()
        assert dead_reasons(redis_client)[forged].startswith("unsigned entry")
        assert requeue_dead(store_for(app), [forged]) == [True]
        report = companion.release_due()
    assert report.dead_lettered == 1
    assert _queued(redis_client) == []
