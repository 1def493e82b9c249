"""A message is forgotten only once RabbitMQ accepted it: the confirm publisher, on a real broker.

Pins what ``celery_zdelay/companion/publish/confirming.py`` promises, where
mutation testing found its list (which releases through companions and
workers) slow or silent (see docs/mutation.rst). Each test drives
:class:`ConfirmPublisher` directly against RabbitMQ on loopback, with no
store, worker or companion: a batch is accepted message by message only
once confirmed, in one write; a nacked message, or a batch whose confirms
do not come within the broker wait, is neither accepted nor rejected (it
waits in the store); a message to a missing exchange is refused alone; an
unroutable message ("mandatory") is given back while its queue can be
declared again, and rejected as unroutable otherwise; a new connection
declares every queue again. :class:`Confirms` counts acks alone, in
multiples, out of order, and nacks, and forgets settled answers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from kombu import Connection, Exchange, Queue

from celery_zdelay.companion.publish import ConfirmPublisher, Confirms, supports_confirms
from tests.conftest import RabbitMQ
from tests.support.publish import (
    broker_app,
    rabbitmq_behind_a_proxy,
    rabbitmq_messages,
    settled,
    task_ids,
    task_message,
)

pytestmark = pytest.mark.timeout(60)


def _drain(url: str, queue: str, expected: int) -> list[str]:
    """The ids of the messages in *queue*, in order, once *expected* are there (bounded)."""
    return [m.headers["id"] for m in rabbitmq_messages(url, queue, expected)]


def _delete_queue(url: str, name: str) -> None:
    with Connection(url) as connection:
        Queue(name, no_declare=True).bind(connection.default_channel).delete()


@pytest.fixture
def publisher(rabbitmq: RabbitMQ) -> Iterator[ConfirmPublisher]:
    """A confirm publisher for the test's own queue, closed afterwards."""
    made = ConfirmPublisher(broker_app(rabbitmq.url, Queue(rabbitmq.queue)), broker_wait=5.0)
    yield made
    made.close()


def test_a_batch_is_accepted_message_by_message_once_confirmed(
    rabbitmq: RabbitMQ, publisher: ConfirmPublisher
) -> None:
    first, second = task_ids("a", 3), task_ids("b", 2)
    outcome = publisher.publish([task_message(i, rabbitmq.queue) for i in first])
    assert settled(outcome) == ([0, 1, 2], {}, None)
    # The next batch on the same channel: its sequence numbers go on from the first's.
    outcome = publisher.publish([task_message(i, rabbitmq.queue) for i in second])
    assert settled(outcome) == ([0, 1], {}, None)
    assert _drain(rabbitmq.url, rabbitmq.queue, 5) == first + second


def test_a_batch_goes_out_in_one_write_and_the_connection_is_left_as_it_was(
    rabbitmq: RabbitMQ, publisher: ConfirmPublisher
) -> None:
    assert publisher.publish([task_message(task_ids("w", 1)[0], rabbitmq.queue)]).accepted == [0]
    assert publisher._connection is not None
    amqp_connection: Any = publisher._connection.connection
    transport = amqp_connection.transport
    properties = amqp_connection.client_properties
    capabilities = dict(properties["capabilities"])
    writes: list[int] = []
    real_write = transport._write

    def counting_write(data: bytes) -> Any:
        writes.append(len(data))
        return real_write(data)

    # py-amqp polls for a connection.blocked notice before each publish
    # (drain_events with a timeout of 0): skipped while the batch is collected.
    polls: list[Any] = []
    real_drain = amqp_connection.drain_events

    def recording_drain(timeout: Any = None) -> Any:
        polls.append(timeout)
        return real_drain(timeout=timeout)

    transport._write = counting_write
    amqp_connection.drain_events = recording_drain
    try:
        outcome = publisher.publish([task_message(i, rabbitmq.queue) for i in task_ids("one", 5)])
        assert settled(outcome) == ([0, 1, 2, 3, 4], {}, None)
        assert len(writes) == 1
        assert 0 not in polls
        # The transport and the connection's properties are given back as they were.
        assert transport._write is counting_write
        assert amqp_connection.client_properties is properties
        assert properties["capabilities"] == capabilities
    finally:
        transport._write = real_write
        del amqp_connection.drain_events


