"""``zdelay adopt --redis-plus``: the tasks waiting in celery-redis-plus, adopted once each.

Issue 35 ("Moving over from them, finished"): a project moving off
celery-redis-plus (a kombu transport keeping delayed messages in a sorted
set of the broker's Redis, handed to a worker a minute before they are due)
runs one command, and each task still waiting there becomes a parked task,
under its id, with its args and headers, due when it was due.

The messages are sent by the real celery-redis-plus, in its Python 3.13
virtualenv (:mod:`tests.support.redis_plus`), into the test's private Redis;
the app adopting them runs kombu's own Redis transport on the same database,
as a project does once it moved off.

Mutants these tests kill (each a one-line change of celery_zdelay, tried):

- ``redis_plus.py`` ``read``: the index score taken as milliseconds
  (``round(float(next_s))``) -> the held message's return time is 1000x
  off (test 3);
- ``redis_plus.py`` ``read``: ``waiting`` as ``queued is not None`` alone
  -> the delayed messages count as held by a consumer, none adopted (test 1);
- ``redis_plus.py`` ``_message_of``: the body not base64-decoded -> the
  released body is not Celery's (test 2);
- ``redis_plus.py`` ``consumers`` returning 0 -> adopt runs beside a worker
  of celery-redis-plus (test 5);
- ``redis_plus_take.lua``: ``~= '1'`` as ``~= '0'`` -> the delayed messages
  stay in celery-redis-plus, and a held one would go (tests 1 and 3);
- ``adoption.py`` ``_TRANSPORT_PROPERTIES`` without ``"eta"`` -> the
  released message keeps celery-redis-plus's ``eta`` property (test 2);
- ``adoption.py`` ``_RedisPlusRun._acknowledge`` returning ``[]`` -> a
  message a consumer took keeps its parked copy too: it runs twice (test 4);
- ``adoption.py`` ``_withdraw`` without ``forget(...)`` -> given back by a
  dead consumer, the message is dropped as a copy adopted before (test 4);
- ``adoption.py`` ``_refuse_if_redis_plus_consumed``: ``if waiting`` as
  ``if False`` (test 5).

The never-early promise is pinned by test 2 (due at the eta to the
millisecond, read from the message) and test 1 (each run at or after it).
``redis_plus_take.lua`` without its ``EXISTS`` line (a message whose hash
expired by celery-redis-plus's message TTL while adopt parked it) is killed
by ``tests/test_redis_plus_waiting_messages.py``.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection, Queue

import celery_zdelay
from celery_zdelay.adoption import TAKEN_MEANWHILE, adopt
from celery_zdelay.cli import EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE
from celery_zdelay.companion import Companion
from celery_zdelay.parking import store_for
from celery_zdelay.schedule import due_from
from celery_zdelay.testing import RedisServer
from tests.conftest import BROKER_DB
from tests.helpers import CeleryProcess, Runs, wait_for
from tests.support.cli import run
from tests.support.redis_plus import hand_over, redis_plus_python, send

pytestmark = pytest.mark.timeout(90)

#: Seconds back that celery-redis-plus's clock is set when a task is sent
#: (tests/support/redis_plus_send.py): more than its hand-over minute, so a
#: countdown of a few seconds waits in its delayed set.
AGO_S = 70


@pytest.fixture
def broker(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """The broker's database, where celery-redis-plus keeps its keys."""
    client = redis_server.client(BROKER_DB)
    yield client
    client.close()


def _adopt(app: Celery, *args: str) -> dict[str, Any]:
    result = run(app, "adopt", "--redis-plus", "--json", *args)
    assert result.exit_code == EXIT_OK, result.output
    (report,) = json.loads(result.stdout)["queues"]
    assert report["queue"] == "messages_index:celery"
    return dict(report)


def _plus_keys(broker: redis.Redis) -> set[str]:
    return {k.decode() for k in broker.scan_iter() if k.decode().startswith(("message", "queue:"))}


