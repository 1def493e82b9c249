"""Task messages as the companion hands them to a publisher, and what a publisher said.

The publishers' kill tests (generic, Redis broker, confirming) drive a
publisher directly with these, against a real broker, with no store,
worker or companion.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection, Queue

from celery_zdelay.companion.publish.generic import Publisher, PublishOutcome
from celery_zdelay.entry import TaskMessage
from tests.helpers import wait_for
from tests.proxy import PausableProxy

__all__ = [
    "UNREACHABLE",
    "broker_app",
    "rabbitmq_messages",
    "redis_pushed",
    "redis_queued",
    "settled",
    "task_ids",
    "task_message",
    "unreachable_lines",
]

#: How a publisher's warning starts when its batch waits for the broker.
UNREACHABLE = "Broker unreachable or silent"
#: What Redis answers a command on a key of another type.
WRONGTYPE = "WRONGTYPE Operation against a key holding the wrong kind of value"
#: kombu publishes to Redis one message at a time with retry_on_timeout (no batches).
ONE_BY_ONE = {"retry_on_timeout": True}


def broker_app(url: str, *queues: Queue, options: dict[str, Any] | None = None) -> Celery:
    """An app on the broker *url* that configures *queues* (and transport *options*)."""
    app = Celery("publish-kills", broker=url, set_as_current=False)
    app.conf.task_queues = list(queues)
    app.conf.broker_transport_options = options or {}
    return app


def task_message(
    task_id: str,
    queue: str,
    *,
    exchange: str = "",
    routing_key: str | None = None,
    priority: int = 0,
    body: bytes | None = None,
    headers: dict[str, Any] | None = None,
    properties: dict[str, Any] | None = None,
) -> TaskMessage:
    """A task message for *queue* (routed by its name unless *routing_key*), which it
    names to be declared; *headers* and *properties* are added to the usual ones."""
    return TaskMessage(
        body=b'[["%s"], {}, {}]' % task_id.encode() if body is None else body,
        content_type="application/json",
        content_encoding="utf-8",
        headers={"lang": "py", "task": "tests.add", "id": task_id, **(headers or {})},
        properties={"correlation_id": task_id, "delivery_mode": 2, **(properties or {})},
        priority=priority,
        exchange=exchange,
        routing_key=queue if routing_key is None else routing_key,
        declare=[queue] if queue else [],
    )


def task_ids(prefix: str, n: int) -> list[str]:
    """*n* task ids of the test's own, starting with *prefix*."""
    return [f"{prefix}-{i}-{uuid.uuid4().hex[:6]}" for i in range(n)]


def settled(outcome: PublishOutcome) -> tuple[list[int], dict[int, str], BaseException | None]:
    """(accepted, rejected, error): the whole of a publisher's answer, to compare at once."""
    return outcome.accepted, outcome.rejected, outcome.error


def redis_pushed(client: redis.Redis, key: str) -> list[dict[str, Any]]:
    """The messages kombu pushed to its list *key* on a Redis broker, oldest first
    (kombu pushes on the left)."""
    raw: list[bytes] = client.lrange(key, 0, -1)  # type: ignore[assignment]
    return [json.loads(item) for item in reversed(raw)]


def redis_queued(client: redis.Redis, key: str) -> list[str]:
    """The task ids in kombu's list *key*, oldest first."""
    return [message["headers"]["id"] for message in redis_pushed(client, key)]


def rabbitmq_messages(url: str, queue: str, expected: int) -> list[Any]:
    """The messages taken from RabbitMQ's *queue*, in order, once *expected* are there (bounded)."""
    got: list[Any] = []
    with Connection(url) as connection:
        bound = Queue(queue, no_declare=True).bind(connection.default_channel)

        def take() -> bool:
            while (message := bound.get(no_ack=True)) is not None:
                got.append(message)
            return len(got) >= expected

        wait_for(take, timeout=10, message=lambda: f"{expected} messages in {queue} ({got})")
        take()
    return got


def unreachable_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The publisher's warnings that its batch waits for the broker, in order."""
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(UNREACHABLE)]


def generic_publisher(url: str, *queues: Queue, options: dict[str, Any] | None = None) -> Publisher:
    """The generic publisher of an app on broker *url* with *queues*, waiting 5 s at most."""
    return Publisher(broker_app(url, *queues, options=options), broker_wait=5.0)


def warmed_up(publisher: Publisher) -> list[str]:
    """Publish a first batch to queues "q" and "other" (connected, both declared): its ids."""
    warm = task_ids("w", 2)
    first = [task_message(warm[0], "q"), task_message(warm[1], "other")]
    assert settled(publisher.publish(first)) == ([0, 1], {}, None)
    return warm


def pipeline_executes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, the command count of each redis-py pipeline ``execute`` (a round trip)."""
    executes: list[int] = []
    real_execute = redis.client.Pipeline.execute

    def counting_execute(self: Any, *args: Any, **kwargs: Any) -> Any:
        executes.append(len(self.command_stack))
        return real_execute(self, *args, **kwargs)

    monkeypatch.setattr(redis.client.Pipeline, "execute", counting_execute)
    return executes


def limited_user_url(client: redis.Redis, port: int, keys: list[str]) -> str:
    """Make the broker user "limited" (every command, only *keys*): its URL on *port*."""
    client.acl_setuser(
        "limited", enabled=True, passwords=["+secret"], keys=keys, commands=["+@all"]
    )
    return f"redis://limited:secret@127.0.0.1:{port}/0"


@contextlib.contextmanager
def rabbitmq_behind_a_proxy(rabbitmq: Any) -> Iterator[tuple[PausableProxy, Publisher]]:
    """A confirm publisher reaching *rabbitmq* through a proxy a test can pause.

    It has published one message (connected); on leaving, the proxy is
    resumed and the publisher closed.
    """
    from celery_zdelay.companion.publish.confirming import ConfirmPublisher

    with Connection(rabbitmq.url) as probe:
        host, port = probe.hostname or "127.0.0.1", int(probe.port or 5672)
    with PausableProxy(host, port) as proxy:
        app = broker_app(proxy.url(rabbitmq.url), Queue(rabbitmq.queue))
        publisher = ConfirmPublisher(app, broker_wait=1.0)
        try:
            assert publisher.publish([task_message("warm", rabbitmq.queue)]).accepted == [0]
            yield proxy, publisher
        finally:
            proxy.resume()
            publisher.close()
