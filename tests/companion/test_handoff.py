"""The atomic handoff into a Redis broker, with a real worker: kombu's own
queue naming (global_keyprefix, sep, priority steps), several queues, chain
callbacks, and messages that must take the generic path instead."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import redis
from celery import chain

import celery_zdelay
from celery_zdelay.companion import Companion
from tests.conftest import AppFactory
from tests.helpers import Runs

pytestmark = pytest.mark.timeout(90)

TRANSPORT: dict[str, Any] = {
    "global_keyprefix": "pfx:",
    "sep": ":",
    "priority_steps": list(range(10)),
    "queue_order_strategy": "priority",
}


def test_handoff_names_lists_as_kombu_does_and_a_worker_runs_them(
    make_test_app: AppFactory, redis_client: redis.Redis, worker, runs: Runs
) -> None:
    app = make_test_app(
        conf={
            "broker_transport_options": TRANSPORT,
            "task_routes": {"tests.mul": {"queue": "second"}},
        }
    )
    add, mul, record = app.tasks["tests.add"], app.tasks["tests.mul"], app.tasks["tests.record"]
    chained = celery_zdelay.apply_delayed(chain(add.s(1, 2), mul.s(10)), countdown=0)
    urgent = record.apply_delayed(("urgent",), countdown=0, queue="second", priority=9)
    plain = record.apply_delayed(("plain",), countdown=0)

    with Companion(app) as companion:
        report = companion.release_due()
    assert report.handed_off == 3
    assert report.published == 0
    # The lists kombu's Redis transport reads, with its prefix, separator and steps.
    assert redis_client.llen("pfx:celery") == 2
    assert redis_client.llen("pfx:second:9") == 1

    worker(app, "celery", "second")
    assert chained.get(timeout=30) == 30
    runs.wait_for_ids({urgent.id, plain.id})
    by_id = runs.by_id()
    assert by_id[urgent.id]["priority"] == 9
    assert by_id[urgent.id]["routing_key"] == "second"
    assert by_id[plain.id]["args"] == ["plain"]


def test_a_topic_exchange_takes_the_generic_path_and_says_so_once(
    make_test_app: AppFactory,
    redis_client: redis.Redis,
    worker,
    runs: Runs,
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = make_test_app(
        queues=[
            {"name": "celery"},
            {
                "name": "events",
                "exchange": "events",
                "exchange_type": "topic",
                "routing_key": "ev.#",
            },
        ],
    )
    record = app.tasks["tests.record"]
    # Given the "events" queue bound to its topic exchange, as a worker binds it
    with app.connection_for_write() as connection:
        app.amqp.queues["events"].bind(connection.default_channel).declare()

    # When three tasks routed through the topic exchange and three for a plain
    # queue fall due, and a companion releases them in two passes
    routed = [
        record.apply_delayed((i,), countdown=0, queue="events", routing_key="ev.x")
        for i in range(2)
    ]
    direct = [record.apply_delayed((i,), countdown=0) for i in range(3)]
    caplog.set_level(logging.INFO, logger="celery_zdelay")
    with Companion(app) as companion:
        first = companion.release_due()
        routed.append(
            record.apply_delayed((2,), countdown=0, exchange="events", routing_key="ev.x")
        )
        second = companion.release_due()

    # Then the plain ones were handed off atomically and the routed ones
    # published through kombu, each into its own queue, and the reason was
    # logged once, not once per message or per pass
    assert (first.handed_off, first.published) == (3, 2)
    assert (second.handed_off, second.published) == (0, 1)
    assert redis_client.llen("celery") == 3
    assert redis_client.llen("events") == 3
    said = [r for r in caplog.records if "are published through kombu" in r.getMessage()]
    assert [r.getMessage().split(":")[0] for r in said] == [
        "Messages for exchange 'events', routing key 'ev.x' are published through kombu, "
        "not handed off atomically"
    ]

    # And a worker runs each of them once
    worker(app, "celery", "events")
    runs.wait_for_ids({r.id for r in routed + direct})
    assert runs.duplicates() == {}
