"""Transparent mode: with ``zdelay_threshold`` set, calling code stays as it is.

Given an app with ``zdelay_threshold``, every task message Celery publishes
with an ETA at least that far away is parked instead, whoever publishes it:
``apply_async(countdown=)``, ``Task.retry(countdown=)`` in a worker,
``app.send_task(eta=)``, canvas steps the producer sends and the ones a
worker sends after a step ran. Shorter delays keep Celery's native path.
A parked message reaches the worker without an ETA, so the worker holds
nothing.

The threshold alone is enough wherever ``celery_zdelay`` is imported: with
or without ``task_cls``, ``amqp=`` or an app's own ``AMQP`` class, whichever
way the first message is published. Some tests name the amqp class as older
documentation said (``Celery(amqp="celery_zdelay:TransparentAMQP")``), which
keeps working.
"""

from __future__ import annotations

import contextlib
import logging
import math
import types
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import celery
import pytest
import redis
from celery import Celery, chain, group
from celery.app.amqp import AMQP
from kombu import Connection, Exchange

import celery_zdelay
from celery_zdelay.companion import Companion
from celery_zdelay.transparent import is_transparent
from tests.conftest import AppFactory, RabbitMQ
from tests.helpers import Runs, wait_for
from tests.support.keys import SHARD0

pytestmark = pytest.mark.timeout(90)

DUE = SHARD0.due
HOUR_MS = 3_600_000


def _transparent_app(make_test_app: AppFactory, **kwargs: Any) -> Celery:
    app = make_test_app(**kwargs)
    # What Celery(amqp="celery_zdelay:TransparentAMQP") sets.
    app.amqp_cls = "celery_zdelay.transparent:TransparentAMQP"
    return app


@pytest.fixture
def app(make_test_app: AppFactory) -> Celery:
    return _transparent_app(make_test_app, conf={"zdelay_threshold": 60})


def _parked(client: redis.Redis, task_id: str) -> int | None:
    """Return the due time (ms) *task_id* is parked for, if it is parked."""
    score = client.zscore(DUE, task_id)
    return None if score is None else int(score) // 1024


def _release_within_the_hour(app: Celery) -> int:
    with Companion(app) as companion:
        report = companion.release_due(advance_ms=HOUR_MS + 60_000)
    assert not report.failed
    return report.released


def _now_ms() -> int:
    return int(datetime.now(timezone.utc).timestamp() * 1000)


def test_apply_async_with_a_long_countdown_is_parked_and_runs_when_due(
    make_test_app: AppFactory, redis_client: redis.Redis, worker, companion, runs: Runs
) -> None:
    app = _transparent_app(make_test_app, conf={"zdelay_threshold": 1})
    worker(app)
    companion(app)
    before_ms = _now_ms()

    result = app.tasks["tests.record"].apply_async(("later",), countdown=2)

    due_ms = _parked(redis_client, result.id)
    assert due_ms is not None
    assert before_ms + 2000 <= due_ms <= _now_ms() + 2000
    assert result.get(timeout=30) == ["later"]
    (run,) = runs.all()
    assert run["id"] == result.id
    assert run["message_eta"] is None, "the worker got an ETA task: it was not parked"
    assert run["redis_ms"] >= due_ms


def test_task_retry_with_a_long_countdown_is_parked_by_the_worker(
    app: Celery, redis_client: redis.Redis, worker, runs: Runs
) -> None:
    worker(app)

    result = app.tasks["tests.retry_once"].apply_async((3600,))

    wait_for(lambda: _parked(redis_client, result.id), message="the retry to be parked")
    assert [run["retries"] for run in runs.all()] == [0]
    assert _release_within_the_hour(app) == 1
    assert result.get(timeout=30) == "retried"
    first, retry = runs.all()
    assert retry["id"] == first["id"] == result.id
    assert retry["retries"] == 1
    assert retry["message_eta"] is None


def test_send_task_with_a_far_eta_is_parked(
    app: Celery, redis_client: redis.Redis, worker, runs: Runs
) -> None:
    worker(app)
    eta = datetime.now(timezone.utc) + timedelta(hours=1)

    result = app.send_task("tests.add", (2, 3), eta=eta)

    assert _parked(redis_client, result.id) == math.ceil(eta.timestamp() * 1000)
    assert _release_within_the_hour(app) == 1
    assert result.get(timeout=30) == 5
    assert runs.all()[0]["message_eta"] is None


