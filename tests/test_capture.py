"""The message parked is the one Celery would have sent, and it is announced only once parked.

Pins each line of ``celery_zdelay/capture.py`` that mutation testing found
unguarded (see docs/mutation.rst): :func:`capture` takes Celery's own
message (a chain's first task too) without sending anything to the broker,
keeps its priority and properties but not the broker's delivery info,
leaves a task-sent event out, refuses protocol 1 with the fix, holds back
``after_task_publish`` until :func:`announce_parked` sends it once, and
leaves real publishes' signals alone. A real app on a private Redis; no
worker needed.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery, chain, signals

from celery_zdelay import ConfigurationError
from celery_zdelay.capture import CapturingProducer, announce_parked, capture
from tests.conftest import AppFactory

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def announced() -> Iterator[list[tuple[str, str]]]:
    """(task name, task id) of each after_task_publish, in order."""
    seen: list[tuple[str, str]] = []

    def receiver(sender: Any = None, headers: Any = None, **_: Any) -> None:
        seen.append((str(sender), str((headers or {}).get("id"))))

    signals.after_task_publish.connect(receiver, weak=False)
    yield seen
    signals.after_task_publish.disconnect(receiver)


def _capture_one(app: Celery, task_id: str, **options: Any) -> Any:
    task = app.tasks["tests.record"]
    _, messages = capture(
        app, lambda p: task.apply_async((task_id,), producer=p, task_id=task_id, **options)
    )
    assert [m.headers["id"] for m in messages] == [task_id]
    return messages[0]


def test_a_captured_message_is_announced_once_when_parked_and_not_before(
    app: Celery, announced: list[tuple[str, str]], redis_client: redis.Redis
) -> None:
    message = _capture_one(app, "held")
    assert announced == []
    assert redis_client.llen("celery") == 0  # nothing reached the broker
    # The held-back signal's arguments repeat the whole message: a log line
    # showing the message does not show them twice.
    assert message.announcement is not None
    assert "announcement" not in repr(message)
    unannounced = copy.copy(message)
    announce_parked([None, message])
    # Announced or not, it is the same message.
    assert message.announcement is None
    assert message == unannounced
    assert announced == [("tests.record", "held")]
    announce_parked([message])
    assert announced == [("tests.record", "held")]


def test_each_message_of_a_capture_is_announced_for_itself(
    app: Celery, announced: list[tuple[str, str]]
) -> None:
    task = app.tasks["tests.record"]
    _, messages = capture(
        app,
        lambda p: [task.apply_async((i,), producer=p, task_id=i) for i in ("one", "two", "three")],
    )
    assert announced == []
    announce_parked(messages)
    assert announced == [("tests.record", i) for i in ("one", "two", "three")]


def test_a_real_publish_is_announced_at_once_before_and_after_a_capture(
    app: Celery, announced: list[tuple[str, str]], redis_client: redis.Redis
) -> None:
    task = app.tasks["tests.record"]
    task.apply_async(("before",), task_id="before")
    _capture_one(app, "captured")
    task.apply_async(("after",), task_id="after")
    assert announced == [("tests.record", "before"), ("tests.record", "after")]
    assert redis_client.llen("celery") == 2


def test_the_captured_message_keeps_its_priority_and_properties_but_not_delivery_info(
    app: Celery,
) -> None:
    assert _capture_one(app, "urgent", priority=5).priority == 5
    plain = _capture_one(app, "plain")
    assert plain.priority == 0
    assert plain.properties["correlation_id"] == "plain"
    assert "delivery_info" not in plain.properties
    assert isinstance(plain.body, bytes)
    assert plain.declare == ["celery"]
    assert plain.routing_key == "celery"


def test_a_task_sent_event_is_neither_parked_nor_taken_for_the_task(
    make_test_app: AppFactory, announced: list[tuple[str, str]], redis_client: redis.Redis
) -> None:
    app = make_test_app(conf={"task_send_sent_event": True})
    message = _capture_one(app, "with-event")
    assert message.announcement is not None
    assert message.announcement["headers"]["id"] == "with-event"
    assert message.announcement["routing_key"] == "celery"
    assert list(message.announcement["body"][0]) == ["with-event"]
    announce_parked([message])
    assert announced == [("tests.record", "with-event")]
    # Celery's event publish met no error: a refused event is buffered by
    # its dispatcher, to be sent later (for a publish that had not happened)
    assert not app.amqp._event_dispatcher._outbound_buffer


def test_protocol_1_messages_are_refused_with_the_fix(make_test_app: AppFactory) -> None:
    app = make_test_app(conf={"task_protocol": 1})
    task = app.tasks["tests.record"]
    with pytest.raises(ConfigurationError, match="remove task_protocol = 1"):
        capture(app, lambda p: task.apply_async(("old",), producer=p))


def test_a_chain_s_first_task_is_captured_not_published(
    app: Celery, redis_client: redis.Redis
) -> None:
    task = app.tasks["tests.record"]
    _, messages = capture(app, lambda p: chain(task.s("one"), task.si("two")).apply_async())
    assert len(messages) == 1
    assert redis_client.llen("celery") == 0
    # Outside a capture the same chain goes to the broker as before.
    chain(task.s("one"), task.si("two")).apply_async()
    assert redis_client.llen("celery") == 1


def test_captures_share_one_connection_and_give_a_channel_when_asked(app: Celery) -> None:
    producers: list[CapturingProducer] = []
    capture(app, producers.append)
    capture(app, producers.append)
    first, second = producers
    assert first.__connection__ is not None
    assert first.__connection__ is second.__connection__
    # A result backend (RPC) declares its reply queue on the producer's channel.
    assert first.channel is not None
    assert first.channel is first.__connection__.default_channel


def test_a_message_without_both_task_headers_is_refused_and_not_taken(app: Celery) -> None:
    producers: list[CapturingProducer] = []
    capture(app, producers.append)
    (producer,) = producers
    for headers in ({"id": "x"}, {"task": "tests.record"}, {}):
        with pytest.raises(ConfigurationError, match="task protocol 2 messages only"):
            producer.publish(b"{}", routing_key="celery", exchange="", headers=headers)
    assert producer.messages == []


def test_the_signal_hold_and_the_producer_route_are_installed_once_not_per_capture(
    app: Celery,
) -> None:
    # Installed again per capture, it would wrap itself: every park would make
    # every later after_task_publish a call deeper.
    capture(app, lambda p: None)
    installed = signals.after_task_publish._live_receivers
    routed = app.producer_or_acquire
    for _ in range(3):
        capture(app, lambda p: None)
    assert signals.after_task_publish._live_receivers is installed
    # The same for the app's producer_or_acquire, routed to the capture.
    assert app.producer_or_acquire is routed
