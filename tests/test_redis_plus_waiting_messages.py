"""celery-redis-plus's waiting messages read as kombu reads them, and taken only while waiting.

:class:`celery_zdelay.redis_plus.RedisPlusBroker` is what ``zdelay adopt
--redis-plus`` reads the broker's Redis with. ``tests/test_adopt_redis_plus.py``
runs the whole story with the real celery-redis-plus (its Python 3.13
virtualenv, workers and a companion: about 90 s); these pin the reader
itself, against the mutants of ``redis_plus.py`` (see docs/mutation.rst),
with celery-redis-plus's keys written as its release 0.4.1 writes them (the
module's docstring): which messages wait and which a consumer holds, each
field of the message, when the index looks at one next, to the
millisecond, pages of a thousand tags, a payload not in kombu's format,
what a take removes and what it leaves, the queues under a prefix with
pattern characters, the broker's URL and prefix, and the consumers waiting
in BZMPOP on the broker's database only. A private Redis; no worker,
companion or Python 3.13.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from dataclasses import FrozenInstanceError
from typing import Any

import pytest
import redis
from celery import Celery

from celery_zdelay.errors import ConfigurationError
from celery_zdelay.redis_plus import RedisPlusBroker, Waiting
from celery_zdelay.testing import RedisServer
from tests.conftest import BROKER_DB
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(60)

#: An index score with a fraction of a millisecond: epoch seconds, a float.
NEXT_S = 1_900_000_000.1234
QUEUE = "celery"
CHANNEL = object()


@pytest.fixture
def broker(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis_server.client(BROKER_DB)
    yield client
    client.close()


@pytest.fixture
def plus(redis_server: RedisServer) -> Iterator[RedisPlusBroker]:
    reader = RedisPlusBroker(f"{redis_server.url}/{BROKER_DB}", channel=CHANNEL)
    yield reader
    reader.close()


def _payload(tag: str, body: bytes = b"[[1], {}, {}]", **extra: Any) -> bytes:
    """A message as kombu's virtual transport stores it: its body base64."""
    document = {
        "body": base64.b64encode(body).decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {"id": tag, "task": "tests.record"},
        "properties": {
            "body_encoding": "base64",
            "delivery_info": {"exchange": "", "routing_key": QUEUE},
            "delivery_tag": tag,
            "priority": 0,
        },
        **extra,
    }
    return json.dumps(document).encode()


def _put(
    broker: redis.Redis,
    tag: str,
    *,
    payload: bytes | None = None,
    delayed: bool = False,
    queued: bool = False,
    next_s: float = NEXT_S,
    prefix: str = "",
) -> None:
    """One message as celery-redis-plus keeps it: its hash, its index entry, maybe queued."""
    broker.hset(
        f"{prefix}message:{tag}",
        mapping={
            "payload": payload if payload is not None else _payload(tag),
            "routing_key": QUEUE,
            "native_delayed": "1" if delayed else "0",
            "eta": str(next_s),
            "delivery_count": "0",
        },
    )
    broker.zadd(f"{prefix}messages_index:{QUEUE}", {tag: next_s})
    if queued:
        broker.zadd(f"{prefix}queue:{QUEUE}", {tag: 0})


def test_a_delayed_or_queued_message_is_read_and_one_a_consumer_holds_is_not(
    plus: RedisPlusBroker, broker: redis.Redis
) -> None:
    # Given a delayed message (its index only), a queued one, one a consumer
    # popped (its index only, no longer delayed), one acknowledged since the
    # index was read (no hash), and a tag the index no longer has
    _put(broker, "delayed", delayed=True, next_s=NEXT_S)
    _put(broker, "queued", queued=True, next_s=NEXT_S + 1)
    _put(broker, "popped", next_s=NEXT_S + 2)
    _put(broker, "acked", delayed=True, next_s=NEXT_S + 3)
    broker.delete("message:acked")
    tags = plus.tags(QUEUE)
    assert tags == ["delayed", "queued", "popped", "acked"]

    # When they are read (the tag gone first: what follows it is read too)
    found = list(plus.read(QUEUE, ["gone", *tags]))

    # Then the two waiting have their message, the popped one none, with
    # when the index looks at each next, to the millisecond
    assert [w.tag for w in found] == ["delayed", "queued", "popped"]
    assert [w.message is not None for w in found] == [True, True, False]
    assert [w.next_ms for w in found] == [1_900_000_000_123, 1_900_000_001_123, 1_900_000_002_123]


def test_a_message_is_read_as_kombu_hands_it_to_a_consumer(
    plus: RedisPlusBroker, broker: redis.Redis
) -> None:
    body = b'[[7], {"x": 1}, {"callbacks": null}]'
    _put(broker, "t1", payload=_payload("t1", body), delayed=True)

    (waiting,) = plus.read(QUEUE, ["t1"])

    message = waiting.message
    assert message is not None
    assert message.body == body
    assert message.delivery_tag == "t1"
    assert message.content_type == "application/json"
    assert message.content_encoding == "utf-8"
    assert message.delivery_info == {"exchange": "", "routing_key": QUEUE}
    assert message.properties["priority"] == 0
    assert message.headers == {"id": "t1", "task": "tests.record"}
    assert message.channel is CHANNEL