def test_a_chain_step_with_a_countdown_is_parked_when_the_worker_sends_it(
    app: Celery, redis_client: redis.Redis, worker, runs: Runs
) -> None:
    record = app.tasks["tests.record"]
    worker(app)

    result = chain(record.si("now"), record.si("an hour later").set(countdown=3600)).apply_async()

    first = result.parent
    assert first.get(timeout=30) == ["now"]
    wait_for(lambda: _parked(redis_client, result.id), message="the second step to be parked")
    assert _release_within_the_hour(app) == 1
    assert result.get(timeout=30) == ["an hour later"]
    now, later = runs.all()
    assert (now["id"], now["message_eta"]) == (first.id, None)
    assert (later["id"], later["message_eta"]) == (result.id, None)
    assert later["parent_id"] == later["root_id"] == first.id


def test_a_group_with_a_countdown_parks_every_member(
    app: Celery, redis_client: redis.Redis, worker, runs: Runs
) -> None:
    add = app.tasks["tests.add"]
    worker(app)

    result = group(add.s(i, i) for i in range(5)).apply_async(countdown=3600)

    assert all(_parked(redis_client, r.id) for r in result.results)
    assert _release_within_the_hour(app) == 5
    assert result.get(timeout=30) == [0, 2, 4, 6, 8]
    assert {run["group"] for run in runs.all()} == {result.id}
    assert [run["message_eta"] for run in runs.all()] == [None] * 5


def test_short_delays_keep_celerys_native_path(
    app: Celery, redis_client: redis.Redis, worker, runs: Runs
) -> None:
    record = app.tasks["tests.record"]
    worker(app)

    soon = record.apply_async(("countdown",), countdown=0.5)
    sent = app.send_task("tests.record", ("eta",), eta=datetime.now(timezone.utc))
    retried = app.tasks["tests.retry_once"].apply_async((0.5,))

    assert soon.get(timeout=30) == ["countdown"]
    assert sent.get(timeout=30) == ["eta"]
    assert retried.get(timeout=30) == "retried"
    assert redis_client.zcard(DUE) == 0
    etas = {run["args"][0]: run["eta"] for run in runs.all() if run["task"] == "tests.record"}
    assert etas["countdown"] is not None
    assert etas["eta"] is not None
    assert [run["eta"] is not None for run in runs.all() if run["retries"] == 1] == [True]


def test_apply_delayed_still_parks_once_in_transparent_mode(
    app: Celery, redis_client: redis.Redis
) -> None:
    result = app.tasks["tests.record"].apply_delayed(("x",), countdown=3600)

    assert redis_client.zcard(DUE) == 1
    assert _parked(redis_client, result.id) is not None


