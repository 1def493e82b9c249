"""A message counts as published on a Redis broker once its own reply says so.

Pins what ``celery_zdelay/companion/publish/redis_broker.py`` promises,
where mutation testing found its list (which releases through companions
and workers) far too slow per mutant (see docs/mutation.rst). Each test
drives :class:`RedisPublisher` directly against a private redis-server used
as the Celery broker, with no store, worker or companion: a batch is pushed
to kombu's list of each queue (a priority's own list for a priority), in
order and in one round trip, and counted accepted (``_settle_batch``); a
push Redis refuses for the message's sake (``WRONGTYPE``) rejects that
message alone, with Redis's reply as the reason, whichever of its commands
(a queue with ``x-expires`` sends five) failed (``_reply_keeping_batch``,
``_ReplyKeepingPipeline.execute``); a push refused for the server's state
(``NOPERM``) leaves its message waiting, neither accepted nor rejected, and
gives the error back; a message over the server's ``proto-max-bulk-len``,
read when the publisher connects, is rejected before it is sent
(``_open_producer``, ``_publish_one``); a batch's failures are not carried
into the next batch. The pipeline's bookkeeping keeps the owners of
commands not yet flushed for the next flush, and fails a flush with a reply
no message owns rather than drop it; ``broker_wait`` is a keyword argument.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from kombu import Queue

from celery_zdelay.companion.publish import RedisPublisher
from celery_zdelay.companion.publish.redis_broker import _ReplyKeepingPipeline
from celery_zdelay.testing import RedisServer
from tests.support.publish import (
    WRONGTYPE,
    broker_app,
    limited_user_url,
    pipeline_executes,
    redis_queued,
    settled,
    task_ids,
    task_message,
    warmed_up,
)

pytestmark = pytest.mark.timeout(60)

#: Redis's least proto-max-bulk-len (1 MiB).
SMALL_BULK_LIMIT = 1024 * 1024

#: kombu's separator between a queue's name and its priority step.
PRIORITY_SEP = "\x06\x16"


def _publisher(url: str, *queues: Queue) -> RedisPublisher:
    return RedisPublisher(broker_app(url, *queues), broker_wait=5.0)


@pytest.fixture
def publisher(broker_server: RedisServer) -> Iterator[RedisPublisher]:
    made = _publisher(f"{broker_server.url}/0", Queue("q"), Queue("other"))
    yield made
    made.close()


@pytest.mark.kombu57
def test_a_batch_is_pushed_to_kombus_list_in_order_in_one_round_trip_and_accepted(
    publisher: RedisPublisher, broker_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first batch connects (reading the server's bulk limit) and declares both queues.
    warm = warmed_up(publisher)
    executes = pipeline_executes(monkeypatch)
    ids = task_ids("a", 4)
    batch = [
        task_message(ids[0], "q"),
        task_message(ids[1], "other"),
        *(task_message(i, "q") for i in ids[2:]),
    ]
    assert settled(publisher.publish(batch)) == ([0, 1, 2, 3], {}, None)
    assert executes == [4]
    assert redis_queued(broker_client, "q") == [warm[0], ids[0], *ids[2:]]
    assert redis_queued(broker_client, "other") == [warm[1], ids[1]]


def test_a_message_with_a_priority_is_pushed_to_its_steps_own_list(
    publisher: RedisPublisher, broker_client: redis.Redis
) -> None:
    ids = task_ids("p", 4)
    batch = [task_message(i, "q", priority=p) for i, p in zip(ids, [0, 5, 9, 2], strict=True)]
    assert settled(publisher.publish(batch)) == ([0, 1, 2, 3], {}, None)
    # kombu's steps are 0, 3, 6 and 9: 5 goes to 3's list, 2 to the queue's own.
    assert redis_queued(broker_client, "q") == [ids[0], ids[3]]
    assert redis_queued(broker_client, f"q{PRIORITY_SEP}3") == [ids[1]]
    assert redis_queued(broker_client, f"q{PRIORITY_SEP}9") == [ids[2]]


def test_a_wrongtype_queue_rejects_its_message_alone_with_redis_reply(
    publisher: RedisPublisher, broker_client: redis.Redis
) -> None:
    broker_client.set("bad", "a string where a queue should be")
    ids = task_ids("g", 4)
    batch = [
        task_message(ids[0], "q"),
        task_message("lost-1", "bad"),
        task_message(ids[1], "q"),
        task_message("lost-2", "bad"),
        task_message(ids[2], "other"),
    ]
    accepted, rejected, error = settled(publisher.publish(batch))
    assert (accepted, error) == ([0, 2, 4], None)
    reason = f"publish refused: ResponseError: {WRONGTYPE}"
    assert rejected == {1: reason, 3: reason}
    assert redis_queued(broker_client, "q") == ids[:2]
    assert redis_queued(broker_client, "other") == [ids[2]]
    assert broker_client.get("bad") == b"a string where a queue should be"
    # The refusals were this batch's: the next one, good, is all accepted.
    assert settled(publisher.publish([task_message(ids[3], "q")])) == ([0], {}, None)
    assert redis_queued(broker_client, "q") == [*ids[:2], ids[3]]


@pytest.mark.kombu57
def test_a_refusal_is_its_own_message_when_messages_send_several_commands(
    broker_server: RedisServer, broker_client: redis.Redis
) -> None:
    # A queue with x-expires: each push is an LPUSH and a PEXPIRE per
    # priority step, five commands for one message.
    expiring = Queue("exp", queue_arguments={"x-expires": 60_000})
    publisher = _publisher(f"{broker_server.url}/0", expiring, Queue("q"))
    broker_client.set("bad", "not a list")
    ids = task_ids("e", 4)
    batch = [
        task_message(ids[0], "exp"),
        task_message(ids[1], "exp"),
        task_message("lost", "bad"),
        task_message(ids[2], "q"),
        task_message(ids[3], "exp"),
    ]
    try:
        accepted, rejected, error = settled(publisher.publish(batch))
    finally:
        publisher.close()
    assert (accepted, error) == ([0, 1, 3, 4], None)
    assert rejected == {2: f"publish refused: ResponseError: {WRONGTYPE}"}
    assert redis_queued(broker_client, "exp") == [ids[0], ids[1], ids[3]]
    assert redis_queued(broker_client, "q") == [ids[2]]
    assert 0 < broker_client.pttl("exp") <= 60_000


def test_the_first_refusal_of_a_message_is_its_reason(
    broker_server: RedisServer, broker_client: redis.Redis
) -> None:
    # Given an expiring queue declared while it was a list, then turned into
    # a string, and a user who may no longer run PEXPIRE,
    url = limited_user_url(broker_client, broker_server.port, ["*"])
    publisher = _publisher(url, Queue("bad", queue_arguments={"x-expires": 60_000}), Queue("q"))
    ids = task_ids("f", 2)
    try:
        assert settled(publisher.publish([task_message("declared", "bad")])) == ([0], {}, None)
        broker_client.delete("bad")
        broker_client.set("bad", "not a list")
        broker_client.acl_setuser("limited", enabled=True, commands=["-pexpire"])
        outcome = publisher.publish([task_message(ids[0], "q"), task_message("lost", "bad")])
    finally:
        publisher.close()
    # its LPUSH is refused for the message (WRONGTYPE), then its PEXPIREs for
    # the user's rights (NOPERM, which would wait): the first refusal counts.
    assert settled(outcome) == ([0], {1: f"publish refused: ResponseError: {WRONGTYPE}"}, None)
    assert redis_queued(broker_client, "q") == ids[:1]


def test_a_push_refused_for_the_servers_state_waits_and_its_error_is_given_back(
    broker_server: RedisServer, broker_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a user who may not write one queue,
    url = limited_user_url(broker_client, broker_server.port, ["q*", "_kombu*", "unacked*"])
    publisher = _publisher(url, Queue("q"), Queue("forbidden"))
    ids = task_ids("n", 3)
    caplog.set_level(logging.WARNING)
    try:
        batch = [
            task_message(ids[0], "q"),
            task_message(ids[1], "forbidden"),
            task_message(ids[2], "q"),
        ]
        accepted, rejected, error = settled(publisher.publish(batch))
        # then the refused message is neither accepted nor rejected: it waits,
        assert (accepted, rejected) == ([0, 2], {})
        assert isinstance(error, redis.exceptions.NoPermissionError)
        assert "Redis broker refused a push for now, it waits" in caplog.text
        # and once the user may write it, it goes out on the same connection.
        broker_client.acl_setuser("limited", enabled=True, keys=["forbidden*"])
        assert settled(publisher.publish([task_message(ids[1], "forbidden")])) == ([0], {}, None)
    finally:
        publisher.close()
    assert redis_queued(broker_client, "q") == [ids[0], ids[2]]
    assert redis_queued(broker_client, "forbidden") == [ids[1]]


def test_a_message_over_the_bulk_limit_read_on_connect_is_rejected_unsent(
    broker_server: RedisServer, broker_client: redis.Redis
) -> None:
    # Given a server whose proto-max-bulk-len was lowered before the publisher connected,
    broker_client.config_set("proto-max-bulk-len", SMALL_BULK_LIMIT)
    publisher = _publisher(f"{broker_server.url}/0", Queue("q"))
    ids = task_ids("b", 3)
    # a body whose base64 alone is over it (786 433 bytes: 1 048 580 as base64)
    big = task_message("big", "q", body=b"x" * (SMALL_BULK_LIMIT // 4 * 3 + 1))
    try:
        outcome = publisher.publish([task_message(ids[0], "q"), big, task_message(ids[1], "q")])
        # is rejected with the reason, not sent: the others go out, and so does the next batch.
        assert (outcome.accepted, outcome.error) == ([0, 2], None)
        assert list(outcome.rejected) == [1]
        assert outcome.rejected[1].startswith(
            "publish refused: MessageTooLarge: the message is 1048580 bytes, "
            "over the Redis broker's proto-max-bulk-len (1048576 bytes)"
        )
        assert settled(publisher.publish([task_message(ids[2], "q")])) == ([0], {}, None)
    finally:
        publisher.close()
    assert redis_queued(broker_client, "q") == ids


def _push_to_a_list_and_to_a_string(broker_client: redis.Redis) -> Any:
    """A pipeline of two pushes, the second to a key that is not a list (refused)."""
    broker_client.set("bad", "not a list")
    pipeline = broker_client.pipeline(transaction=False)
    pipeline.lpush("q", "a")
    pipeline.lpush("bad", "b")
    return pipeline


def test_a_flush_leaves_the_owners_of_commands_it_did_not_send_for_the_next(
    broker_client: redis.Redis,
) -> None:
    # Given three commands owned (messages 0, 1, 2) of which two are in the pipeline,
    pipeline = _push_to_a_list_and_to_a_string(broker_client)
    batch = SimpleNamespace(owners=[0, 1, 2], failures={})
    replies = _ReplyKeepingPipeline(pipeline, batch).execute()
    # the flush reads each reply for its own message, and keeps the third's owner.
    assert replies[0] == 1
    assert isinstance(replies[1], redis.exceptions.ResponseError)
    assert batch.owners == [2]
    assert list(batch.failures) == [1]
    assert str(batch.failures[1]) == WRONGTYPE


def test_a_reply_no_message_owns_fails_the_flush_instead_of_being_dropped(
    broker_client: redis.Redis,
) -> None:
    # An error reply with no owner would be lost (its message counted as
    # published): the flush fails, and kombu gives the whole batch back.
    pipeline = _push_to_a_list_and_to_a_string(broker_client)
    batch = SimpleNamespace(owners=[0], failures={})
    with pytest.raises(ValueError, match="zip"):
        _ReplyKeepingPipeline(pipeline, batch).execute()


def test_the_broker_wait_is_a_keyword_argument(broker_server: RedisServer) -> None:
    app = broker_app(f"{broker_server.url}/0")
    with pytest.raises(TypeError):
        RedisPublisher(app, 5.0)  # type: ignore[call-arg]
    assert RedisPublisher(app=app, broker_wait=3.0).broker_wait == 3.0