def test_every_waiting_task_is_parked_once_and_runs_once_at_its_eta(
    app: Celery,
    broker: redis.Redis,
    worker: Callable[..., CeleryProcess],
    companion: Callable[..., CeleryProcess],
    runs: Runs,
) -> None:
    # Given, sent through celery-redis-plus: two tasks waiting in its delayed
    # set (a countdown of 12 and 14 s, sent "70 s ago"), one in its queue with
    # an eta 13 s ahead (a countdown under its minute), and one with none
    # (seconds enough for the sends and the dry run on a loaded machine:
    # with 4 to 6 s an eta passed before adopt ran, at a load of 20)
    url = app.conf.broker_url
    delayed = send(
        url, [{"args": [i], "countdown": c, "sent_ago": AGO_S} for i, c in ((1, 12), (2, 14))]
    )
    (queued,) = send(url, [{"args": [3], "countdown": 13}])
    (at_once,) = send(url, [{"args": [4]}])
    before = _plus_keys(broker)
    assert broker.zcard("messages_index:celery") == 4
    assert broker.zcard("queue:celery") == 2

    # When a dry run counts them (changing nothing), then adopt moves them
    dry = _adopt(app, "--dry-run")
    assert (dry["adopted"], dry["put_back"]) == (3, {"no_eta": 1})
    assert _plus_keys(broker) == before
    report = _adopt(app)

    # Then the three with an eta are parked under their ids, due at their
    # eta to the millisecond; the one without is left to celery-redis-plus
    assert (report["waiting"], report["adopted"], report["put_back"]) == (4, 3, {"no_eta": 1})
    adopted = [*delayed, queued]
    due = {}
    for task_id in adopted:
        parked = celery_zdelay.lookup(task_id, app=app)
        assert parked is not None, task_id
        due[task_id] = parked.due_ms
    assert broker.zcard("messages_index:celery") == 1
    assert broker.zrange("queue:celery", 0, -1) == broker.zrange("messages_index:celery", 0, -1)
    # And a second run finds nothing more to adopt
    again = _adopt(app)
    assert (again["adopted"], again["adopted_before"]) == (0, 0)

    # When a companion and a worker of kombu's Redis transport run
    # (celery-redis-plus keeps the exchange's bindings as a sorted set,
    # kombu as a set: moving off, its binding keys go, docs/migrating.rst)
    for key in broker.scan_iter("_kombu.binding.*"):
        broker.delete(key)
    worker(app)
    companion(app)

    # Then each adopted task runs once, with its args, never before its eta
    ran = runs.wait_for_ids(set(adopted), stall_timeout=30)
    assert Counter(ran) == Counter(adopted)
    by_id = runs.by_id()
    for task_id, args in zip(adopted, ([1], [2], [3]), strict=True):
        record = by_id[task_id]
        assert record["args"] == args
        assert record["redis_ms"] >= due[task_id], (task_id, record["redis_ms"] - due[task_id])
        assert record["eta"] is not None  # the task still sees its ETA
    assert at_once not in by_id


def test_the_parked_message_is_the_one_celery_sent_due_at_its_eta(
    app: Celery, broker: redis.Redis
) -> None:
    # Given a task delayed an hour in celery-redis-plus's sorted set
    (task_id,) = send(app.conf.broker_url, [{"args": [7], "countdown": 3600}])
    (tag,) = broker.zrange("messages_index:celery", 0, -1)
    stored = broker.hgetall(b"message:" + tag)
    payload = json.loads(stored[b"payload"])
    eta_ms = due_from(eta=payload["headers"]["eta"]).ms
    # (its score and its eta field are epoch seconds, a float)
    assert abs(broker.zscore("messages_index:celery", tag) * 1000 - eta_ms) < 1

    # When adopt takes it
    assert _adopt(app)["adopted"] == 1

    # Then it is parked due at its eta, to the millisecond, not a minute
    # earlier (when celery-redis-plus would hand it over) nor 1000x off
    parked = celery_zdelay.lookup(task_id, app=app)
    assert parked is not None
    assert parked.due_ms == eta_ms
    assert not broker.exists(b"message:" + tag)

    # And released, it is Celery's message: its id, args and headers, the
    # eta in zdelay_eta, none of celery-redis-plus's properties
    assert celery_zdelay.reschedule(task_id, countdown=0, app=app)
    with Companion(app, store=store_for(app)) as companion:
        assert companion.release_due().released == 1
    with Connection(app.conf.broker_url) as connection:
        bound = Queue("celery").bind(connection.default_channel)
        message = wait_for(lambda: bound.get(no_ack=True), timeout=10, message="released")
    assert message.headers["id"] == task_id
    assert message.headers["zdelay_eta"] == payload["headers"]["eta"]
    assert message.headers["eta"] is None
    assert {k: v for k, v in message.headers.items() if k not in ("eta", "zdelay_eta")} == {
        k: v for k, v in payload["headers"].items() if k != "eta"
    }
    assert "eta" not in message.properties
    assert json.loads(message.body)[0] == [7]


