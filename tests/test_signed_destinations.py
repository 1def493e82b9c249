"""A signed entry goes only where it was signed to go.

The signature covers the message and where it is published: the Redis list
the handoff pushes to (``k``) and the queues declared for it (``q``). An
attacker who can write to Redis, but has no key, may try to send a signed
task elsewhere by every record that names a destination: the template the
entry refers to, the entry itself (rewritten into the single-part form,
which carries ``k`` and ``q`` in its own metadata line), or a route record
(the form ``zdelay_whole_messages`` parks). Each attempt is dead-lettered
and nothing is published, on every path: the atomic handoff (push.lua), the
generic kombu publish, and a dead letter requeued by an operator.

Each test catches this one-line change in ``entry.entry_signature``::

    return hmac.digest(key, routing + head, "sha256").hex()
    ->  return hmac.digest(key, head, "sha256").hex()

(the signature no longer covering the destination list and declared
queues): the redirected entry is then published. A route record cannot
carry a signature at all, so the route-record attack is refused as an
unsigned entry; it catches, in ``entry.decode_entry``::

    if signing_keys:  ->  if signing_keys and "s" in meta:

(entries without a signature accepted when a signing key is set).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

import pytest
import redis
from celery import Celery

from celery_zdelay.companion import Companion
from celery_zdelay.entry import expand_entry, template_id
from celery_zdelay.parking import store_for
from celery_zdelay.store.admin import requeue_dead
from celery_zdelay.store.dead_reason import DeadReason
from celery_zdelay.testing import RedisServer
from tests.conftest import BROKER_DB, AppFactory
from tests.support.deadletters import dead_reasons
from tests.support.keys import SHARD0

pytestmark = pytest.mark.timeout(90)

KEY = "k" * 32
#: The queue the task was signed for, and the one the attacker wants.
SIGNED_FOR, ELSEWHERE = "celery", "other"
QUEUES = [{"name": SIGNED_FOR}, {"name": ELSEWHERE}]

Attack = Callable[[redis.Redis, str], None]


def _line(meta: object) -> bytes:
    return json.dumps(meta, separators=(",", ":")).encode()


def _redirect_template(client: redis.Redis, task_id: str, field: str) -> None:
    """Refer the entry to a template of the attacker's: same text, other destination."""
    payload = client.hget(SHARD0.msg, task_id)
    assert payload is not None
    meta_line, blob = payload.split(b"\n", 1)
    meta = json.loads(meta_line)
    record = client.hget(SHARD0.templates, meta["t"])
    assert record is not None
    template_line, text = record.split(b"\n", 1)
    template_meta = json.loads(template_line)
    template_meta[field] = ELSEWHERE if field == "k" else [ELSEWHERE]
    # A well-formed record: its id is its hash, as the companion checks.
    forged = _line(template_meta) + b"\n" + text
    forged_id = template_id(forged)
    client.hset(SHARD0.templates, mapping={forged_id: forged, f"#{forged_id}": 1})
    meta["t"] = forged_id
    client.hset(SHARD0.msg, task_id, _line(meta) + b"\n" + blob)


def _redirect_entry(client: redis.Redis, task_id: str, field: str) -> None:
    """Rewrite the entry into the single-part form, naming the other destination itself."""
    payload = client.hget(SHARD0.msg, task_id)
    assert payload is not None
    single = expand_entry(payload, lambda ref: client.hget(SHARD0.templates, ref))
    meta_line, head = single.split(b"\n", 1)
    meta = json.loads(meta_line)
    assert "s" in meta  # the genuine signature travels with the rewritten entry
    meta[field] = ELSEWHERE if field == "k" else [ELSEWHERE]
    client.hset(SHARD0.msg, task_id, _line(meta) + b"\n" + head)


def _redirect_by_route_record(client: redis.Redis, task_id: str) -> None:
    """Park the signed message in the whole form, behind a route record to the other queue."""
    payload = client.hget(SHARD0.msg, task_id)
    assert payload is not None
    single = expand_entry(payload, lambda ref: client.hget(SHARD0.templates, ref))
    meta_line, head = single.split(b"\n", 1)
    meta = json.loads(meta_line)
    route = {"w": 1, "k": ELSEWHERE, "l": meta["l"], "q": [ELSEWHERE]}
    record = _line(route) + b"\n"
    route_id = template_id(record)
    client.hset(SHARD0.templates, mapping={route_id: record, f"#{route_id}": 1})
    tag = b'zdelay.%s.%s"}}' % (route_id.encode(), uuid.uuid4().hex.encode())
    client.hset(SHARD0.msg, task_id, head + tag)


ATTACKS: dict[str, Attack] = {
    "template-list": lambda client, task_id: _redirect_template(client, task_id, "k"),
    "template-queues": lambda client, task_id: _redirect_template(client, task_id, "q"),
    "entry-list": lambda client, task_id: _redirect_entry(client, task_id, "k"),
    "entry-queues": lambda client, task_id: _redirect_entry(client, task_id, "q"),
    "route-record": _redirect_by_route_record,
}


