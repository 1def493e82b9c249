"""A released message reaches the broker as it was parked: the generic publisher, on real brokers.

Pins what ``celery_zdelay/companion/publish/generic.py`` promises about each
message, where the target's list (which releases through companions and
workers) was too slow per mutant to measure (see docs/mutation.rst). Each
test drives :class:`Publisher` directly, with no store, worker or
companion, against a private redis-server used as the Celery broker or
RabbitMQ on loopback, and reads what arrived: a batch goes out exactly as
parked (body, headers, properties, routing), pipelined into one round trip
on Redis; the parked ``expires`` becomes the time left, never a stale
``expiration``; what a message needs (its queue, an exchange the app
defines) is declared first, once per channel, with a warning for a queue
the app does not configure; a message the broker refuses for its own sake
is rejected alone, one refused for the server's state waits alone; a
failure of the broker mid-batch keeps what went out before it and makes
the rest wait, and so does an unforeseen error, logged with its traceback.
The broker's side (unreachable, silent, closed; AWS's errors) is in
``tests/companion/publish/test_generic_publisher_connection.py``.
"""

from __future__ import annotations

import base64
import logging
from datetime import datetime, timedelta, timezone
from typing import Any

import kombu.exceptions
import pytest
import redis
from kombu import Connection, Exchange, Producer, Queue

from celery_zdelay.companion.publish.generic import Publisher, PublishOutcome
from celery_zdelay.entry import TaskMessage
from celery_zdelay.testing import RedisServer
from tests.conftest import RabbitMQ
from tests.support.logs import error_lines
from tests.support.publish import (
    ONE_BY_ONE,
    UNREACHABLE,
    WRONGTYPE,
    broker_app,
    generic_publisher,
    limited_user_url,
    pipeline_executes,
    rabbitmq_messages,
    redis_pushed,
    redis_queued,
    settled,
    task_ids,
    task_message,
    unreachable_lines,
    warmed_up,
)

pytestmark = pytest.mark.timeout(60)


# -- what is published: exactly the parked message ------------------------------------