def test_a_message_to_a_missing_exchange_is_refused_alone_and_the_rest_go_out(
    rabbitmq: RabbitMQ, publisher: ConfirmPublisher
) -> None:
    missing = f"{rabbitmq.queue}-missing"
    good = task_ids("g", 3)
    batch = [
        task_message(good[0], rabbitmq.queue),
        task_message("lost-1", rabbitmq.queue, exchange=missing),
        task_message("lost-2", rabbitmq.queue, exchange=missing),
        task_message(good[1], rabbitmq.queue),
    ]
    accepted, rejected, error = settled(publisher.publish(batch))
    assert (accepted, error) == ([0, 3], None)
    assert set(rejected) == {1, 2}
    # Checked once per batch: the second message names the first's refusal.
    assert rejected[1] == rejected[2]
    assert rejected[1].startswith("refused by the broker: ")
    assert missing in rejected[1]
    # The channel the broker closed was replaced: the next batch goes out.
    assert settled(publisher.publish([task_message(good[2], rabbitmq.queue)])) == ([0], {}, None)
    assert _drain(rabbitmq.url, rabbitmq.queue, 3) == good


def test_a_channel_the_broker_closed_is_let_go_not_kept_open(
    rabbitmq: RabbitMQ, publisher: ConfirmPublisher
) -> None:
    # A long-running companion meets refusals again and again: each one must
    # not keep a channel of the connection (there are at most 2047).
    assert publisher.publish([task_message("open", rabbitmq.queue)]).accepted == [0]
    assert publisher._connection is not None
    channels = publisher._connection.connection.channels
    before = len(channels)
    missing = f"{rabbitmq.queue}-missing"
    for i in range(3):
        outcome = publisher.publish([task_message(f"lost-{i}", rabbitmq.queue, exchange=missing)])
        assert list(outcome.rejected) == [0]
        assert len(channels) == before


def test_a_nacked_message_is_neither_accepted_nor_rejected_and_the_rest_still_count(
    rabbitmq: RabbitMQ,
) -> None:
    # A queue that takes one message and nacks the rest, and one that takes all.
    full = Queue(
        rabbitmq.queue, queue_arguments={"x-max-length": 1, "x-overflow": "reject-publish"}
    )
    other = f"{rabbitmq.queue}-b"
    publisher = ConfirmPublisher(broker_app(rabbitmq.url, full, Queue(other)), broker_wait=5.0)
    try:
        ids = task_ids("n", 4)
        batch = [task_message(i, rabbitmq.queue) for i in ids[:3]] + [task_message(ids[3], other)]
        outcome = publisher.publish(batch)
    finally:
        publisher.close()
    # The acked message after the nacked ones is accepted too (else published again).
    assert settled(outcome) == ([0, 3], {}, None)
    assert _drain(rabbitmq.url, rabbitmq.queue, 1) == ids[:1]
    assert _drain(rabbitmq.url, other, 1) == ids[3:]


def test_a_message_is_refused_for_the_first_thing_the_broker_refuses(
    rabbitmq: RabbitMQ, publisher: ConfirmPublisher
) -> None:
    # Its queue exists with other arguments than the app's (declaring it
    # fails), and its exchange is missing too: the queue's refusal is its reason.
    with Connection(rabbitmq.url) as connection:
        Queue(rabbitmq.queue, queue_arguments={"x-max-length": 5}).bind(
            connection.default_channel
        ).declare()
    missing = f"{rabbitmq.queue}-missing"
    outcome = publisher.publish([task_message("twice", rabbitmq.queue, exchange=missing)])
    assert (outcome.accepted, outcome.error) == ([], None)
    assert list(outcome.rejected) == [0]
    assert "x-max-length" in outcome.rejected[0]
    assert missing not in outcome.rejected[0]


def test_the_broker_wait_is_a_keyword_argument(rabbitmq: RabbitMQ) -> None:
    with pytest.raises(TypeError):
        ConfirmPublisher(broker_app(rabbitmq.url), 5.0)  # type: ignore[misc]


def test_no_confirm_within_the_broker_wait_gives_the_whole_batch_back(
    rabbitmq: RabbitMQ,
) -> None:
    with rabbitmq_behind_a_proxy(rabbitmq) as (proxy, publisher):
        proxy.pause()
        outcome = publisher.publish([task_message(i, rabbitmq.queue) for i in task_ids("s", 3)])
    assert (outcome.accepted, outcome.rejected) == ([], {})
    assert isinstance(outcome.error, TimeoutError)
    assert str(outcome.error) == "RabbitMQ confirmed 0 of 3 messages within 1s"


def test_the_timeout_counts_the_confirms_of_the_batch_that_came(
    rabbitmq: RabbitMQ, publisher: ConfirmPublisher
) -> None:
    # Given a batch of three whose first message was confirmed (a real one)
    # and two that never will be (counted as published, never sent),
    assert publisher.publish([task_message("first", rabbitmq.queue)]).accepted == [0]
    confirms = publisher._confirms
    confirms.next()
    confirms.next()
    publisher.broker_wait = 0.3
    # then waiting for it says one of three came.
    with pytest.raises(TimeoutError, match=r"^RabbitMQ confirmed 1 of 3 messages within 0.3s$"):
        publisher._await_confirms(3)