def test_a_message_a_consumer_holds_is_left_to_it_and_reported(
    app: Celery, broker: redis.Redis
) -> None:
    # Given two delayed tasks, the first of which a worker of
    # celery-redis-plus took (its own sweep and consume scripts: handed over
    # ahead of its eta, held with a deadline 300 s away)
    ids = send(app.conf.broker_url, [{"args": [i], "countdown": 3600} for i in (1, 2)])
    first, _ = broker.zrange("messages_index:celery", 0, -1, withscores=True)
    popped = hand_over(broker, "celery", up_to_s=first[1])
    assert popped == first[0]
    back_s = broker.zscore("messages_index:celery", popped)

    # When adopt runs
    (report,) = adopt(app, [], redis_plus=True).queues

    # Then the other is adopted; the popped one stays with its consumer,
    # reported with the time celery-redis-plus gives it back
    assert (report.adopted, report.unacked) == (1, 1)
    assert report.unacked_back_ms is not None
    assert abs(report.unacked_back_ms - back_s * 1000) < 1
    assert celery_zdelay.lookup(ids[0], app=app) is None
    assert celery_zdelay.lookup(ids[1], app=app) is not None
    assert broker.zrange("messages_index:celery", 0, -1) == [popped]
    assert broker.exists(b"message:" + popped)


def test_a_message_a_consumer_takes_while_it_is_parked_is_left_to_it_and_withdrawn(
    app: Celery, broker: redis.Redis
) -> None:
    # Given a delayed task, and a worker of celery-redis-plus that takes it
    # right after adopt parked it, before adopt takes it out (the receiver of
    # tasks_parked runs in that gap)
    (task_id,) = send(app.conf.broker_url, [{"args": [1], "countdown": 3600}])
    (tag,) = broker.zrange("messages_index:celery", 0, -1)

    def take(**_: Any) -> None:
        assert hand_over(broker, "celery", up_to_s=time.time() + 7200) == tag

    # When adopt runs
    celery_zdelay.signals.tasks_parked.connect(take, weak=False)
    try:
        (report,) = adopt(app, [], redis_plus=True).queues
    finally:
        celery_zdelay.signals.tasks_parked.disconnect(take)

    # Then the worker keeps it, and its parked copy is withdrawn: it runs once
    assert (report.adopted, dict(report.put_back)) == (0, {TAKEN_MEANWHILE: 1})
    assert celery_zdelay.lookup(task_id, app=app) is None
    assert broker.exists(b"message:" + tag)

    # And should that worker die, celery-redis-plus gives the message back to
    # its queue, and a next run adopts it (not dropped as a copy adopted before)
    broker.zadd("messages_index:celery", {tag: 0})
    hand_over_back = broker.register_script("return redis.call('ZADD', KEYS[1], 0, ARGV[1])")
    hand_over_back(keys=["queue:celery"], args=[tag])
    assert _adopt(app)["adopted"] == 1
    assert celery_zdelay.lookup(task_id, app=app) is not None


def test_adopt_refuses_while_a_worker_of_celery_redis_plus_waits_for_messages(
    app: Celery, broker: redis.Redis
) -> None:
    # Given a task delayed in celery-redis-plus, and its worker running
    (task_id,) = send(app.conf.broker_url, [{"args": [1], "countdown": 3600}])
    plus_worker = subprocess.Popen(
        [
            redis_plus_python(),
            "-c",
            "import sys; from celery import Celery; "
            "app = Celery('plus', broker=sys.argv[1]); "
            "app.conf.broker_transport = 'celery_redis_plus.transport:Transport'; "
            "app.worker_main(['worker', '-P', 'solo', '--without-gossip', '--without-mingle', "
            "'-l', 'WARNING'])",
            app.conf.broker_url,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(
            lambda: any(c.get("cmd") == "bzmpop" for c in broker.client_list()),
            timeout=30,
            message="celery-redis-plus's worker waiting in BZMPOP",
        )
        # When adopt runs, then it refuses, says why and what to do, takes nothing
        refused = run(app, "adopt", "--redis-plus")
        assert refused.exit_code == EXIT_CHECK_FAILED, refused.output
        assert "BZMPOP" in refused.stderr
        assert "Stop those workers" in refused.stderr
        assert celery_zdelay.lookup(task_id, app=app) is None
        assert broker.zcard("messages_index:celery") == 1
    finally:
        plus_worker.terminate()
        plus_worker.wait(timeout=30)

    # And with the worker stopped, it adopts the task
    assert _adopt(app)["adopted"] == 1


def test_a_broker_without_celery_redis_plus_is_refused_before_anything_is_taken(
    app: Celery,
) -> None:
    result = run(app, "adopt", "--redis-plus")
    assert result.exit_code == EXIT_USAGE
    assert "no queue of celery-redis-plus" in result.stderr
