"""The generic publisher and its broker: unreachable, silent, stopped, closed; AWS's errors.

Pins what ``celery_zdelay/companion/publish/generic.py`` promises about the
broker connection, where mutation testing found its list too slow per mutant
(see docs/mutation.rst; its messages: ``test_generic_publisher.py`` beside it).
Each test drives :class:`Publisher` directly, with no store, worker or
companion, against a private redis-server used as the Celery broker (through
a proxy that can stop answering) or RabbitMQ on loopback: an unreachable
broker is tried twice, then the batch waits; a silent one neither hangs the
publisher nor leaves a socket open, and is let go without a goodbye it
would never answer; a publisher stopped mid-connect leaves no socket open;
``close()`` says the AMQP goodbye and the next batch opens a new
connection; the connection asks for no heartbeats and waits no longer than
the broker wait (at most 30 s); AWS errors are told apart, the service's
(wait) from the message's (dead-letter).
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import signal
import socket
import sys
import threading
import time
from typing import Any

import kombu.exceptions
import pytest
import redis
from botocore.exceptions import ClientError, ParamValidationError
from kombu import Queue
from kombu.exceptions import OperationalError

from celery_zdelay.companion.publish import generic
from celery_zdelay.companion.publish.generic import Publisher, broker_connection
from celery_zdelay.testing import RedisServer
from tests.conftest import RabbitMQ
from tests.helpers import wait_for
from tests.proxy import PausableProxy
from tests.support.logs import error_lines
from tests.support.publish import (
    ONE_BY_ONE,
    UNREACHABLE,
    broker_app,
    generic_publisher,
    rabbitmq_behind_a_proxy,
    redis_queued,
    settled,
    task_ids,
    task_message,
    unreachable_lines,
)

pytestmark = pytest.mark.timeout(60)


# -- an unreachable or silent broker ---------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_an_unreachable_broker_is_tried_twice_then_the_batch_waits(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Breaks if: ensure_connection's max_retries moves (0: no second try; 2:
    # a third, four seconds later), or an empty batch is said to hold one
    # waiting message (the floor of the count).
    caplog.set_level(logging.WARNING)
    publisher = generic_publisher(f"redis://127.0.0.1:{_closed_port()}/0", Queue("q"))
    started = time.monotonic()
    outcome = publisher.publish([task_message(i, "q") for i in task_ids("u", 3)])
    took = time.monotonic() - started
    assert (outcome.accepted, outcome.rejected) == ([], {})
    assert isinstance(outcome.error, OperationalError)
    # kombu waits two seconds before its one retry.
    assert 1.5 <= took < 5.0, took
    assert publisher.publish([]).accepted == []
    assert unreachable_lines(caplog) == [
        f"{UNREACHABLE}, 3 messages wait: {outcome.error!r}",
        f"{UNREACHABLE}, 0 messages wait: {outcome.error!r}",
    ]
    assert error_lines(caplog, "") == 0


@pytest.mark.parametrize("options", [{}, ONE_BY_ONE], ids=["pipelined", "one-by-one"])
@pytest.mark.timeout(40)
def test_a_silent_redis_broker_makes_the_batch_wait_and_leaves_no_socket_open(
    broker_server: RedisServer,
    broker_client: redis.Redis,
    options: dict[str, Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Breaks if: the socket timeout is not set on a Redis transport (`!=
    # "redis"`: the batch hangs), kombu retries the publish (`retry=True`), or
    # the dropped connection is not let go (`connection is not None` inverted).
    with PausableProxy("127.0.0.1", broker_server.port) as proxy:
        app = broker_app(f"redis://127.0.0.1:{proxy.port}/0", Queue("q"), options=options)
        publisher = Publisher(app, broker_wait=1.0)
        assert publisher.publish([task_message("warm", "q")]).accepted == [0]
        proxy.pause()
        caplog.set_level(logging.WARNING)
        gc.disable()  # the collector would close the socket some time later
        try:
            outcome = publisher.publish([task_message(i, "q") for i in task_ids("s", 2)])
            assert (outcome.accepted, outcome.rejected) == ([], {})
            assert unreachable_lines(caplog) == [
                f"{UNREACHABLE}, 2 messages wait: {outcome.error!r}"
            ]
            wait_for(lambda: proxy.open_clients() == 0, timeout=10, message="sockets closed")
        finally:
            gc.enable()
            proxy.resume()
        # Once the broker answers again, a new connection publishes.
        try:
            assert settled(publisher.publish([task_message("after", "q")])) == ([0], {}, None)
        finally:
            publisher.close()
    assert redis_queued(broker_client, "q")[-1] == "after"


class _Stopped(BaseException):
    """As Celery's shutdown raises in the companion's main thread (not an Exception)."""


def test_a_publisher_stopped_mid_connect_leaves_no_socket_open(broker_server: RedisServer) -> None:
    # Breaks if: _ensure_producer's `except BaseException` catches nothing: a
    # stop that is not an Exception skips publish's own cleanup.
    def stop(signum: int, frame: Any) -> None:
        raise _Stopped

    previous = signal.signal(signal.SIGUSR1, stop)
    with PausableProxy("127.0.0.1", broker_server.port) as proxy:
        proxy.pause()
        publisher = generic_publisher(f"redis://127.0.0.1:{proxy.port}/0", Queue("q"))
        # Sent to the main thread, so its blocked read is interrupted at once.
        main = threading.main_thread().ident
        assert main is not None
        timer = threading.Timer(0.5, signal.pthread_kill, (main, signal.SIGUSR1))
        gc.disable()
        try:
            timer.start()
            with pytest.raises(_Stopped):
                publisher.publish([task_message("never", "q")])
            assert publisher._connection is None
            wait_for(lambda: proxy.open_clients() == 0, timeout=10, message="sockets closed")
        finally:
            timer.cancel()
            gc.enable()
            signal.signal(signal.SIGUSR1, previous)
            proxy.resume()


@pytest.mark.timeout(30)
def test_a_silent_rabbitmq_is_let_go_without_waiting_for_its_goodbye(
    rabbitmq: RabbitMQ,
) -> None:
    # Breaks if: a broken connection is closed politely (`_drop` with
    # `polite=True`, or `if polite` negated): py-amqp waits for the silent
    # broker's Close-Ok forever.
    with rabbitmq_behind_a_proxy(rabbitmq) as (proxy, publisher):
        proxy.pause()
        started = time.monotonic()
        outcome = publisher.publish([task_message("silent", rabbitmq.queue)])
        assert isinstance(outcome.error, TimeoutError)
        assert time.monotonic() - started < 10
        assert publisher._connection is None


def test_close_lets_go_of_the_connection_and_the_next_batch_opens_another(
    broker_server: RedisServer, broker_client: redis.Redis
) -> None:
    # Breaks if: _let_go skips a live connection (`connection is not None`
    # inverted), or `_producer is None` is inverted (no producer, or a new
    # connection for every batch).
    publisher = generic_publisher(f"{broker_server.url}/0", Queue("q"))
    mine = broker_client.client_id()

    def others() -> set[str]:
        return {c["id"] for c in broker_client.client_list() if int(c["id"]) != mine}

    # Clients an earlier test of this process left to the garbage collector
    # (older kombu closes them there) are not the publisher's.
    earlier = others()
    gc.disable()
    try:
        assert publisher.publish([task_message("one", "q")]).accepted == [0]
        assert publisher.publish([task_message("two", "q")]).accepted == [0]
        assert others() - earlier != set()
        publisher.close()
        assert publisher._connection is None
        wait_for(
            lambda: others() - earlier == set(),
            timeout=10,
            message="the publisher's connection closed",
        )
    finally:
        gc.enable()
    assert settled(publisher.publish([task_message("three", "q")])) == ([0], {}, None)
    publisher.close()
    assert redis_queued(broker_client, "q") == ["one", "two", "three"]


#: An AMQP Connection.Close method frame's start: type 1, channel 0, then class 10 method 50.
AMQP_CONNECTION_CLOSE = (b"\x01\x00\x00", b"\x00\x0a\x00\x32")


def test_close_says_goodbye_to_a_broker_that_answers(rabbitmq: RabbitMQ) -> None:
    # Breaks if: close() lets go without the AMQP goodbye (`polite=False`):
    # RabbitMQ logs every companion that stops as a client that vanished.
    publisher = Publisher(broker_app(rabbitmq.url, Queue(rabbitmq.queue)), broker_wait=5.0)
    assert publisher.publish([task_message("one", rabbitmq.queue)]).accepted == [0]
    assert publisher._connection is not None
    transport = publisher._connection.connection.transport
    written: list[bytes] = []
    real_write = transport._write

    def recording_write(data: bytes) -> Any:
        written.append(bytes(data))
        return real_write(data)

    transport._write = recording_write
    publisher.close()
    kind, method = AMQP_CONNECTION_CLOSE
    assert any(frame.startswith(kind) and frame[7:11] == method for frame in written), written


# -- the connection, the broker wait, and AWS's errors ------------------------------


def test_the_broker_connection_sends_no_heartbeats_and_waits_at_most_the_broker_wait() -> None:
    # Breaks if: heartbeat=0 moves (RabbitMQ would close a companion that sleeps
    # without draining), or the socket timeout goes to the wrong transports.
    amqp_app = broker_app("amqp://guest:guest@127.0.0.1:5672//", options={"confirm_publish": True})
    connection = broker_connection(amqp_app, 3.0)
    assert (connection.heartbeat, connection.connect_timeout) == (0, 3.0)
    assert connection.transport_options == {}
    redis_url = "redis://127.0.0.1:6379/0"
    assert broker_connection(broker_app(redis_url), 3.0).transport_options == {
        "socket_timeout": 3.0
    }
    chosen = broker_connection(broker_app(redis_url, options={"socket_timeout": 7}), 3.0)
    assert chosen.transport_options == {"socket_timeout": 7}


def test_the_broker_wait_is_capped_at_thirty_seconds_and_a_keyword() -> None:
    # Breaks if: MAX_BROKER_WAIT moves.
    app = broker_app("redis://127.0.0.1:6379/0")
    assert Publisher(app, broker_wait=3600).broker_wait == 30.0
    assert Publisher(app, broker_wait=2.5).broker_wait == 2.5
    with pytest.raises(TypeError):
        Publisher(app, 5.0)  # type: ignore[misc]


def test_the_broker_url_the_companion_logs_is_the_write_brokers_without_its_password() -> None:
    # Breaks if: broker_url loses its @property (the start-up line would show a method).
    app = broker_app("amqp://guest:secret@127.0.0.1:5672//")
    app.conf.broker_write_url = "amqp://writer:secret@127.0.0.1:5673//"
    assert Publisher(app).broker_url == "amqp://writer:**@127.0.0.1:5673//"


def _aws(code: str | None, status: int | None) -> ClientError:
    response: dict[str, Any] = {}
    if code is not None:
        response["Error"] = {"Code": code, "Message": "test"}
    if status is not None:
        response["ResponseMetadata"] = {"HTTPStatusCode": status}
    return ClientError(response, "SendMessage")  # type: ignore[arg-type]


class _LooksLikeAws(Exception):
    """Not botocore's: its response is not read."""

    def __init__(self) -> None:
        super().__init__("throttled?")
        self.response = {
            "Error": {"Code": "Throttling"},
            "ResponseMetadata": {"HTTPStatusCode": 503},
        }


