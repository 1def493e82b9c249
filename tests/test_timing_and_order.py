"""Never early, due-time order, and the eta/countdown semantics of Celery."""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone

import pytest
import redis
from celery import Celery

import celery_zdelay
from celery_zdelay.companion import Companion
from tests.conftest import RECORD_DB, AppFactory, RabbitMQ
from tests.helpers import Runs
from tests.project import RECEIVED_KEY, RECORD_RECEIVED_ENV
from tests.support.clock import redis_ms
from tests.support.keys import SHARD0

pytestmark = [pytest.mark.timeout(60), pytest.mark.timing]


def _due_ms(client: redis.Redis, task_id: str) -> int:
    score = client.zscore(SHARD0.due, task_id)
    assert score is not None
    return int(score) // 1024


@pytest.mark.parametrize("path", ["handoff", "generic"])
def test_the_claim_scripts_never_pick_an_entry_before_its_due_time_on_the_redis_clock(
    make_test_app: AppFactory, redis_server, redis_client: redis.Redis, path: str
) -> None:
    """Each claim against each entry's due time, on a clock the script does not report.

    The Redis clock is read before and after every claim: the claim ran
    between the two readings, so its "now" must lie between them, and no
    entry it released may be due after it. Checking against the ``now_ms``
    a script reports about itself would pass a script that runs ahead of
    the clock and says so; this catches, in claim.lua (and in handoff.lua)::

        local now_ms = zdelay_now_ms()  ->  local now_ms = zdelay_now_ms() + 30

    The test below checks the same promise end to end, at the worker. The
    generic path runs when the broker is another Redis database.
    """
    broker = None if path == "handoff" else f"{redis_server.url}/3"
    app = make_test_app(broker=broker)
    record = app.tasks["tests.record"]
    client = redis_client
    dues = {}
    for i in range(200):
        result = record.apply_delayed((i,), countdown=0.05 + (i % 40) * 0.01)
        dues[result.id] = _due_ms(client, result.id)

    released = 0
    with Companion(app) as companion:
        deadline = time.monotonic() + 20
        while released < len(dues):
            assert time.monotonic() < deadline, f"released {released} of {len(dues)}"
            for shard in companion.shards:
                before_ms = redis_ms(client)
                result = companion.releaser.claim(shard, fresh=True)
                after_ms = redis_ms(client)
                assert before_ms <= result.now_ms <= after_ms
                for due in result.handed_due_ms:
                    assert due <= result.now_ms
                released += len(result.handed_due_ms)
                for entry in result.entries:
                    assert entry.due_ms == dues[entry.task_id]
                    assert entry.due_ms <= result.now_ms
                companion.store.ack(shard, result.token, [e.task_id for e in result.entries])
                released += len(result.entries)
    assert released == len(dues)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("path", ["handoff", "generic", "rabbitmq"])
def test_no_task_reaches_a_worker_before_its_due_time(
    make_test_app: AppFactory,
    redis_server,
    worker,
    companion,
    runs: Runs,
    request: pytest.FixtureRequest,
    path: str,
) -> None:
    # Given a companion and a worker that notes, on the Redis clock, the
    # moment each message reaches it (before it runs)
    queues: tuple[str, ...] = ()
    if path == "handoff":
        app = make_test_app()
    elif path == "generic":
        app = make_test_app(broker=f"{redis_server.url}/3")
    else:
        rabbitmq: RabbitMQ = request.getfixturevalue("rabbitmq")
        app = make_test_app(broker=rabbitmq.url, conf={"task_default_queue": rabbitmq.queue})
        queues = (rabbitmq.queue,)
    worker(app, *queues, env={RECORD_RECEIVED_ENV: "1"})
    companion(app)
    store = redis_server.client(0)

    # When 500 tasks are parked to fall due over the next 3 seconds
    record = app.tasks["tests.record"]
    dues = {}
    for i in range(500):
        result = record.apply_delayed((i,), countdown=0.5 + 3.0 * i / 500)
        dues[result.id] = _due_ms(store, result.id)

    # Then every one runs once, and none reached the worker before it was due
    runs.wait_for_ids(set(dues))
    assert runs.duplicates() == {}
    recorder = redis_server.client(RECORD_DB)
    received = [json.loads(raw) for raw in recorder.lrange(RECEIVED_KEY, 0, -1)]
    assert sorted(r["id"] for r in received) == sorted(dues)
    early = {
        r["id"]: dues[r["id"]] - r["redis_ms"] for r in received if r["redis_ms"] < dues[r["id"]]
    }
    assert early == {}, f"{len(early)} received early, by up to {max(early.values())} ms"
    assert all(run["redis_ms"] >= dues[run["id"]] for run in runs.all())


