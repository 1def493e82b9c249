"""Hardening of the generic publish path (issue 11): a message counts as
published only when the broker has it, one bad message harms no other, and
the companion survives what its broker and store throw at it."""

from __future__ import annotations

import gc
import json
import uuid
from typing import Any

import pytest
from celery import Celery
from kombu import Connection, Exchange, Queue

from celery_zdelay.companion import Companion
from celery_zdelay.companion.publish import Confirms
from celery_zdelay.store import admin
from tests.conftest import AppFactory, RabbitMQ
from tests.helpers import wait_for
from tests.proxy import OutageHTTPProxy, PausableProxy
from tests.servers import LocalSQS

pytestmark = pytest.mark.timeout(120)


def _drain(url: str, queue: str) -> list[str]:
    """Take every message out of *queue*; return their task ids in order."""
    ids = []
    with Connection(url) as connection:
        bound = Queue(queue, no_declare=True).bind(connection.default_channel)
        while (message := bound.get(no_ack=True)) is not None:
            ids.append(message.headers["id"])
    return ids


def _store_ids(app: Celery) -> tuple[int, int, int]:
    """(parked, in flight, dead) in *app*'s store."""
    with Companion(app) as probe:
        counts = admin.counts(probe.store)
    return counts.parked, counts.in_flight, counts.dead


def _dead(app: Celery) -> dict[str, str | None]:
    with Companion(app) as probe:
        return {e.task_id: e.reason for e in admin.list_dead(probe.store).entries}


# -- 1. publisher confirms on RabbitMQ ---------------------------------------------


@pytest.mark.parametrize("scheme", ["amqp", "pyamqp"])
def test_a_full_queue_nacks_and_the_refused_tasks_wait_in_the_store(
    make_test_app: AppFactory, rabbitmq: RabbitMQ, scheme: str
) -> None:
    spec = {
        "name": rabbitmq.queue,
        "queue_arguments": {"x-max-length": 2, "x-overflow": "reject-publish"},
    }
    url = scheme + rabbitmq.url.removeprefix("amqp")
    app = make_test_app(broker=url, conf={"task_default_queue": rabbitmq.queue}, queues=[spec])
    add = app.tasks["tests.add"]
    parked = [add.apply_delayed((i, i), countdown=0).id for i in range(5)]

    with Companion(app) as companion:
        first = companion.release_due()
        assert (first.published, first.returned, first.dead_lettered) == (2, 3, 0)
        assert _store_ids(app) == (3, 0, 0)
        delivered = _drain(rabbitmq.url, rabbitmq.queue)
        assert delivered == parked[:2]

        # Room appears: the given-back tasks go out on later passes.
        while len(delivered) < 5:
            report = companion.release_due()
            assert report.published == min(2, 5 - len(delivered))
            delivered += _drain(rabbitmq.url, rabbitmq.queue)

    assert delivered == parked
    assert _store_ids(app) == (0, 0, 0)


def test_nothing_is_acked_in_the_store_while_the_broker_does_not_confirm(
    make_test_app: AppFactory, rabbitmq: RabbitMQ
) -> None:
    with Connection(rabbitmq.url) as probe:
        host, port = probe.hostname or "127.0.0.1", int(probe.port or 5672)
    with PausableProxy(host, port) as proxy:
        # A 4 s lease: the companion waits 2 s for confirms, then gives up.
        app = make_test_app(
            broker=proxy.url(rabbitmq.url),
            conf={"task_default_queue": rabbitmq.queue, "zdelay_lease_seconds": 4},
        )
        add = app.tasks["tests.add"]
        with Companion(app) as companion:
            warmup = add.apply_delayed((0, 0), countdown=0).id
            assert companion.release_due().published == 1  # connected, channel in confirm mode

            parked = [add.apply_delayed((i, i), countdown=0).id for i in range(5)]
            proxy.pause()
            stalled = companion.release_due()
            assert stalled.failed
            assert stalled.published == 0
            assert stalled.returned == 5
            # Nothing acked: all five are still the store's.
            assert _store_ids(app) == (5, 0, 0)

            proxy.resume()
            delivered: list[str] = []
            while _store_ids(app)[0]:
                companion.release_due()
            delivered = _drain(rabbitmq.url, rabbitmq.queue)

    # At least once: the stalled batch reached RabbitMQ too, so ids may repeat.
    assert set(delivered) == {warmup, *parked}