#: Whether each error waits (the service's) or is dead-lettered (the message's).
AWS_ERRORS: dict[str, tuple[BaseException, bool]] = {
    "throttled": (_aws("Throttling", 400), True),
    "kms-throttled": (_aws("KMS.ThrottlingException", 400), True),
    "bad-parameter": (_aws("InvalidParameterValue", 400), False),
    "http-500": (_aws("InvalidParameterValue", 500), True),
    "http-499": (_aws("InvalidParameterValue", 499), False),
    "no-status": (_aws("InvalidParameterValue", None), False),
    "unavailable-no-status": (_aws("ServiceUnavailable", None), True),
    "no-code-503": (_aws(None, 503), True),
    "empty": (_aws(None, None), False),
    "not-botocore": (_LooksLikeAws(), False),
    "param-validation": (ParamValidationError(report="MessageGroupId must be a string"), False),
}


@pytest.mark.parametrize(("error", "waits"), list(AWS_ERRORS.values()), ids=list(AWS_ERRORS))
def test_an_aws_error_waits_when_it_is_the_services_and_is_dead_lettered_when_the_messages(
    error: BaseException, waits: bool
) -> None:
    # Breaks if: a comparison, `and`/`or` or `not` of _is_service_outage or
    # _refused_before_sending moves (a throttled SQS would dead-letter, a
    # message SQS refuses would block its shard forever).
    publisher = Publisher(broker_app("sqs://key:secret@127.0.0.1:1"), broker_wait=1.0)
    assert publisher._is_connection_error(error) is waits
    # On an SQS connection kombu counts every botocore error as a connection
    # error; a message botocore refuses before sending is still the message's.
    publisher._connection = broker_connection(publisher.app, 1.0)
    if isinstance(error, ParamValidationError):
        assert publisher._is_connection_error(error) is False


def test_without_botocore_no_error_is_aws_s_and_every_other_is_told_apart_as_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Breaks if: the ImportError of botocore (an extra: SQS only) is not
    # caught, or is read as an outage (every error would wait).
    monkeypatch.setitem(sys.modules, "botocore.exceptions", None)
    publisher = Publisher(broker_app("redis://127.0.0.1:6379/0"), broker_wait=1.0)
    assert publisher._is_connection_error(_LooksLikeAws()) is False
    assert publisher._is_connection_error(ValueError("the message's")) is False
    assert publisher._is_connection_error(TimeoutError("the broker's")) is True


def test_the_publisher_imports_with_a_kombu_that_has_no_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Breaks if: the ImportError of kombu < 5.7's missing BatchPublishError is
    # not caught (the companion would not start on those kombu versions).
    monkeypatch.delattr(kombu.exceptions, "BatchPublishError", raising=False)
    name = "celery_zdelay.companion.publish._generic_on_old_kombu"
    spec = importlib.util.spec_from_file_location(name, generic.__file__)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    assert module._BATCH_ERRORS == ()