def test_entries_are_released_in_due_order_and_same_millisecond_in_parking_order(
    app: Celery, redis_client: redis.Redis
) -> None:
    record = app.tasks["tests.record"]
    instant = datetime.now(timezone.utc) + timedelta(milliseconds=300)
    earlier = instant - timedelta(milliseconds=100)
    expected = []
    # Interleave two due times; within each, parking order must hold.
    for i in range(30):
        late = record.apply_delayed((f"late-{i}",), eta=instant)
        early = record.apply_delayed((f"early-{i}",), eta=earlier)
        expected.append(("early", early.id))
        expected.append(("late", late.id))
    expected.sort(key=lambda item: item[0] != "early")  # stable: keeps parking order

    with Companion(app) as companion:
        deadline = time.monotonic() + 10
        while redis_client.llen("celery") < len(expected):
            assert time.monotonic() < deadline
            companion.release_due()
            time.sleep(0.01)

    released = [json.loads(raw)["headers"]["id"] for raw in redis_client.lrange("celery", 0, -1)]
    released.reverse()  # LPUSH: the first pushed is last in LRANGE
    assert released == [task_id for _, task_id in expected]


def test_beyond_1024_entries_in_one_millisecond_the_rest_share_its_last_slot(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given 1,100 tasks parked in one batch for the same millisecond
    record = app.tasks["tests.record"]
    instant = datetime.now(timezone.utc).replace(microsecond=0) - timedelta(seconds=1)
    with celery_zdelay.batch(app):
        parked = [record.apply_delayed((i,), eta=instant).id for i in range(1_100)]

    # Then each of the first 1,024 takes the next of the millisecond's slots,
    # and the rest share the last one: none spills into the next millisecond
    first_slot = int(instant.timestamp() * 1000) * 1024
    scores = dict(redis_client.zrange(SHARD0.due, 0, -1, withscores=True))
    assert [int(scores[i.encode()]) for i in parked] == [
        first_slot + min(k, 1023) for k in range(1_100)
    ]

    # When a companion releases them
    with Companion(app) as companion:
        while companion.release_due().released:
            pass

    # And the first 1,023 leave in parking order, each in a slot of its own,
    # and the other 77, sharing the millisecond's last slot, all leave after them
    released = [json.loads(raw)["headers"]["id"] for raw in redis_client.lrange("celery", 0, -1)]
    released.reverse()  # LPUSH: the first pushed is last in LRANGE
    assert released[:1_023] == parked[:1_023]
    assert sorted(released[1_023:]) == sorted(parked[1_023:])


@pytest.mark.parametrize(
    ("eta", "expected"),
    [
        pytest.param(datetime(2031, 5, 6, 7, 8, 9, 123000), 1935817689123, id="naive-is-utc"),
        pytest.param(
            datetime(2031, 5, 6, 9, 8, 9, 123000, tzinfo=timezone(timedelta(hours=2))),
            1935817689123,
            id="aware",
        ),
        pytest.param("2031-05-06T07:08:09.123000+00:00", 1935817689123, id="iso-string"),
        pytest.param(datetime(2031, 5, 6, 7, 8, 9, 123400), 1935817689124, id="rounded-up"),
    ],
)
def test_eta_is_read_as_celery_reads_it(
    app: Celery, redis_client: redis.Redis, eta: object, expected: int
) -> None:
    result = app.tasks["tests.record"].apply_delayed((1,), eta=eta)
    assert _due_ms(redis_client, result.id) == expected


SKEW_S = 600


@pytest.mark.parametrize("skew_s", [SKEW_S, -SKEW_S], ids=["ahead", "behind"])
@pytest.mark.parametrize("call", ["apply_delayed", "send_delayed"])
def test_a_countdown_counts_on_the_redis_clock_whatever_the_producers_clock_says(
    app: Celery, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, skew_s: int, call: str
) -> None:
    """A producer whose clock is 10 minutes off still parks at Redis-now + countdown.

    Only the producer's clock is moved (``time.time`` in this process);
    Redis keeps the true time. Catches, in ``schedule.due_from``::

        return Due("r", math.ceil(countdown * 1000))
        ->  return Due("a", math.ceil((time.time() + countdown) * 1000))

    (a countdown added to the producer's clock): the entry would be due 10
    minutes early or late.
    """
    true_time = time.time
    true_time_ns = time.time_ns
    monkeypatch.setattr(time, "time", lambda: true_time() + skew_s)
    monkeypatch.setattr(time, "time_ns", lambda: true_time_ns() + skew_s * 10**9)
    assert abs(time.time() - true_time() - skew_s) < 1

    before = redis_ms(redis_client)
    if call == "apply_delayed":
        result = app.tasks["tests.record"].apply_delayed((1,), countdown=1800)
    else:
        result = celery_zdelay.send_delayed(app, "tests.record", args=(1,), countdown=1800)
    after = redis_ms(redis_client)
    assert before + 1_800_000 <= _due_ms(redis_client, result.id) <= after + 1_800_000


def test_the_app_timezone_does_not_change_the_instant(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = make_test_app(conf={"timezone": "America/New_York", "enable_utc": False})
    eta = datetime(2031, 5, 6, 7, 8, 9, tzinfo=timezone.utc)
    result = app.tasks["tests.record"].apply_delayed((1,), eta=eta)
    assert _due_ms(redis_client, result.id) == int(eta.timestamp() * 1000)