def test_a_channel_closed_mid_batch_gives_the_batch_back_as_a_timeout(
    rabbitmq: RabbitMQ,
) -> None:
    # Given an exchange checked on this channel and deleted afterwards,
    name = f"{rabbitmq.queue}-x"
    routed = Queue(rabbitmq.queue, Exchange(name, type="direct"), routing_key="k")
    publisher = ConfirmPublisher(broker_app(rabbitmq.url, routed), broker_wait=5.0)
    try:
        first = task_message("before", rabbitmq.queue, exchange=name, routing_key="k")
        assert settled(publisher.publish([first])) == ([0], {}, None)
        with Connection(rabbitmq.url) as connection:
            Exchange(name).bind(connection.default_channel).delete()
        # when a batch is published to it, the broker closes the channel:
        later = [task_message(i, rabbitmq.queue, exchange=name, routing_key="k") for i in "xyz"]
        outcome = publisher.publish(later)
    finally:
        publisher.close()
    # nothing counts as published, and the batch waits (a timeout, not a refusal).
    assert (outcome.accepted, outcome.rejected) == ([], {})
    assert isinstance(outcome.error, TimeoutError)
    assert "closed the channel mid-batch" in str(outcome.error)


def test_an_unroutable_message_naming_no_queue_is_rejected_as_unroutable(
    rabbitmq: RabbitMQ, publisher: ConfirmPublisher
) -> None:
    name = f"{rabbitmq.queue}-nowhere"
    with Connection(rabbitmq.url) as connection:
        Exchange(name, type="direct").bind(connection.default_channel).declare()
    try:
        good = task_ids("u", 2)
        batch = [
            task_message(good[0], rabbitmq.queue),
            task_message("unroutable", "", exchange=name, routing_key="nobody"),
            task_message(good[1], rabbitmq.queue),
        ]
        accepted, rejected, error = settled(publisher.publish(batch))
    finally:
        with Connection(rabbitmq.url) as connection:
            Exchange(name).bind(connection.default_channel).delete()
    assert (accepted, error) == ([0, 2], None)
    assert list(rejected) == [1]
    assert rejected[1].startswith("unroutable: RabbitMQ returned it (")
    assert f"routing key 'nobody' on exchange {name!r}" in rejected[1]
    assert _drain(rabbitmq.url, rabbitmq.queue, 2) == good


def test_a_message_whose_queue_was_deleted_waits_and_goes_out_once_it_is_declared_again(
    rabbitmq: RabbitMQ, publisher: ConfirmPublisher
) -> None:
    before, after = task_ids("q", 2)
    assert settled(publisher.publish([task_message(before, rabbitmq.queue)])) == ([0], {}, None)
    assert _drain(rabbitmq.url, rabbitmq.queue, 1) == [before]
    _delete_queue(rabbitmq.url, rabbitmq.queue)
    # Returned (mandatory): given back, neither accepted nor rejected,
    assert settled(publisher.publish([task_message(after, rabbitmq.queue)])) == ([], {}, None)
    # and on the next pass its queue is declared again and it goes out.
    assert settled(publisher.publish([task_message(after, rabbitmq.queue)])) == ([0], {}, None)
    assert _drain(rabbitmq.url, rabbitmq.queue, 1) == [after]


def test_a_message_returned_again_after_its_queue_was_declared_is_rejected(
    rabbitmq: RabbitMQ, publisher: ConfirmPublisher
) -> None:
    # Its queue exists, but its routing key reaches no queue: declaring
    # again does not help, so the second return is final.
    stray = task_message("stray", rabbitmq.queue, routing_key=f"{rabbitmq.queue}-none")
    assert settled(publisher.publish([stray])) == ([], {}, None)
    accepted, rejected, error = settled(publisher.publish([stray]))
    assert (accepted, error) == ([], None)
    assert list(rejected) == [0]
    assert rejected[0].startswith("unroutable:")
    # Once accepted, a message is not remembered as returned.
    good = task_message("good", rabbitmq.queue)
    for _ in range(2):
        assert settled(publisher.publish([good])) == ([0], {}, None)


def test_a_new_connection_declares_every_queue_again(
    rabbitmq: RabbitMQ, publisher: ConfirmPublisher
) -> None:
    before, after = task_ids("c", 2)
    assert settled(publisher.publish([task_message(before, rabbitmq.queue)])) == ([0], {}, None)
    _delete_queue(rabbitmq.url, rabbitmq.queue)
    publisher.close()
    # A fresh connection knows nothing declared: the queue is declared at once.
    assert settled(publisher.publish([task_message(after, rabbitmq.queue)])) == ([0], {}, None)
    assert _drain(rabbitmq.url, rabbitmq.queue, 1) == [after]