def test_missing_fields_read_as_kombu_defaults_and_a_plain_body_as_utf8(
    plus: RedisPlusBroker, broker: redis.Redis
) -> None:
    # A body not base64-encoded, headers that are not a mapping, no
    # delivery info; then null properties and headers; then no body at all
    plain = {"body": "héllo", "headers": ["not", "a", "mapping"], "properties": {}}
    _put(broker, "plain", payload=json.dumps(plain).encode(), delayed=True)
    nulls = {"body": "x", "headers": None, "properties": None}
    _put(broker, "nulls", payload=json.dumps(nulls).encode(), delayed=True)
    _put(broker, "empty", payload=b"{}", delayed=True)

    plain_read, nulls_read, empty_read = (
        w.message for w in plus.read(QUEUE, ["plain", "nulls", "empty"])
    )

    assert plain_read is not None
    assert nulls_read is not None
    assert empty_read is not None
    assert plain_read.body == "héllo".encode()
    assert plain_read.headers == {}
    assert plain_read.delivery_info == {}
    assert (nulls_read.headers, nulls_read.properties, nulls_read.delivery_info) == ({}, {}, {})
    assert empty_read.body == b""


@pytest.mark.parametrize(
    "payload",
    [
        b"not json",  # ValueError
        b"[1, 2]",  # a list: AttributeError
        b'{"properties": 5}',  # TypeError
        b'{"body": "!!!", "properties": {"body_encoding": "base64"}}',  # binascii.Error
    ],
    ids=["not-json", "a-list", "properties-a-number", "bad-base64"],
)
def test_a_payload_not_in_kombus_format_is_read_as_its_raw_bytes(
    plus: RedisPlusBroker, broker: redis.Redis, payload: bytes
) -> None:
    _put(broker, "odd", payload=payload, delayed=True)

    (waiting,) = plus.read(QUEUE, ["odd"])

    assert waiting.message is not None
    assert waiting.message.body == payload
    assert waiting.message.delivery_tag == "odd"
    assert waiting.message.channel is CHANNEL


def test_over_a_thousand_tags_are_read_in_pages_each_once_in_order(
    plus: RedisPlusBroker, broker: redis.Redis
) -> None:
    tags = [f"t{n:05d}" for n in range(2_001)]
    with broker.pipeline(transaction=False) as pipe:
        for n, tag in enumerate(tags):
            pipe.hset(f"message:{tag}", mapping={"payload": b"{}", "native_delayed": "1"})
            pipe.zadd(f"messages_index:{QUEUE}", {tag: NEXT_S + n})
        pipe.execute()

    found = list(plus.read(QUEUE, plus.tags(QUEUE)))

    assert [w.tag for w in found] == tags
    assert all(w.message is not None for w in found)
    assert found[-1].next_ms == 1_900_002_000_123


def test_take_removes_what_waits_and_leaves_what_a_consumer_took(
    plus: RedisPlusBroker, broker: redis.Redis
) -> None:
    _put(broker, "delayed", delayed=True)
    _put(broker, "queued", queued=True)
    _put(broker, "popped")

    assert plus.take(QUEUE, []) == []
    assert plus.take(QUEUE, ["delayed", "queued", "popped", "gone"]) == [True, True, False, False]

    assert broker.zrange(f"messages_index:{QUEUE}", 0, -1) == [b"popped"]
    assert broker.zcard(f"queue:{QUEUE}") == 0
    assert not broker.exists("message:delayed", "message:queued")
    assert broker.exists("message:popped")


def test_take_leaves_a_queued_tag_whose_message_expired_to_celery_redis_plus(
    plus: RedisPlusBroker, broker: redis.Redis
) -> None:
    # Given a queued message whose hash celery-redis-plus's message TTL
    # expired after adopt read it (its tag still queued and indexed)
    _put(broker, "expired", queued=True)
    broker.delete("message:expired")

    # When adopt takes it, it is not reported taken (the parked copy is
    # withdrawn: celery-redis-plus would not have run it either)...
    assert plus.take(QUEUE, ["expired"]) == [False]

    # ...and celery-redis-plus's own keys are left as they were
    assert broker.zrange(f"queue:{QUEUE}", 0, -1) == [b"expired"]
    assert broker.zrange(f"messages_index:{QUEUE}", 0, -1) == [b"expired"]