# -- 2. one message to a missing exchange -------------------------------------------


def test_a_queue_deleted_while_the_companion_runs_loses_nothing(
    make_test_app: AppFactory, rabbitmq: RabbitMQ
) -> None:
    # Given a companion that declared its queue once on its channel, and the
    # queue deleted afterwards (RabbitMQ drops, and still acks, a message no
    # queue is bound for)
    app = make_test_app(broker=rabbitmq.url, conf={"task_default_queue": rabbitmq.queue})
    add = app.tasks["tests.add"]
    with Companion(app) as companion:
        first = add.apply_delayed((0, 0), countdown=0).id
        assert companion.release_due().published == 1
        assert _drain(rabbitmq.url, rabbitmq.queue) == [first]
        with Connection(rabbitmq.url) as connection:
            Queue(rabbitmq.queue).bind(connection.default_channel).delete()
        parked = [add.apply_delayed((i, i), countdown=0).id for i in range(1, 4)]

        # When the companion passes on
        returned = companion.release_due()
        again = companion.release_due()

    # Then the broker returned them (they went out "mandatory"), they waited,
    # and the next pass declared the queue again and published them
    assert (returned.published, returned.returned, returned.dead_lettered) == (0, 3, 0)
    assert (again.published, again.dead_lettered) == (3, 0)
    assert _drain(rabbitmq.url, rabbitmq.queue) == parked
    assert _store_ids(app) == (0, 0, 0)


def test_a_message_no_queue_is_bound_for_is_dead_lettered_not_dropped(
    make_test_app: AppFactory, rabbitmq: RabbitMQ
) -> None:
    # Given a task routed to an existing exchange with no queue bound for its
    # routing key, between two good ones
    exchange = f"{rabbitmq.queue}-x"
    with Connection(rabbitmq.url) as connection:
        Exchange(exchange, type="direct").bind(connection.default_channel).declare()
    try:
        app = make_test_app(broker=rabbitmq.url, conf={"task_default_queue": rabbitmq.queue})
        add = app.tasks["tests.add"]
        first = add.apply_delayed((1, 1), countdown=0).id
        lost = add.apply_delayed((2, 2), countdown=0, exchange=exchange, routing_key="nowhere").id
        last = add.apply_delayed((3, 3), countdown=0).id

        # When the companion passes until nothing is left
        with Companion(app) as companion:
            reports = [companion.release_due() for _ in range(3)]
    finally:
        with Connection(rabbitmq.url) as connection:
            Exchange(exchange).bind(connection.default_channel).delete()

    # Then the good ones are published, and the unroutable one, which
    # RabbitMQ would have acked and dropped, is dead-lettered with the route
    assert sum(r.published for r in reports) == 2
    assert _drain(rabbitmq.url, rabbitmq.queue) == [first, last]
    reason = str(_dead(app)[lost])
    assert "unroutable" in reason
    assert "nowhere" in reason
    assert _store_ids(app) == (0, 0, 1)


def test_confirms_count_only_what_the_broker_acked_alone_or_in_multiples() -> None:
    # RabbitMQ answers in order in practice; the bookkeeping must not rely on it.
    confirms = Confirms()
    sent = [confirms.next() for _ in range(6)]
    confirms.on_ack(2, False)  # out of order, alone
    confirms.on_nack(4, True)  # 1, 3 and 4 refused; 2 keeps its ack
    confirms.on_ack(6, False)
    assert not confirms.settled()  # 5 has no answer yet
    assert [confirms.accepted(s) for s in sent] == [False, True, False, False, False, True]

    confirms.on_ack(5, True)
    assert confirms.settled()
    assert [confirms.accepted(s) for s in sent] == [False, True, False, False, True, True]

    # The next batch starts clean: old answers do not leak into it.
    confirms.forget_settled()
    later = confirms.next()
    assert later == 7
    assert not confirms.accepted(later)
    confirms.on_nack(later, False)
    assert confirms.settled()
    assert not confirms.accepted(later)