def _queued(client: redis.Redis) -> dict[str, int]:
    return {queue: int(client.llen(queue)) for queue in (SIGNED_FOR, ELSEWHERE)}


def _park_signed(app: Celery) -> str:
    record = app.tasks["tests.record"]
    return str(record.apply_delayed(("signed",), countdown=0, queue=SIGNED_FOR).id)


def _assert_refused(task_id: str, store_client: redis.Redis, broker_client: redis.Redis) -> None:
    reasons = dead_reasons(store_client)
    assert set(reasons) == {task_id}
    assert reasons[task_id].startswith(("bad signature", "unsigned entry")), reasons
    assert _queued(broker_client) == {SIGNED_FOR: 0, ELSEWHERE: 0}


@pytest.mark.parametrize("attack", ATTACKS)
def test_a_redirected_signed_entry_is_dead_lettered_on_the_atomic_handoff(
    make_test_app: AppFactory, redis_client: redis.Redis, attack: str
) -> None:
    # Given a signed task parked for the queue "celery", the broker on the
    # same Redis (so the companion verifies, then pushes with push.lua),
    app = make_test_app(conf={"zdelay_signing_key": KEY}, queues=QUEUES)
    task_id = _park_signed(app)
    # when an attacker points it at the queue "other", and a companion releases,
    ATTACKS[attack](redis_client, task_id)
    with Companion(app) as companion:
        report = companion.release_due()
    # then it is dead-lettered as forged, and no queue received it.
    assert (report.released, report.dead_lettered) == (0, 1)
    _assert_refused(task_id, redis_client, redis_client)


@pytest.mark.parametrize("attack", ATTACKS)
def test_a_redirected_signed_entry_is_dead_lettered_on_the_generic_publish(
    make_test_app: AppFactory,
    redis_client: redis.Redis,
    broker_server: RedisServer,
    attack: str,
) -> None:
    # Given a signed task parked for "celery", the broker another Redis (so
    # the companion publishes with kombu, declaring the entry's queues),
    app = make_test_app(
        broker=f"{broker_server.url}/{BROKER_DB}",
        conf={"zdelay_signing_key": KEY},
        queues=QUEUES,
    )
    task_id = _park_signed(app)
    # when an attacker points it at "other", and a companion releases,
    ATTACKS[attack](redis_client, task_id)
    with Companion(app) as companion:
        report = companion.release_due()
    # then nothing is published, and the entry is dead-lettered as forged.
    assert (report.released, report.dead_lettered) == (0, 1)
    _assert_refused(task_id, redis_client, broker_server.client(BROKER_DB))


@pytest.mark.parametrize("attack", ATTACKS)
def test_a_dead_letter_redirected_before_it_is_requeued_is_dead_lettered_again(
    make_test_app: AppFactory, redis_client: redis.Redis, attack: str
) -> None:
    # Given a genuine signed entry dead-lettered (its broker refused it once),
    app = make_test_app(conf={"zdelay_signing_key": KEY}, queues=QUEUES)
    task_id = _park_signed(app)
    store = store_for(app)
    claim = store.claim(0, limit=10, lease_ms=60_000)
    assert (
        store.dead_letter(
            0, claim.token, [(task_id, DeadReason("broker refused", due_ms=0, companion="test"))]
        )
        == 1
    )
    # when an attacker rewrites it, in the dead-letter set, to go to "other"
    # (the payload is moved to where the attack reads it, and back),
    stored = redis_client.hget(SHARD0.dead_msg, task_id)
    assert stored is not None
    reason_line, payload = stored.split(b"\n", 1)
    redis_client.hset(SHARD0.msg, task_id, payload)
    ATTACKS[attack](redis_client, task_id)
    forged = redis_client.hget(SHARD0.msg, task_id)
    assert forged is not None
    redis_client.hdel(SHARD0.msg, task_id)
    redis_client.hset(SHARD0.dead_msg, task_id, reason_line + b"\n" + forged)
    # and an operator requeues it,
    assert requeue_dead(store, [task_id]) == [True]
    with Companion(app) as companion:
        report = companion.release_due()
    # then it is verified again and dead-lettered again: never published.
    assert (report.released, report.dead_lettered) == (0, 1)
    _assert_refused(task_id, redis_client, redis_client)


def test_an_untouched_signed_entry_reaches_the_queue_it_was_signed_for(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # The control: without an attack the same setup publishes, so the
    # refusals above are the signature's doing, not the setup's.
    app = make_test_app(conf={"zdelay_signing_key": KEY}, queues=QUEUES)
    _park_signed(app)
    with Companion(app) as companion:
        report = companion.release_due()
    assert (report.released, report.dead_lettered) == (1, 0)
    assert _queued(redis_client) == {SIGNED_FOR: 1, ELSEWHERE: 0}