def test_the_queues_are_those_indexed_under_the_prefix_itself(
    redis_server: RedisServer, broker: redis.Redis
) -> None:
    # Given a global_keyprefix with SCAN's pattern characters, two queues
    # under it, and keys a pattern read literally would match too
    prefix = "p*[ab]?\\:"
    _put(broker, "1", prefix=prefix, delayed=True)
    broker.zadd(f"{prefix}messages_index:emails*", {"2": NEXT_S})
    broker.zadd("pX[ab]?\\:messages_index:other", {"3": NEXT_S})
    broker.zadd("pa:messages_index:other", {"4": NEXT_S})
    broker.zadd("messages_index:unprefixed", {"5": NEXT_S})
    plus = RedisPlusBroker(f"{redis_server.url}/{BROKER_DB}", prefix=prefix)
    try:
        assert plus.queues() == sorted([QUEUE, "emails*"])
        # and its messages are read and taken under the prefix
        (waiting,) = plus.read(QUEUE, plus.tags(QUEUE))
        assert waiting.message is not None
        assert plus.take(QUEUE, ["1"]) == [True]
        assert not broker.exists(f"{prefix}message:1")
    finally:
        plus.close()


def test_of_reads_the_apps_broker_url_and_prefix(
    make_test_app: Any, redis_server: RedisServer
) -> None:
    # The write URL first, the first of a failover list, the transport's prefix
    url = f"{redis_server.url}/{BROKER_DB}"
    app: Celery = make_test_app()
    app.conf.broker_write_url = f"{url};redis://127.0.0.1:1/0"
    app.conf.broker_url = "redis://127.0.0.1:1/0"
    app.conf.broker_transport_options = {"global_keyprefix": "pre:"}
    plus = RedisPlusBroker.of(app, channel=CHANNEL)
    try:
        assert (plus.url, plus.prefix, plus.channel) == (url, "pre:", CHANNEL)
        assert plus.client.ping()
    finally:
        plus.close()

    # No write URL, no transport options: the broker URL, no prefix
    app.conf.broker_write_url = None
    app.conf.broker_url = url
    app.conf.broker_transport_options = None
    plus = RedisPlusBroker.of(app)
    try:
        assert (plus.url, plus.prefix) == (url, "")
    finally:
        plus.close()


def test_of_refuses_a_broker_that_is_not_a_redis_server(make_test_app: Any) -> None:
    app: Celery = make_test_app(broker="amqp://guest:secret@127.0.0.1:5672//")

    with pytest.raises(ConfigurationError, match="is not a Redis server") as refused:
        RedisPlusBroker.of(app)

    assert "secret" not in str(refused.value)
    assert "Nothing was taken" in str(refused.value)


@pytest.mark.parametrize("scheme", ["valkey", "valkeys"])
def test_a_valkey_url_is_read_as_redis(scheme: str) -> None:
    plus = RedisPlusBroker(f"{scheme}://127.0.0.1:6399/3")
    try:
        pool = plus.client.connection_pool
        assert pool.connection_kwargs["port"] == 6399
        assert pool.connection_kwargs["db"] == 3
        tls = pool.connection_class.__name__ == "SSLConnection"
        assert tls == (scheme == "valkeys")
    finally:
        plus.close()


@pytest.mark.redis7  # BZMPOP, as celery-redis-plus itself needs
def test_consumers_counts_clients_waiting_in_bzmpop_on_the_brokers_database(
    plus: RedisPlusBroker, redis_server: RedisServer
) -> None:
    # Given two clients blocked in BZMPOP on the broker's database and one on another
    waiting = [redis_server.client(db) for db in (BROKER_DB, BROKER_DB, BROKER_DB + 5)]

    def block(client: redis.Redis) -> None:
        client.execute_command("BZMPOP", 5, 1, "queue:celery", "MIN")

    threads = [threading.Thread(target=block, args=(c,)) for c in waiting]
    for thread in threads:
        thread.start()
    try:
        wait_for(
            lambda: sum(c.get("cmd") == "bzmpop" for c in plus.client.client_list()) == 3,
            timeout=10,
        )

        # Then only those on the broker's database count (not this reader's
        # own connection, nor any other client there)
        assert plus.consumers() == 2
        # (and a URL that names no database names database 0, the broker's here)
        assert BROKER_DB == 0
        bare = RedisPlusBroker(redis_server.url)
        try:
            assert bare.consumers() == 2
        finally:
            bare.close()
    finally:
        # (a member each wakes them)
        for db in (BROKER_DB, BROKER_DB, BROKER_DB + 5):
            waker = redis_server.client(db)
            waker.zadd("queue:celery", {"wake": 0})
            waker.close()
        for thread in threads:
            thread.join(timeout=10)
        for client in waiting:
            client.close()


def test_consumers_is_0_when_the_broker_refuses_client_list(redis_server: RedisServer) -> None:
    admin = redis_server.client(0)
    admin.execute_command("ACL", "SETUSER", "nolist", "on", ">pw", "~*", "+@all", "-client")
    try:
        plus = RedisPlusBroker(f"redis://nolist:pw@127.0.0.1:{redis_server.port}/{BROKER_DB}")
        try:
            assert plus.consumers() == 0
        finally:
            plus.close()
    finally:
        admin.execute_command("ACL", "DELUSER", "nolist")
        admin.close()


def test_a_waiting_entry_is_a_frozen_value() -> None:
    waiting = Waiting("t", None, 1)
    assert waiting == Waiting("t", None, 1)
    with pytest.raises(FrozenInstanceError):
        waiting.next_ms = 2  # type: ignore[misc]