def test_a_queue_the_app_does_not_configure_is_published_to_with_a_warning(
    rabbitmq: RabbitMQ, publisher: ConfirmPublisher, caplog: pytest.LogCaptureFixture
) -> None:
    other = f"{rabbitmq.queue}-b"
    with Connection(rabbitmq.url) as connection:
        Queue(other).bind(connection.default_channel).declare()
    caplog.set_level(logging.WARNING)
    ids = task_ids("o", 1)
    assert settled(publisher.publish([task_message(ids[0], other)])) == ([0], {}, None)
    assert f"Queue {other} is not configured on this companion" in caplog.text
    assert _drain(rabbitmq.url, other, 1) == ids


def test_only_transports_whose_channels_confirm_get_the_confirm_publisher(
    rabbitmq: RabbitMQ,
) -> None:
    assert supports_confirms(Connection(rabbitmq.url).transport)
    assert not supports_confirms(Connection("redis://127.0.0.1:6379/0").transport)
    assert not supports_confirms(object())


# -- Confirms: the bookkeeping of one channel's answers ------------------------------


def _accepted(confirms: Confirms, sent: Sequence[int]) -> list[bool]:
    return [confirms.accepted(s) for s in sent]


def test_acks_alone_in_order_and_out_of_order_settle_a_batch() -> None:
    confirms = Confirms()
    sent = [confirms.next() for _ in range(3)]
    assert sent == [1, 2, 3]
    assert not confirms.settled()
    confirms.on_ack(1, False)
    assert _accepted(confirms, sent) == [True, False, False]
    confirms.on_ack(3, False)  # early: 2 has no answer yet
    assert _accepted(confirms, sent) == [True, False, True]
    assert not confirms.settled()
    confirms.on_ack(2, False)
    assert confirms.settled()
    assert _accepted(confirms, sent) == [True, True, True]
    confirms.forget_settled()
    assert (confirms._late, confirms._nacked) == (set(), set())
    # The next message has no answer yet: the late ack counted once, not for it.
    later = confirms.next()
    assert not confirms.settled()
    assert not confirms.accepted(later)


def test_an_ack_with_multiple_answers_for_every_message_up_to_its_tag() -> None:
    confirms = Confirms()
    sent = [confirms.next() for _ in range(4)]
    confirms.on_ack(3, True)
    assert _accepted(confirms, sent) == [True, True, True, False]
    assert not confirms.settled()
    confirms.on_ack(4, True)
    assert confirms.settled()


def test_a_nack_alone_refuses_its_own_message_only() -> None:
    confirms = Confirms()
    sent = [confirms.next() for _ in range(3)]
    confirms.on_nack(2, False)  # alone, before 1 is answered
    assert _accepted(confirms, sent) == [False, False, False]
    confirms.on_ack(1, False)
    confirms.on_ack(3, False)
    assert confirms.settled()
    assert _accepted(confirms, sent) == [True, False, True]
    # Settled answers are forgotten, the nack of the last one included.
    confirms.on_nack(confirms.next(), False)
    assert confirms.settled()
    confirms.forget_settled()
    assert (confirms._late, confirms._nacked) == (set(), set())


def test_a_nack_with_multiple_spares_what_was_acked_alone() -> None:
    confirms = Confirms()
    sent = [confirms.next() for _ in range(6)]
    confirms.on_ack(1, False)
    confirms.on_ack(3, False)
    confirms.on_nack(5, True)  # 2, 4 and 5 refused; 3 keeps its ack
    confirms.on_ack(6, False)
    assert confirms.settled()
    assert _accepted(confirms, sent) == [True, False, True, False, False, True]
    confirms.forget_settled()
    later = confirms.next()
    assert later == 7
    assert not confirms.accepted(later)
    confirms.on_ack(later, False)
    assert confirms.accepted(later)


def test_several_acks_alone_ahead_of_a_gap_all_count_once_it_is_filled() -> None:
    confirms = Confirms()
    sent = [confirms.next() for _ in range(4)]
    confirms.on_ack(3, False)
    confirms.on_ack(4, False)
    confirms.on_ack(1, False)
    assert not confirms.settled()
    confirms.on_ack(2, False)  # fills the gap: 3 and 4 follow
    assert confirms.settled()
    assert _accepted(confirms, sent) == [True, True, True, True]
    confirms.forget_settled()
    assert (confirms._late, confirms._nacked) == (set(), set())