def test_a_message_to_a_missing_exchange_is_dead_lettered_and_harms_no_other(
    make_test_app: AppFactory, rabbitmq: RabbitMQ
) -> None:
    app = make_test_app(broker=rabbitmq.url, conf={"task_default_queue": rabbitmq.queue})
    add = app.tasks["tests.add"]
    missing = f"zdelay-missing-{uuid.uuid4().hex[:8]}"
    before = [add.apply_delayed((i, i), countdown=0).id for i in range(3)]
    bad = add.apply_delayed((9, 9), countdown=0, exchange=missing, routing_key="x").id
    after = [add.apply_delayed((i, i), countdown=0).id for i in range(3, 8)]

    with Companion(app) as companion:
        report = companion.release_due()
        assert (report.published, report.dead_lettered, report.returned) == (8, 1, 0)
        assert not report.failed
        again = companion.release_due()  # still running, nothing left
        assert again.released == again.dead_lettered == 0

    assert _drain(rabbitmq.url, rabbitmq.queue) == before + after
    dead = _dead(app)
    assert list(dead) == [bad]
    assert missing in str(dead[bad])
    assert "NOT_FOUND" in str(dead[bad])
    assert _store_ids(app) == (0, 0, 1)


def test_a_companion_process_survives_a_missing_exchange_and_runs_every_other_task(
    make_test_app: AppFactory, rabbitmq: RabbitMQ, worker: Any, companion: Any, runs: Any
) -> None:
    app = make_test_app(broker=rabbitmq.url, conf={"task_default_queue": rabbitmq.queue})
    add = app.tasks["tests.add"]
    worker(app, rabbitmq.queue)
    process = companion(app)
    missing = f"zdelay-missing-{uuid.uuid4().hex[:8]}"

    good = [add.apply_delayed((i, i), countdown=0.2).id for i in range(10)]
    bad = add.apply_delayed((1, 1), countdown=0.2, exchange=missing, routing_key="x").id
    good += [add.apply_delayed((i, i), countdown=0.2).id for i in range(10, 20)]

    assert sorted(runs.wait_for_ids(set(good))) == sorted(good)
    assert runs.duplicates() == {}
    process.wait_for_log(f"Dead-lettered {bad}")
    assert list(_dead(app)) == [bad]
    assert process.process.poll() is None  # still running


# -- 6. generic Redis path: one bad reply in the pipelined push ---------------------


def test_a_wrongtype_queue_on_a_redis_broker_dead_letters_one_and_publishes_the_rest(
    make_test_app: AppFactory, broker_server: Any
) -> None:
    broker = broker_server.client(0)
    broker.set("zdelay-not-a-list", "a string where a queue should be")
    app = make_test_app(broker=f"{broker_server.url}/0")
    add = app.tasks["tests.add"]
    good = [add.apply_delayed((i, i), countdown=0).id for i in range(5)]
    bad = add.apply_delayed((9, 9), countdown=0, queue="zdelay-not-a-list").id
    good += [add.apply_delayed((i, i), countdown=0).id for i in range(5, 10)]

    with Companion(app) as companion:
        assert companion.publisher.__class__.__name__ == "RedisPublisher"
        report = companion.release_due()
        assert (report.published, report.dead_lettered, report.returned) == (10, 1, 0)
        assert not report.failed
        later = add.apply_delayed((1, 2), countdown=0).id
        assert companion.release_due().published == 1

    queued = [json.loads(raw)["headers"]["id"] for raw in reversed(broker.lrange("celery", 0, -1))]
    assert queued == [*good, later]
    dead = _dead(app)
    assert list(dead) == [bad]
    assert "WRONGTYPE" in str(dead[bad])
    assert _store_ids(app) == (0, 0, 1)


def test_a_queue_turned_into_a_string_after_declaring_fails_alone_in_the_pipeline(
    make_test_app: AppFactory, broker_server: Any
) -> None:
    """The declare is remembered, so the error comes back in the pipelined replies."""
    broker = broker_server.client(0)
    app = make_test_app(broker=f"{broker_server.url}/0")
    add = app.tasks["tests.add"]
    with Companion(app) as companion:
        add.apply_delayed((0, 0), countdown=0, queue="zdelay-turns-bad")
        assert companion.release_due().published == 1
        broker.delete("zdelay-turns-bad")
        broker.set("zdelay-turns-bad", "no longer a list")

        good = [add.apply_delayed((i, i), countdown=0).id for i in range(3)]
        bad = add.apply_delayed((9, 9), countdown=0, queue="zdelay-turns-bad").id
        good += [add.apply_delayed((i, i), countdown=0).id for i in range(3, 6)]
        report = companion.release_due()

    assert (report.published, report.dead_lettered, report.returned) == (6, 1, 0)
    queued = [json.loads(raw)["headers"]["id"] for raw in reversed(broker.lrange("celery", 0, -1))]
    assert queued == good
    assert "WRONGTYPE" in str(_dead(app)[bad])