def test_the_threshold_alone_is_enough_once_a_task_is_bound(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = make_test_app(conf={"zdelay_threshold": 60})

    result = app.tasks["tests.record"].apply_async(("x",), countdown=3600)

    assert is_transparent(app)
    assert _parked(redis_client, result.id) is not None
    assert redis_client.llen("celery") == 0


def test_an_app_without_the_threshold_publishes_natively(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = make_test_app()

    app.tasks["tests.record"].apply_async(("x",), countdown=3600)

    assert not is_transparent(app)
    assert redis_client.zcard(DUE) == 0
    assert redis_client.llen("celery") == 1


@pytest.fixture
def plain_app(redis_server) -> Iterator[Celery]:
    """An app that names the amqp class itself and uses Celery's own Task."""
    app = Celery(
        "plain",
        broker=f"{redis_server.url}/0",
        amqp="celery_zdelay.transparent:TransparentAMQP",
    )
    app.conf.zdelay_threshold = 60
    yield app
    celery_zdelay.parking.store_for(app).close()
    app.close()


def test_naming_the_amqp_class_parks_send_task_with_no_task_bound(
    plain_app: Celery, redis_client: redis.Redis
) -> None:
    result = plain_app.send_task("some.remote.task", (1,), countdown=600)

    assert _parked(redis_client, result.id) is not None
    assert redis_client.llen("celery") == 0


def test_an_app_with_its_own_amqp_class_parks_too(redis_server, redis_client: redis.Redis) -> None:
    class CompanyAMQP(AMQP):  # type: ignore[misc]
        pass

    app = Celery("own", broker=f"{redis_server.url}/0", amqp=CompanyAMQP, set_as_current=False)
    app.conf.zdelay_threshold = 60
    try:
        result = app.send_task("some.remote.task", (1,), countdown=600)

        assert isinstance(app.amqp, CompanyAMQP)
        assert _parked(redis_client, result.id) is not None
        assert redis_client.llen("celery") == 0
    finally:
        celery_zdelay.parking.store_for(app).close()
        app.close()


def test_send_task_first_does_not_turn_parking_off_for_later_calls(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Regression: send_task built app.amqp before any task was bound, and
    # transparent mode then gave up (a warning) for every later call too.
    app = make_test_app(conf={"zdelay_threshold": 60})

    sent = app.send_task("tests.record", ("sent",), countdown=600)
    applied = app.tasks["tests.record"].apply_async(("applied",), countdown=600)

    assert _parked(redis_client, sent.id) is not None
    assert _parked(redis_client, applied.id) is not None
    assert redis_client.llen("celery") == 0


def test_the_threshold_alone_parks_without_task_cls_or_amqp(
    redis_server, redis_client: redis.Redis
) -> None:
    # Regression: with neither task_cls nor amqp= nothing was parked, silently.
    app = Celery("bare", broker=f"{redis_server.url}/0", set_as_current=False)
    app.conf.zdelay_threshold = 60

    @app.task(name="bare.noop", shared=False)
    def noop() -> None:
        pass

    try:
        sent = app.send_task("bare.noop", countdown=600)
        applied = noop.apply_async(countdown=600)

        assert _parked(redis_client, sent.id) is not None
        assert _parked(redis_client, applied.id) is not None
        assert redis_client.llen("celery") == 0
    finally:
        celery_zdelay.parking.store_for(app).close()
        app.close()


def test_an_app_transparent_mode_could_not_reach_is_reported_loudly(
    redis_server, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # fixups=[] turns off Celery's fix-ups, ours among them: the first far-ETA
    # message goes out natively, and that is an error in the log, not silence.
    previous = celery.current_app._get_current_object()
    app = Celery("nofixups", broker=f"{redis_server.url}/0", fixups=[], set_as_current=True)
    app.conf.zdelay_threshold = 60
    try:
        with caplog.at_level(logging.ERROR, logger="celery_zdelay.transparent"):
            first = app.send_task("some.remote.task", countdown=600)
        second = app.send_task("some.remote.task", countdown=600)

        assert f"some.remote.task[{first.id}] was sent to the broker with an ETA" in caplog.text
        assert "zdelay_threshold is set" in caplog.text
        assert redis_client.llen("celery") == 1
        assert _parked(redis_client, second.id) is not None
    finally:
        celery_zdelay.parking.store_for(app).close()
        app.close()
        previous.set_current()


# -- RabbitMQ quorum queues: Celery's native delayed delivery (Celery >= 5.5) --


@pytest.fixture
def quorum_app(make_test_app: AppFactory, rabbitmq: RabbitMQ) -> Iterator[Celery]:
    pytest.importorskip("kombu.transport.native_delayed_delivery")
    app = _transparent_app(
        make_test_app,
        broker=rabbitmq.url,
        conf={"zdelay_threshold": 60, "task_default_queue": rabbitmq.queue},
        queues=[
            {
                "name": rabbitmq.queue,
                "exchange": rabbitmq.queue,
                "exchange_type": "topic",
                "routing_key": rabbitmq.queue,
                "queue_arguments": {"x-queue-type": "quorum"},
            }
        ],
    )
    yield app
    with Connection(rabbitmq.url) as connection, contextlib.suppress(Exception):
        Exchange(rabbitmq.queue).bind(connection.default_channel).delete()


def test_on_quorum_queues_long_delays_are_parked_and_short_ones_stay_native(
    quorum_app: Celery, redis_client: redis.Redis, rabbitmq: RabbitMQ, worker, runs: Runs
) -> None:
    record = quorum_app.tasks["tests.record"]
    worker(quorum_app, rabbitmq.queue)

    parked = record.apply_async(("parked",), countdown=3600)
    native = record.apply_async(("native",), countdown=1)

    assert _parked(redis_client, parked.id) is not None
    assert native.get(timeout=30) == ["native"]
    assert _parked(redis_client, native.id) is None
    assert _release_within_the_hour(quorum_app) == 1
    assert parked.get(timeout=30) == ["parked"]
    assert [run["args"] for run in runs.all()] == [["native"], ["parked"]]
    assert runs.by_id()[parked.id]["message_eta"] is None


def test_a_django_style_setting_alone_parks(redis_server, redis_client: redis.Redis) -> None:
    # What docs/django.rst shows: CELERY_ZDELAY_THRESHOLD in settings, the
    # app configured with namespace="CELERY", no amqp=.
    settings = types.SimpleNamespace(
        CELERY_BROKER_URL=f"{redis_server.url}/0", CELERY_ZDELAY_THRESHOLD=60
    )
    app = Celery("djangoish", task_cls="celery_zdelay.contrib.django:Task", set_as_current=False)
    app.config_from_object(settings, namespace="CELERY")

    @app.task(name="djangoish.remind", shared=False)
    def remind() -> None:
        pass

    try:
        result = remind.apply_async(countdown=600)

        assert _parked(redis_client, result.id) is not None
        assert redis_client.llen("celery") == 0
    finally:
        celery_zdelay.parking.store_for(app).close()
        app.close()