@pytest.mark.kombu57
def test_a_pipelined_batch_reaches_a_redis_broker_as_parked_in_one_round_trip(
    broker_server: RedisServer, broker_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Breaks if: the batch is not pipelined (`batching is None`, `or`, `not`), or
    # _BATCH_COMMANDS becomes 0 (`1 >> 30`: kombu refuses the batch).
    publisher = generic_publisher(f"{broker_server.url}/0", Queue("q"), Queue("other"))
    try:
        warm = warmed_up(publisher)
        executes = pipeline_executes(monkeypatch)
        batch_ids = task_ids("a", 3)
        batch = [
            task_message(
                batch_ids[0],
                "q",
                body=b'[[1, 2], {"k": "v"}, {}]',
                headers={"eta": None, "retries": 2, "root_id": "r-1"},
                properties={"reply_to": "reply-q"},
            ),
            task_message(batch_ids[1], "other"),
            task_message(batch_ids[2], "q"),
        ]
        assert settled(publisher.publish(batch)) == ([0, 1, 2], {}, None)
    finally:
        publisher.close()
    assert executes == [3]
    assert redis_queued(broker_client, "q") == [warm[0], batch_ids[0], batch_ids[2]]
    assert redis_queued(broker_client, "other") == [warm[1], batch_ids[1]]
    pushed = redis_pushed(broker_client, "q")[1]
    parked = batch[0]
    assert base64.b64decode(pushed["body"]) == parked.body
    assert pushed["headers"] == parked.headers
    assert (pushed["content-type"], pushed["content-encoding"]) == ("application/json", "utf-8")
    properties = pushed["properties"]
    assert properties["delivery_info"] == {"exchange": "", "routing_key": "q"}
    assert (properties["correlation_id"], properties["reply_to"]) == (batch_ids[0], "reply-q")
    assert (properties["delivery_mode"], properties["priority"]) == (2, 0)
    assert "expiration" not in properties


def test_the_parked_expires_is_published_as_the_time_left_never_a_stale_expiration(
    broker_server: RedisServer, broker_client: redis.Redis
) -> None:
    # Breaks if: `not expires` loses its `not`, the parse errors are not caught,
    # `when is None` or `tzinfo is None` is inverted, `when - now` becomes `+`,
    # or the floor `max(0.0, ...)` moves (an expired message would live a second).
    now = datetime.now(timezone.utc)
    ahead = now + timedelta(seconds=60)
    plus_two = timezone(timedelta(hours=2))
    expires = {
        "aware": ahead.isoformat(),
        "offset": ahead.astimezone(plus_two).isoformat(),
        "naive": ahead.replace(tzinfo=None).isoformat(),
        "past": (now - timedelta(seconds=30)).isoformat(),
        "garbled": "soon",
        "number": 5,
    }
    stale = {"expiration": "123"}  # Celery's own, from when it was parked
    batch = [
        task_message(name, "q", headers={"expires": value}, properties=stale)
        for name, value in expires.items()
    ]
    batch.append(task_message("none", "q", properties=stale))
    publisher = generic_publisher(f"{broker_server.url}/0", Queue("q"))
    try:
        assert settled(publisher.publish(batch)) == (list(range(len(batch))), {}, None)
    finally:
        publisher.close()
    expiration = {
        m["headers"]["id"]: m["properties"].get("expiration")
        for m in redis_pushed(broker_client, "q")
    }
    for name in ("aware", "offset", "naive"):
        assert 50_000 <= int(expiration[name]) <= 60_000, (name, expiration[name])
    assert expiration["past"] == "0"
    assert (expiration["garbled"], expiration["number"], expiration["none"]) == (None,) * 3


def test_a_message_reaches_rabbitmq_as_parked_its_queue_declared_first(
    rabbitmq: RabbitMQ, caplog: pytest.LogCaptureFixture
) -> None:
    # Breaks if: the message's queues are not declared (the loop over
    # `message.declare` or `_entities` emptied, `name not in declared` or
    # `entity is not None` inverted): RabbitMQ drops what no queue takes.
    # Also: a queue the app does not configure is published to with one warning
    # per channel (the warning's `startswith("queue:")` check).
    other = f"{rabbitmq.queue}-b"
    with Connection(rabbitmq.url) as connection:
        Queue(other).bind(connection.default_channel).declare()
    caplog.set_level(logging.WARNING)
    publisher = Publisher(broker_app(rabbitmq.url, Queue(rabbitmq.queue)), broker_wait=5.0)
    mine, theirs = task_ids("m", 2), task_ids("o", 2)
    batch = [
        task_message(
            mine[0],
            rabbitmq.queue,
            priority=3,
            headers={"retries": 1},
            properties={"reply_to": "replies"},
        ),
        task_message(theirs[0], other),
        task_message(mine[1], rabbitmq.queue),
        task_message(theirs[1], other),
        # To an exchange of RabbitMQ's own, routed nowhere: published, no warning.
        task_message("nowhere", "", exchange="amq.topic", routing_key="nobody.listens"),
    ]
    try:
        assert settled(publisher.publish(batch)) == ([0, 1, 2, 3, 4], {}, None)
    finally:
        publisher.close()
    got = rabbitmq_messages(rabbitmq.url, rabbitmq.queue, 2)
    assert [m.headers["id"] for m in got] == mine
    first, parked = got[0], batch[0]
    assert first.body == parked.body.decode()
    assert first.headers == parked.headers
    assert (first.content_type, first.content_encoding) == ("application/json", "utf-8")
    assert first.delivery_info["routing_key"] == rabbitmq.queue
    assert first.delivery_info["exchange"] == ""
    props = first.properties
    assert (props["correlation_id"], props["reply_to"]) == (mine[0], "replies")
    assert (props["delivery_mode"], props["priority"]) == (2, 3)
    assert [m.headers["id"] for m in rabbitmq_messages(rabbitmq.url, other, 2)] == theirs
    warned = [r.getMessage() for r in caplog.records if "is not configured" in r.getMessage()]
    assert warned == [
        f"Queue {other} is not configured on this companion (task_queues) and "
        "task_create_missing_queues is off; publishing without declaring it"
    ]


def test_a_message_sent_to_an_exchange_by_name_declares_it_as_the_app_defines_it(
    rabbitmq: RabbitMQ,
) -> None:
    # Breaks if: `if exchange:` loses its test, the app's exchange is looked up
    # with `!=`, or the lookup keeps no match (`[:0]`) or reads a second (`[1]`).
    name = f"{rabbitmq.queue}-topic"
    topic = Exchange(name, type="topic")
    app = broker_app(
        rabbitmq.url,
        Queue(rabbitmq.queue),
        Queue(f"{rabbitmq.queue}-b", topic, routing_key="a.#"),
    )
    publisher = Publisher(app, broker_wait=5.0)
    try:
        sent = task_message("by-name", "", exchange=name, routing_key="a.b")
        assert settled(publisher.publish([sent])) == ([0], {}, None)
    finally:
        publisher.close()
    with Connection(rabbitmq.url) as connection:
        try:
            # It exists (a passive declare only checks), as a topic exchange:
            # declaring it so again is accepted.
            Exchange(name, type="topic", passive=True).bind(connection.default_channel).declare()
            topic.bind(connection.default_channel).declare()
        finally:
            Exchange(name).bind(connection.default_channel).delete()


def test_the_generic_publisher_asks_for_no_returns_it_would_never_read(
    rabbitmq: RabbitMQ,
) -> None:
    # Breaks if: `mandatory = True` on the generic publisher: RabbitMQ would
    # return the unroutable message, and nothing here reads returns.
    publisher = Publisher(broker_app(rabbitmq.url, Queue(rabbitmq.queue)), broker_wait=5.0)
    returned: list[Any] = []
    try:
        assert publisher.publish([task_message("warm", rabbitmq.queue)]).accepted == [0]
        assert publisher._producer is not None
        channel = publisher._producer.channel
        channel.events["basic_return"].add(lambda *args: returned.append(args))
        stray = task_message("stray", "", exchange="amq.direct", routing_key="nobody")
        assert settled(publisher.publish([stray])) == ([0], {}, None)
        # A round trip on the same channel: RabbitMQ sends a return before its answer.
        channel.exchange_declare("amq.direct", "direct", passive=True)
    finally:
        publisher.close()
    assert returned == []


# -- one message's refusal is its own ---------------------------------------------------


def test_one_by_one_a_message_redis_refuses_is_rejected_alone(
    broker_server: RedisServer, broker_client: redis.Redis
) -> None:
    # Breaks if: the per-message `except` catches nothing, a refusal is taken
    # for the broker's state (`server_state(...) is None`, the connection-error
    # checks inverted), or `continue` becomes `break` after a rejection.
    broker_client.set("bad", "a string where a queue should be")
    publisher = generic_publisher(
        f"{broker_server.url}/0", Queue("q"), Queue("bad"), options=ONE_BY_ONE
    )
    good = task_ids("g", 4)
    batch = [
        task_message(good[0], "q"),
        task_message("lost", "bad"),
        task_message(good[1], "q"),
        task_message(good[2], "q"),
    ]
    try:
        accepted, rejected, error = settled(publisher.publish(batch))
        assert (accepted, list(rejected), error) == ([0, 2, 3], [1], None)
        assert rejected[1].startswith("publish refused: ResponseError: ")
        assert rejected[1].endswith(WRONGTYPE)
        # The refusal was that message's: the next batch goes out on the same connection.
        assert settled(publisher.publish([task_message(good[3], "q")])) == ([0], {}, None)
    finally:
        publisher.close()
    assert redis_queued(broker_client, "q") == good
    assert broker_client.get("bad") == b"a string where a queue should be"


def test_one_by_one_a_push_refused_for_the_servers_state_waits_alone(
    broker_server: RedisServer, broker_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # Breaks if: the refusal's warning is not logged for the batch's first one
    # (`outcome.error is None` inverted), or `continue` becomes `break`.
    url = limited_user_url(broker_client, broker_server.port, ["q*", "_kombu*", "unacked*"])
    publisher = generic_publisher(url, Queue("q"), Queue("forbidden"), options=ONE_BY_ONE)
    good = task_ids("n", 2)
    caplog.set_level(logging.WARNING)
    try:
        batch = [task_message(good[0], "q"), task_message("held", "forbidden")]
        batch.append(task_message(good[1], "q"))
        accepted, rejected, error = settled(publisher.publish(batch))
        assert (accepted, rejected) == ([0, 2], {})
        assert isinstance(error, redis.exceptions.NoPermissionError)
        refusals = [r for r in caplog.records if "refused a push for now" in r.getMessage()]
        assert len(refusals) == 1
        broker_client.acl_setuser("limited", enabled=True, keys=["forbidden*"])
        assert settled(publisher.publish([batch[1]])) == ([0], {}, None)
    finally:
        publisher.close()
    assert redis_queued(broker_client, "q") == good
    assert redis_queued(broker_client, "forbidden") == ["held"]


@pytest.mark.kombu57
def test_a_pipelined_batch_kombu_fails_as_a_whole_waits_as_a_whole(
    broker_server: RedisServer, broker_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # Breaks if: kombu's BatchPublishError is not counted as the broker's state
    # (the `or` of `_is_connection_error` made `and`, publish's `if` negated), or
    # publish's `except` catches nothing (the error escapes the companion's loop).
    publisher = generic_publisher(f"{broker_server.url}/0", Queue("q"), Queue("bad"))
    batch = [task_message(i, "q") for i in task_ids("p", 2)]
    batch.insert(1, task_message("lost", "bad"))
    try:
        # Given its queues declared while they were lists, one then turned into a string,
        assert publisher.publish(batch).accepted == [0, 1, 2]
        broker_client.delete("bad")
        broker_client.set("bad", "not a list")
        caplog.set_level(logging.WARNING)
        accepted, rejected, error = settled(publisher.publish(batch))
    finally:
        publisher.close()
    # Delivery is uncertain: nothing counts, the whole batch waits.
    assert (accepted, rejected) == ([], {})
    assert isinstance(error, kombu.exceptions.BatchPublishError)
    assert unreachable_lines(caplog) == [f"{UNREACHABLE}, 3 messages wait: {error!r}"]
    assert error_lines(caplog, "") == 0


class _CutAt(Publisher):
    """A publisher whose broker connection fails as it publishes the message *cut*."""

    cut = "cut"

    def _publish_one(self, producer: Producer, message: TaskMessage) -> None:
        if message.task_id == self.cut:
            raise redis.exceptions.ConnectionError("Connection closed by server.")
        super()._publish_one(producer, message)


def test_a_failure_mid_batch_keeps_what_went_out_before_it_and_the_rest_waits(
    broker_server: RedisServer, broker_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # Breaks if: a connection error is rejected as the message's (`connection is
    # None` inverted, the connection_errors check negated), the count of
    # messages that wait adds what was accepted or rejected (`-` made `+`), or
    # what went out before the failure is not counted (given back, it would be
    # published again on every pass).
    broker_client.set("bad", "not a list")
    app = broker_app(f"{broker_server.url}/0", Queue("q"), Queue("bad"), options=ONE_BY_ONE)
    publisher = _CutAt(app, broker_wait=5.0)
    good = task_ids("c", 3)
    caplog.set_level(logging.WARNING)
    batch = [
        task_message(good[0], "q"),
        task_message("lost", "bad"),
        task_message(good[1], "q"),
        task_message("cut", "q"),
        task_message(good[2], "q"),
    ]
    try:
        accepted, rejected, error = settled(publisher.publish(batch))
    finally:
        publisher.close()
    assert (accepted, list(rejected)) == ([0, 2], [1])
    assert isinstance(error, redis.exceptions.ConnectionError)
    assert unreachable_lines(caplog) == [f"{UNREACHABLE}, 2 messages wait: {error!r}"]
    assert redis_queued(broker_client, "q") == good[:2]


class _Unforeseen(Publisher):
    """A publisher with a bug past kombu's flush, where no message is to blame."""

    def _settle_batch(self, sent: list[int], outcome: PublishOutcome) -> list[int]:
        raise RuntimeError("a bug in settling the batch")


@pytest.mark.kombu57
def test_an_unforeseen_error_keeps_the_batch_and_logs_its_traceback(
    broker_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    # Breaks if: the unforeseen error is logged without its traceback
    # (`exc_info=False`), or taken for the broker's state.
    publisher = _Unforeseen(broker_app(f"{broker_server.url}/0", Queue("q")), broker_wait=5.0)
    caplog.set_level(logging.WARNING)
    try:
        outcome = publisher.publish([task_message(i, "q") for i in task_ids("b", 2)])
    finally:
        publisher.close()
    assert (outcome.accepted, outcome.rejected) == ([], {})
    assert isinstance(outcome.error, RuntimeError)
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.getMessage() == (
        f"Publishing failed unexpectedly, 2 messages wait: {outcome.error!r}"
    )
    assert record.exc_info is not None
    assert record.exc_info[1] is outcome.error
    assert unreachable_lines(caplog) == []