# -- a message the SQS client refuses before sending ---------------------------------


def test_a_message_botocore_refuses_is_dead_lettered_and_the_others_published_once(
    make_test_app: AppFactory,
) -> None:
    # Given, on an SQS broker, a task parked with an option SQS's client
    # refuses (MessageGroupId must be a string) between two good ones
    with LocalSQS() as sqs:
        options = sqs.transport_options(wait_time_seconds=1)
        app = make_test_app(
            broker=sqs.url,
            conf={
                "task_default_queue": "zdelay-refused",
                "worker_enable_remote_control": False,
                "broker_transport_options": options,
            },
        )
        add = app.tasks["tests.add"]
        first = add.apply_delayed((1, 1), countdown=0).id
        bad = add.apply_delayed((2, 2), countdown=0, MessageGroupId=5).id
        last = add.apply_delayed((3, 3), countdown=0).id

        # When the companion passes three times
        with Companion(app) as companion:
            reports = [companion.release_due() for _ in range(3)]

        # Then the bad one is dead-lettered for its reason, the good ones
        # reach SQS once each (before: the first was sent again on every
        # pass, the last never, and nothing was dead-lettered)
        assert [r.published for r in reports] == [2, 0, 0]
        assert not any(r.failed for r in reports)
        with Connection(sqs.url, transport_options=options) as connection:
            queue = Queue("zdelay-refused", no_declare=True).bind(connection.default_channel)
            queued = []
            while (message := queue.get(no_ack=True)) is not None:
                queued.append(message.headers["id"])
        assert sorted(queued) == sorted([first, last])
        dead = _dead(app)
        assert list(dead) == [bad]
        assert "ParamValidationError" in str(dead[bad])
        assert _store_ids(app) == (0, 0, 1)


def test_an_sqs_outage_makes_the_messages_wait_instead_of_dead_lettering_them(
    make_test_app: AppFactory,
) -> None:
    # Given an SQS broker that answers SendMessage with HTTP 503
    # ServiceUnavailable (botocore's own retries off, so it shows at once)
    with LocalSQS() as sqs, OutageHTTPProxy(sqs.port) as proxy:
        options = sqs.transport_options(
            wait_time_seconds=1, **{"client-config": {"retries": {"total_max_attempts": 1}}}
        )
        app = make_test_app(
            broker=sqs.url.replace(f":{sqs.port}", f":{proxy.port}"),
            conf={
                "task_default_queue": "zdelay-outage",
                "worker_enable_remote_control": False,
                "broker_transport_options": options,
            },
        )
        add = app.tasks["tests.add"]
        parked = [add.apply_delayed((i, i), countdown=0).id for i in range(3)]
        proxy.outage = {"SendMessage"}

        # When the companion passes during the outage, and once after it
        with Companion(app) as companion:
            during = companion.release_due()
            assert proxy.refused >= 1
            left = _store_ids(app)
            proxy.outage = set()
            after = companion.release_due()

        # Then the tasks waited in the store (before: each was dead-lettered
        # with the 503 as its reason) and went out once the service was back
        assert (during.published, during.dead_lettered, during.returned) == (0, 0, 3)
        assert during.failed
        assert left == (3, 0, 0)
        assert (after.published, after.dead_lettered) == (3, 0)
        with Connection(sqs.url, transport_options=options) as connection:
            queue = Queue("zdelay-outage", no_declare=True).bind(connection.default_channel)
            queued = []
            while (message := queue.get(no_ack=True)) is not None:
                queued.append(message.headers["id"])
        assert sorted(queued) == sorted(parked)
        assert _store_ids(app) == (0, 0, 0)


def _queued_ids(client: Any, queue: str = "celery") -> list[str]:
    """Task ids in a Redis broker's queue list, oldest first."""
    return [json.loads(raw)["headers"]["id"] for raw in reversed(client.lrange(queue, 0, -1))]


#: Lowered on a private Redis, so a test message can be over it.
SMALL_BULK_LIMIT = 1024 * 1024


def _redis_broker_app(make_test_app: AppFactory, broker_server: Any, *, pipelined: bool) -> Celery:
    """An app on *broker_server*, published to pipelined or (kombu's
    retry_on_timeout turns batches off) one message at a time."""
    options = {} if pipelined else {"retry_on_timeout": True}
    return make_test_app(
        broker=f"{broker_server.url}/0", conf={"broker_transport_options": options}
    )


