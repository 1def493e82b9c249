"""Releases ahead of the due time (``zdelay_release_ahead_seconds``): never early all the same.

A task released ahead carries its due time in the message's ``eta``, so the
worker's own ETA timer starts it then: the hop from companion to worker is
taken before the due time instead of after it. The promise that stays: no
task starts before its due time.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
import redis
from celery import Celery

import celery_zdelay
from celery_zdelay.companion import Companion
from celery_zdelay.config import get_config
from celery_zdelay.entry import eta_text, with_eta
from celery_zdelay.errors import ConfigurationError
from celery_zdelay.store.scripts import store_lua
from tests.conftest import RECORD_DB, AppFactory, RabbitMQ
from tests.helpers import Runs
from tests.project import RECEIVED_KEY, RECORD_RECEIVED_ENV
from tests.support.keys import SHARD0

pytestmark = [pytest.mark.timeout(90), pytest.mark.timing]

#: The broker's list of the default queue (a Redis broker).
QUEUE = "celery"
SIGNING_KEY = "a-signing-key-of-32-bytes-length"


def _due_ms(client: redis.Redis, task_id: str) -> int:
    score = client.zscore(SHARD0.due, task_id)
    assert score is not None
    return int(score) // 1024


def test_the_setting_is_seconds_from_0_to_1_and_off_by_default(
    make_test_app: AppFactory,
) -> None:
    assert (
        get_config(make_test_app(conf={"zdelay_release_ahead_seconds": None})).release_ahead_ms == 0
    )
    assert (
        get_config(make_test_app(conf={"zdelay_release_ahead_seconds": 0.005})).release_ahead_ms
        == 5
    )
    # Below a millisecond rounds up: the Redis clock's unit.
    assert (
        get_config(make_test_app(conf={"zdelay_release_ahead_seconds": 0.0002})).release_ahead_ms
        == 1
    )
    for bad in (-0.001, 1.5, "5ms", True, float("nan")):
        with pytest.raises(ConfigurationError, match="zdelay_release_ahead_seconds"):
            get_config(make_test_app(conf={"zdelay_release_ahead_seconds": bad}))


def test_lua_and_python_write_the_same_eta_for_any_due_time(redis_client: redis.Redis) -> None:
    """handoff.lua formats dates without os.date: checked against Python's datetime.

    Leap days, century years (2100 is not a leap year, 2000 is), the epoch
    and the last millisecond of a year.
    """
    script = store_lua("_expand").read() + "\nreturn zdelay_iso(tonumber(ARGV[1]))"
    instants = [
        datetime(1970, 1, 1, tzinfo=timezone.utc),
        datetime(2000, 2, 29, 23, 59, 59, 999_000, tzinfo=timezone.utc),
        datetime(2024, 2, 29, 12, 0, 0, 1_000, tzinfo=timezone.utc),
        datetime(2026, 12, 31, 23, 59, 59, 999_000, tzinfo=timezone.utc),
        datetime(2100, 3, 1, 0, 0, 0, 0, tzinfo=timezone.utc),
        datetime(2199, 12, 31, 6, 7, 8, 90_000, tzinfo=timezone.utc),
    ]
    epoch = datetime(1970, 1, 1, tzinfo=timezone.utc)
    dues = [(at - epoch) // timedelta(milliseconds=1) for at in instants]
    dues += [1_764_547_200_123 + 86_400_000 * k + 3_601_007 * k for k in range(400)]
    for due_ms in dues:
        lua = redis_client.eval(script, 0, due_ms).decode()
        assert lua == eta_text(due_ms)
        assert datetime.fromisoformat(lua) == epoch + timedelta(milliseconds=due_ms)


def test_only_the_top_level_eta_header_is_set_and_only_when_celery_wrote_it_first() -> None:
    head = b'{"body":"e30=","content-type":"application/json","headers":{"lang":"py",'
    celery = head + b'"task":"t","id":"i","shadow":null,"eta":null,"x":{"eta":null}},"p":"'
    assert with_eta(celery, 0) == (
        head + b'"task":"t","id":"i","shadow":null,'
        b'"eta":"1970-01-01T00:00:00.000000+00:00","x":{"eta":null}},"p":"'
    )
    # Another header's nested "eta" first, a key ending in an escaped quote and
    # eta, no eta header, or one that is set already: not rewritten.
    assert with_eta(head + b'"x":{"eta":null},"eta":null},"p":"', 0) is None
    assert with_eta(head + b'"x\\"eta":null,"eta":null},"p":"', 0) is None
    assert with_eta(head + b'"task":"t"},"p":"', 0) is None
    assert with_eta(head + b'"eta":"2030-01-01T00:00:00"},"p":"', 0) is None


@pytest.mark.parametrize("form", ["handoff", "whole", "signed", "generic"])
def test_released_ahead_messages_carry_their_due_time_as_eta_and_overdue_ones_none(
    make_test_app: AppFactory, redis_server, redis_client: redis.Redis, form: str
) -> None:
    # Given a companion that releases up to a second ahead, on each path
    conf: dict[str, object] = {"zdelay_release_ahead_seconds": 1.0}
    broker = None
    if form == "whole":
        conf["zdelay_whole_messages"] = True
    elif form == "signed":
        conf["zdelay_signing_key"] = SIGNING_KEY  # leased, verified, then push.lua
    elif form == "generic":
        broker = f"{redis_server.url}/3"  # kombu publishes it
    app = make_test_app(broker=broker, conf=conf)
    record = app.tasks["tests.record"]
    # and tasks due within that second, and tasks overdue
    ahead = [record.apply_delayed((i,), countdown=0.9 + i / 40) for i in range(4)]
    overdue_at = datetime.now(timezone.utc) - timedelta(seconds=5)
    overdue = [record.apply_delayed(("late", i), eta=overdue_at) for i in range(2)]
    dues = {r.id: _due_ms(redis_client, r.id) for r in ahead + overdue}

    # When the companion makes one pass
    with Companion(app) as companion:
        report = companion.release_due()

    # Then all are released: those ahead with their due time as their eta,
    # the overdue ones without one, as ever
    assert report.released == 6
    broker_client = redis_server.client(3) if form == "generic" else redis_client
    headers = {
        h["id"]: h
        for h in (json.loads(raw)["headers"] for raw in broker_client.lrange(QUEUE, 0, -1))
    }
    broker_client.close()
    assert set(headers) == set(dues)
    # (each by its own release: on a loaded machine the pass can come after
    # a task's due time, and then it is released overdue)
    late = {r.id: _released_late_ms(app, r.id) for r in ahead}
    released_ahead = [r for r in ahead if late[r.id] < 0]
    assert released_ahead, f"none released ahead, the test proves nothing: {late}"
    for result in ahead:
        want = eta_text(dues[result.id]) if late[result.id] < 0 else None
        assert headers[result.id]["eta"] == want
    for result in overdue:
        assert headers[result.id]["eta"] is None
    # And each ahead release is reported as negative lateness, no more than the lead
    assert sum(1 for late in report.lateness_ms if -1000 <= late < 0) == len(released_ahead)


def _released_late_ms(app: Celery, task_id: str) -> int:
    """How late the companion released *task_id* by its history (negative: ahead)."""
    (released,) = [e for e in celery_zdelay.history(task_id, app=app) if e.event == "released"]
    assert released.late_ms is not None
    return released.late_ms


def test_history_says_how_far_ahead_a_task_was_released(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = make_test_app(conf={"zdelay_release_ahead_seconds": 1.0})
    result = app.tasks["tests.record"].apply_delayed((1,), countdown=0.6)
    due = _due_ms(redis_client, result.id)
    with Companion(app) as companion:
        assert companion.release_due().released == 1
    (released,) = [e for e in celery_zdelay.history(result.id, app=app) if e.event == "released"]
    assert released.late_ms is not None
    released_ms = round(released.at.timestamp() * 1000)
    assert released.late_ms == released_ms - due
    assert -1000 <= released.late_ms < 0
    assert celery_zdelay.task_history.describe(released).endswith("ms ahead")


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("path", "pool"),
    [("handoff", "solo"), ("handoff", "prefork"), ("generic", "solo"), ("rabbitmq", "solo")],
)
def test_no_task_starts_before_its_due_time_when_released_ahead(
    make_test_app: AppFactory,
    redis_server,
    worker,
    companion,
    runs: Runs,
    request: pytest.FixtureRequest,
    path: str,
    pool: str,
) -> None:
    """The worker's timer, not the companion, holds a task released ahead: still never early.

    Released up to a second ahead (the most the setting allows, so that on
    a loaded machine, where a worker may take hundreds of ms to take a
    message, many still reach it before they are due: that is the case
    tested), each task must start at its due time or later, on the Redis
    clock (the worker's and Redis's clocks are this machine's).
    Caught, e.g., by dropping the eta from the released message in
    handoff.lua (``message = zdelay_with_eta(message, due_ms)`` -> nothing)
    or in release.py (``message.headers["eta"] = ...`` -> nothing): the
    worker then runs each task as it arrives, up to a second early.
    """
    # Given a companion releasing up to a second ahead, and a worker that
    # notes when each message reaches it and when each task starts (Redis clock)
    conf = {"zdelay_release_ahead_seconds": 1.0}
    queues: tuple[str, ...] = ()
    if path == "handoff":
        app = make_test_app(conf=conf)
    elif path == "generic":
        app = make_test_app(broker=f"{redis_server.url}/3", conf=conf)
    else:
        rabbitmq: RabbitMQ = request.getfixturevalue("rabbitmq")
        app = make_test_app(
            broker=rabbitmq.url, conf={**conf, "task_default_queue": rabbitmq.queue}
        )
        queues = (rabbitmq.queue,)
    worker(app, *queues, env={RECORD_RECEIVED_ENV: "1"}, pool=pool)
    companion(app)
    store = redis_server.client(0)

    # When 200 tasks are parked to fall due over 2 seconds, from 1.5 s on
    record = app.tasks["tests.record"]
    dues = {}
    for i in range(200):
        result = record.apply_delayed((i,), countdown=1.5 + 2.0 * i / 200)
        dues[result.id] = _due_ms(store, result.id)

    # Then every one runs once, none started before it was due
    runs.wait_for_ids(set(dues))
    assert runs.duplicates() == {}
    early = {run["id"]: dues[run["id"]] - run["redis_ms"] for run in runs.all()}
    early = {task_id: ms for task_id, ms in early.items() if ms > 0}
    assert early == {}, f"{len(early)} started early, by up to {max(early.values())} ms"
    # And some reached the worker before they were due (released ahead), or
    # the test would prove nothing (most do on a quiet machine; 15 of 200
    # did at a load of 20 on 2 cores, where the companion ran seconds late)
    recorder = redis_server.client(RECORD_DB)
    received = [json.loads(raw) for raw in recorder.lrange(RECEIVED_KEY, 0, -1)]
    ahead = sorted(dues[r["id"]] - r["redis_ms"] for r in received)
    before_due = sum(1 for ms in ahead if ms > 0)
    assert before_due >= 5, (
        f"only {before_due} of {len(dues)} arrived ahead; ms ahead, by decile: {ahead[::20]}"
    )
    store.close()
    recorder.close()


def test_a_pass_that_fast_forwards_time_releases_without_an_eta(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    """celery_zdelay.testing's fast-forward: an eta would make a worker wait for real."""
    app: Celery = make_test_app(conf={"zdelay_release_ahead_seconds": 1.0})
    app.tasks["tests.record"].apply_delayed((1,), countdown=3600)
    with Companion(app) as companion:
        assert companion.release_due(advance_ms=3_600_500).released == 1
    (raw,) = redis_client.lrange(QUEUE, 0, -1)
    assert json.loads(raw)["headers"]["eta"] is None


def test_a_task_released_ahead_sees_the_eta_celery_would_have_sent(
    make_test_app: AppFactory, redis_client: redis.Redis, worker, runs: Runs
) -> None:
    """request.eta is the call's ETA (zdelay_eta), not the due time it was released with.

    A countdown's ETA is counted on the producer's clock to the microsecond,
    before the jitter; the released message's eta is the due time, to the
    ms, jitter included. Caught by restore_eta keeping a request.eta
    already set (``if request.eta is None:``): the task would see the due time.
    """
    app = make_test_app(conf={"zdelay_release_ahead_seconds": 1.0})
    worker(app)
    result = app.tasks["tests.record"].apply_delayed(("eta",), countdown=0.4, jitter=0.3)
    due = _due_ms(redis_client, result.id)
    with Companion(app) as companion:
        assert companion.release_due().released == 1
    assert result.get(timeout=30) == ["eta"]
    (run,) = runs.all()
    assert run["redis_ms"] >= due
    seen = datetime.fromisoformat(run["eta"])
    assert run["eta"] != eta_text(due)
    assert seen <= datetime.fromisoformat(eta_text(due)) + timedelta(milliseconds=5)