def test_a_failure_mid_batch_does_not_publish_again_what_went_out_before_it(
    make_test_app: AppFactory, broker_server: Any
) -> None:
    # Given a Redis broker published to one message at a time (kombu's
    # retry_on_timeout turns its pipelined batches off), whose bulk limit is
    # lowered after the companion connected, and a message over it third in a batch
    admin_client = broker_server.client(0)
    app = make_test_app(
        broker=f"{broker_server.url}/0",
        conf={"broker_transport_options": {"retry_on_timeout": True}},
    )
    add = app.tasks["tests.add"]
    with Companion(app) as companion:
        warmup = add.apply_delayed((0, 0), countdown=0).id
        assert companion.release_due().published == 1
        admin_client.config_set("proto-max-bulk-len", SMALL_BULK_LIMIT)
        before = [add.apply_delayed((i, i), countdown=0).id for i in range(2)]
        add.apply_delayed(("x" * (SMALL_BULK_LIMIT + 1), ""), countdown=0)

        # When the companion passes twice
        reports = [companion.release_due() for _ in range(2)]

    # Then what the broker took before the failure went out once, not on every pass
    assert _queued_ids(admin_client) == [warmup, *before]
    assert [r.published for r in reports] == [2, 0]
    # ... and the oversized one never reached the queue. Redis answers it with
    # "Protocol error" and closes the connection, so the companion reads
    # either that reply (the message's own error: dead-lettered at once) or
    # the closed connection (given back; the new connection learns the
    # lowered limit, so the next pass dead-letters it before sending).
    outcomes = [(r.returned, r.dead_lettered) for r in reports]
    assert outcomes in ([(0, 1), (0, 0)], [(1, 0), (0, 1)])
    assert _store_ids(app) == (0, 0, 1)


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "one-by-one"])
def test_a_message_over_the_redis_bulk_limit_is_dead_lettered_before_it_blocks_the_others(
    make_test_app: AppFactory, broker_server: Any, pipelined: bool
) -> None:
    # Given a Redis broker whose proto-max-bulk-len a message is over, and
    # that message due first, before two good ones
    admin_client = broker_server.client(0)
    admin_client.config_set("proto-max-bulk-len", SMALL_BULK_LIMIT)
    app = _redis_broker_app(make_test_app, broker_server, pipelined=pipelined)
    add = app.tasks["tests.add"]
    big = add.apply_delayed(("x" * (SMALL_BULK_LIMIT + 1), ""), countdown=0).id
    good = [add.apply_delayed((i, i), countdown=0).id for i in range(2)]

    # When the companion passes once
    with Companion(app) as companion:
        report = companion.release_due()

    # Then the good ones are published, and the big one is dead-lettered
    # with the reason and the fix, not sent (Redis would close the
    # connection on it, and it would fail every pass before the others)
    assert (report.published, report.returned, report.dead_lettered) == (2, 0, 1)
    assert _queued_ids(admin_client) == good
    reason = str(_dead(app)[big])
    assert "proto-max-bulk-len (1048576 bytes)" in reason
    assert "requeue" in reason
    assert _store_ids(app) == (0, 0, 1)


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "one-by-one"])
def test_the_bulk_limit_is_checked_on_the_exact_bytes_kombu_pushes(
    make_test_app: AppFactory, broker_server: Any, pipelined: bool
) -> None:
    # Given the exact size kombu pushes for a task with an 800 kB argument
    # (over 1 MiB once base64-encoded: Redis takes no lower limit)
    admin_client = broker_server.client(0)
    app = _redis_broker_app(make_test_app, broker_server, pipelined=pipelined)
    add = app.tasks["tests.add"]

    def release(limit: int) -> tuple[int, int]:
        admin_client.config_set("proto-max-bulk-len", limit)
        add.apply_delayed(("x" * 800_000, ""), countdown=0)
        with Companion(app) as companion:
            report = companion.release_due()
        return report.published, report.dead_lettered

    assert release(512 * 1024 * 1024) == (1, 0)
    size = len(admin_client.rpop("celery") or b"")
    assert size > 1024 * 1024

    # Then a limit one byte under it dead-letters the same task, unsent,
    # and a limit of exactly that size lets it through
    assert release(size - 1) == (0, 1)
    assert release(size) == (1, 0)
    assert len(admin_client.rpop("celery") or b"") == size


def test_a_signed_envelope_over_the_bulk_limit_is_dead_lettered_before_push_lua(
    make_test_app: AppFactory, broker_server: Any
) -> None:
    # Given signed entries on a store that is the broker (verified in
    # Python, then pushed by push.lua, which takes each envelope as an
    # argument), and a message parked before the server's limit was lowered
    url = f"{broker_server.url}/0"
    app = make_test_app(broker=url, conf={"zdelay_redis_url": url, "zdelay_signing_key": "k" * 32})
    add = app.tasks["tests.add"]
    big = add.apply_delayed(("x" * (SMALL_BULK_LIMIT + 1), ""), countdown=0).id
    good = [add.apply_delayed((i, i), countdown=0).id for i in range(2)]
    admin_client = broker_server.client(0)
    admin_client.config_set("proto-max-bulk-len", SMALL_BULK_LIMIT)

    # When the companion passes once
    with Companion(app) as companion:
        report = companion.release_due()
        assert companion.handoff_state.startswith("on")

    # Then the good ones are handed off and the big one dead-lettered
    assert (report.handed_off, report.returned, report.dead_lettered) == (2, 0, 1)
    assert _queued_ids(admin_client) == good
    assert "proto-max-bulk-len" in str(_dead(app)[big])
    assert _store_ids(app) == (0, 0, 1)


def test_a_redis_refusal_that_waits_holds_back_its_message_only(
    make_test_app: AppFactory, broker_server: Any
) -> None:
    # Given, as above, a Redis broker published to one message at a time
    # whose user may not write one task's queue, and tasks after that one
    admin_client = broker_server.client(0)
    admin_client.acl_setuser(
        "limited",
        enabled=True,
        passwords=["+secret"],
        keys=["celery*", "_kombu*", "unacked*"],
        commands=["+@all"],
    )
    url = f"redis://limited:secret@127.0.0.1:{broker_server.port}/0"
    app = make_test_app(broker=url, conf={"broker_transport_options": {"retry_on_timeout": True}})
    add = app.tasks["tests.add"]
    good = [add.apply_delayed((i, i), countdown=0).id for i in range(2)]
    refused = add.apply_delayed((9, 9), countdown=0, queue="forbidden").id
    good += [add.apply_delayed((i, i), countdown=0).id for i in range(2, 4)]

    # When the companion passes, then again once the operator grants the queue
    with Companion(app) as companion:
        first = companion.release_due()
        admin_client.acl_setuser("limited", enabled=True, keys=["forbidden*"])
        second = companion.release_due()

    # Then the refusal held back its own message only (as in a pipelined
    # batch), which went out once it was allowed; nothing was dead-lettered
    queued = [
        json.loads(raw)["headers"]["id"] for raw in reversed(admin_client.lrange("celery", 0, -1))
    ]
    assert queued == good
    assert (first.published, first.returned, first.failed) == (4, 1, True)
    assert (second.published, second.returned, second.failed) == (1, 0, False)
    allowed = admin_client.lrange("forbidden", 0, -1)
    assert [json.loads(raw)["headers"]["id"] for raw in allowed] == [refused]
    assert _store_ids(app) == (0, 0, 0)


# -- a connection that fails halfway is closed at once -------------------------------


@pytest.mark.timeout(60)
def test_a_silent_redis_broker_neither_hangs_the_companion_nor_leaves_a_socket_open(
    make_test_app: AppFactory, broker_server: Any
) -> None:
    # Given a Redis broker that accepts connections but does not answer
    # (before: telling whether the handoff applies waited for it forever)
    with PausableProxy("127.0.0.1", broker_server.port) as proxy:
        app = make_test_app(
            broker=f"redis://127.0.0.1:{proxy.port}/0", conf={"zdelay_lease_seconds": 1}
        )
        app.tasks["tests.add"].apply_delayed((1, 1), countdown=0)
        proxy.pause()
        # The garbage collector would close the socket some time later (and
        # warn about it then, in whatever code runs); it must be closed now.
        gc.disable()
        try:
            with Companion(app) as companion:
                report = companion.release_due()
                assert report.failed
                assert report.returned == 1
                wait_for(lambda: proxy.open_clients() == 0, timeout=10, message="sockets closed")
        finally:
            gc.enable()
        proxy.resume()

    # And the task waits in the store, as before
    assert _store_ids(app) == (1, 0, 0)
