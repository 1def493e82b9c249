"""``on_key="debounce", max_wait=``: a steady stream of calls no longer postpones the run for ever.

Given debounce calls through the public API into a private Redis, each is
due at the sooner of its countdown (jitter included) and the burst's first
call + ``max_wait``, on the Redis clock; ``apply_delayed_many(keys=...)``
does the same per key; end to end, with a real companion and worker, a
stream of calls every 0.2 s runs the task once about ``max_wait`` after the
first call, while the stream goes on. A ``max_wait`` the call cannot honour
(no key, another mode, not a duration) is refused before anything is parked.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import redis
from celery import Celery

import celery_zdelay
from celery_zdelay import ConfigurationError, steering
from celery_zdelay.companion import Companion
from celery_zdelay.keys import max_wait_ms
from celery_zdelay.parking import store_for
from celery_zdelay.schedule import MAX_COUNTDOWN_S
from celery_zdelay.store.dead_reason import DeadReason
from celery_zdelay.store.headers import MAX_WAIT_HEADER
from celery_zdelay.store.marks import check_marks
from celery_zdelay.testing import RedisServer
from tests.helpers import CeleryProcess, Runs, wait_for
from tests.servers import LocalCluster
from tests.support.clock import redis_ms
from tests.support.keys import SHARD0

pytestmark = pytest.mark.timeout(120)

HOUR = 3600


def _due_ms(client: redis.Redis, task_id: str) -> int:
    score = client.zscore(SHARD0.due, task_id)
    assert score is not None, f"{task_id} is not parked"
    return int(score) // 1024


def _first_call_ms(client: redis.Redis, task_id: str) -> int:
    """The burst's first call recorded with *task_id* (its record's "f" field)."""
    record = client.hget(SHARD0.marks, "i:" + task_id)
    assert record is not None
    (first,) = [int(p[1:]) for p in record.decode().partition("\n")[0].split(" ") if p[0] == "f"]
    return first


def _nothing_written(client: redis.Redis) -> None:
    assert client.zcard(SHARD0.due) == client.hlen(SHARD0.msg) == 0
    assert client.exists(SHARD0.marks, SHARD0.tagged) == 0


# -- the cap through the API ----------------------------------------------------------------


def test_apply_delayed_debounce_is_due_at_the_first_call_plus_max_wait_at_the_latest(
    app: Celery, redis_client: redis.Redis
) -> None:
    record = app.tasks["tests.record"]
    before = redis_ms(redis_client)
    first = record.apply_delayed(
        (1,), countdown=HOUR, key="k", on_key="debounce", max_wait=2 * HOUR
    )
    started = _first_call_ms(redis_client, first.id)
    assert before <= started <= redis_ms(redis_client)
    # (the countdown is counted on this process's clock, the first call on
    # Redis's: the two round a millisecond apart; 1 ms over failed once)
    assert before + HOUR * 1000 <= _due_ms(redis_client, first.id) <= started + HOUR * 1000 + 1
    wait_for(lambda: redis_ms(redis_client) > started + 20, timeout=5, message="the clock")

    # The next call asks for 3 h from now: due at the first call + 2 h
    second = record.apply_delayed((2,), countdown=3 * HOUR, key="k", on_key="debounce")

    assert second.id != first.id
    assert celery_zdelay.lookup(first.id, app=app) is None
    assert _due_ms(redis_client, second.id) == started + 2 * HOUR * 1000
    found = celery_zdelay.lookup(second.id, app=app)
    assert found is not None
    assert (found.key, found.on_key, found.due_ms) == ("k", "debounce", started + 2 * HOUR * 1000)
    assert check_marks(store_for(app)) == []


def test_max_wait_takes_a_timedelta(app: Celery, redis_client: redis.Redis) -> None:
    parked = app.tasks["tests.record"].apply_delayed(
        (1,), countdown=HOUR, key="k", on_key="debounce", max_wait=timedelta(minutes=1)
    )
    assert _due_ms(redis_client, parked.id) == _first_call_ms(redis_client, parked.id) + 60_000


def test_apply_delayed_many_caps_each_keys_burst(app: Celery, redis_client: redis.Redis) -> None:
    record = app.tasks["tests.record"]
    first = record.apply_delayed_many(
        [(1,), (2,), (3,)], countdown=60, keys=["a", "b", None], on_key="debounce", max_wait=HOUR
    )
    started = {r.id: _first_call_ms(redis_client, r.id) for r in first[:2]}
    wait_for(
        lambda: redis_ms(redis_client) > max(started.values()) + 20, timeout=5, message="the clock"
    )

    again = record.apply_delayed_many(
        [(4,), (5,)], countdown=2 * HOUR, keys=["a", "b"], on_key="debounce", max_wait=HOUR
    )

    for before, after in zip(first[:2], again, strict=True):
        assert after.id != before.id
        assert _due_ms(redis_client, after.id) == started[before.id] + HOUR * 1000
    # The call without a key was parked as it asked, and its max_wait ignored.
    assert redis_client.hget(SHARD0.marks, "i:" + first[2].id) is None
    assert check_marks(store_for(app)) == []


def test_with_jitter_the_cap_still_holds_and_nothing_is_early_below_it(
    app: Celery, redis_client: redis.Redis
) -> None:
    record = app.tasks["tests.record"]
    before = redis_ms(redis_client)
    # A jitter of an hour over a cap of a minute: every draw past the cap is cut to it.
    parked = [
        record.apply_delayed(
            (n,), countdown=10, jitter=HOUR, key=f"k{n}", on_key="debounce", max_wait=60
        )
        for n in range(20)
    ]
    for result in parked:
        due = _due_ms(redis_client, result.id)
        started = _first_call_ms(redis_client, result.id)
        assert due <= started + 60_000
        assert due >= before + 10_000
    assert any(
        _due_ms(redis_client, r.id) == _first_call_ms(redis_client, r.id) + 60_000 for r in parked
    )


def test_a_burst_whose_task_is_held_by_a_pause_goes_on_and_its_cap_is_kept(
    make_test_app: Callable[..., Celery], redis_client: redis.Redis
) -> None:
    # Given a debounced task (max_wait 1 s) held behind a paused queue
    app = make_test_app(queues=[{"name": "celery"}, {"name": "emails"}])
    record = app.tasks["tests.record"]
    celery_zdelay.pause("queue:emails", app=app)
    first = record.apply_delayed(
        (1,), countdown=0, queue="emails", key="k", on_key="debounce", max_wait=1
    )
    started = _first_call_ms(redis_client, first.id)
    with Companion(app) as companion:
        companion.release_due()
    assert redis_client.zscore(SHARD0.due, first.id) is None  # held, not due
    wait_for(lambda: redis_ms(redis_client) > started + 1000, timeout=5, message="the cap")

    # When the next call asks for an hour, the burst's cap has passed
    second = record.apply_delayed((2,), countdown=HOUR, queue="emails", key="k", on_key="debounce")

    # Then it is due at the cap (at once), and the held one was taken out
    assert _due_ms(redis_client, second.id) == started + 1000
    assert celery_zdelay.lookup(first.id, app=app) is None
    assert check_marks(store_for(app)) == []


def test_a_requeued_dead_letter_keeps_its_burst(app: Celery, redis_client: redis.Redis) -> None:
    # Given a debounced task (max_wait 1 h) released, dead-lettered and requeued
    record = app.tasks["tests.record"]
    first = record.apply_delayed((1,), countdown=0, key="k", on_key="debounce", max_wait=HOUR)
    started = _first_call_ms(redis_client, first.id)
    store = store_for(app)
    claimed = store.claim(0, limit=10, lease_ms=HOUR * 1000)
    reason = DeadReason(reason="broker refused", due_ms=started, companion="c-test")
    assert store.dead_letter(0, claimed.token, [(first.id, reason)]) == 1
    assert steering.requeue_dead([first.id], app=app) == [True]
    assert _first_call_ms(redis_client, first.id) == started

    # When a debounce asks for two hours, its run is owed since the first call
    second = record.apply_delayed((2,), countdown=2 * HOUR, key="k", on_key="debounce")

    assert _due_ms(redis_client, second.id) == started + HOUR * 1000
    assert check_marks(store) == []


def test_bursts_are_capped_on_a_three_master_cluster(
    make_test_app: Callable[..., Celery], cluster: LocalCluster, broker_server: RedisServer
) -> None:
    # Given six shards on a Redis Cluster, a burst under each of twelve keys
    app = make_test_app(
        broker=f"{broker_server.url}/0",
        conf={"zdelay_redis_url": cluster.url, "zdelay_shards": 6},
    )
    store = store_for(app)
    assert store.cluster
    record = app.tasks["tests.record"]
    options: dict[str, Any] = {"on_key": "debounce", "max_wait": HOUR}
    keys = [f"k{n}" for n in range(12)]
    first = [
        record.apply_delayed((n,), countdown=60, key=key, **options) for n, key in enumerate(keys)
    ]

    # When each key gets a call asking for two hours (one bulk call across shards)
    again = record.apply_delayed_many(
        [(n,) for n in range(12)], countdown=2 * HOUR, keys=keys, **options
    )

    # Then each is due an hour after its burst's first call, read from its record
    for before, after in zip(first, again, strict=True):
        assert after.id != before.id
        marks = store.keys(store.shard_of(after.id)).marks
        head = store.client.hget(marks, "i:" + after.id).decode().partition("\n")[0]
        (started,) = [int(part[1:]) for part in head.split(" ") if part[0] == "f"]
        found = celery_zdelay.lookup(after.id, app=app)
        assert found is not None
        assert found.due_ms == started + HOUR * 1000
    assert check_marks(store) == []


# -- end to end -----------------------------------------------------------------------------


def test_a_stream_of_debounce_calls_runs_once_about_max_wait_after_the_first_call(
    app: Celery,
    worker: Callable[..., CeleryProcess],
    companion: Callable[..., CeleryProcess],
    runs: Runs,
    redis_client: redis.Redis,
) -> None:
    # Given a worker and a companion
    worker(app)
    companion(app)
    record = app.tasks["tests.record"]

    # When a call with countdown=1, max_wait=2 comes every 0.2 s, until the
    # task ran (at most 8 s: without the cap it would run only after the
    # stream ends, a second after its last call)
    first_call_ms = redis_ms(redis_client)
    results = []
    stream_ends = time.monotonic() + 8
    while runs.count() == 0 and time.monotonic() < stream_ends:
        results.append(
            record.apply_delayed(
                (len(results),), countdown=1, key="typing", on_key="debounce", max_wait=2
            )
        )
        time.sleep(0.2)  # the stream's own pace, not a wait for anything
    last_call_ms = redis_ms(redis_client)

    # Then it ran no earlier than 2 s after the first call and soon after
    # that, while the calls went on
    run = min(runs.wait_for_count(1, timeout=10), key=lambda r: r["redis_ms"])
    assert run["redis_ms"] >= first_call_ms + 2000
    assert run["redis_ms"] <= first_call_ms + 2000 + 1500
    assert run["redis_ms"] <= last_call_ms
    # once for the burst: the call it ran is the burst's last, every call
    # before it was taken out (REVOKED), none of them ran
    (ran,) = run["args"]
    assert run["id"] == results[ran].id
    assert ran >= 5  # the calls of the first second at least were all debounced
    assert all(r.state == "REVOKED" for r in results[:ran])
    assert not {r["id"] for r in runs.all()} & {r.id for r in results[:ran]}
    assert check_marks(store_for(app)) == []


# -- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_wait": 60}, 'with key= and on_key="debounce" \\(got no key=\\)'),
        ({"key": "k", "max_wait": 60}, "on_key='keep'"),
        ({"key": "k", "on_key": "keep", "max_wait": 60}, "on_key='keep'"),
        ({"key": "k", "on_key": "replace", "max_wait": 60}, "on_key='replace'"),
        ({"key": "k", "on_key": "until_finished", "max_wait": 60}, "until_finished"),
        ({"key": "k", "on_key": "debounce", "max_wait": 0}, "from 0.001"),
        ({"key": "k", "on_key": "debounce", "max_wait": -5}, "from 0.001"),
        ({"key": "k", "on_key": "debounce", "max_wait": 0.0001}, "from 0.001"),
        ({"key": "k", "on_key": "debounce", "max_wait": "300"}, "number of seconds"),
        ({"key": "k", "on_key": "debounce", "max_wait": True}, "number of seconds"),
        ({"key": "k", "on_key": "debounce", "max_wait": math.nan}, "number of seconds"),
        ({"key": "k", "on_key": "debounce", "max_wait": math.inf}, "number of seconds"),
        ({"key": "k", "on_key": "debounce", "max_wait": MAX_COUNTDOWN_S + 1}, "number of seconds"),
        ({"key": "k", "on_key": "debounce", "max_wait": 10**400}, "number of seconds"),
        ({"key": "k", "on_key": "debounce", "max_wait": 10**5000}, "an integer of 16610 bits"),
        ({"key": "k", "on_key": "debounce", "max_wait": timedelta(0)}, "from 0.001"),
    ],
)
def test_apply_delayed_refuses_a_max_wait_it_cannot_honour_and_parks_nothing(
    app: Celery, redis_client: redis.Redis, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message) as caught:
        app.tasks["tests.record"].apply_delayed((1,), countdown=60, **options)
    assert "Nothing was written" in str(caught.value)
    _nothing_written(redis_client)


def test_a_bad_max_wait_is_refused_under_eager_too(make_test_app: Callable[..., Celery]) -> None:
    app = make_test_app(conf={"task_always_eager": True})
    with pytest.raises(ConfigurationError, match="on_key='replace'"):
        app.tasks["tests.record"].apply_delayed(
            (1,), countdown=60, key="k", on_key="replace", max_wait=60
        )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_wait": 60}, "pass keys="),
        ({"on_key": "debounce", "max_wait": 60}, "pass keys="),
        ({"keys": ["a", "b"], "on_key": "replace", "max_wait": 60}, "on_key='replace'"),
        ({"keys": [None, None], "on_key": "keep", "max_wait": 60}, "on_key='keep'"),
        ({"keys": ["a", "b"], "on_key": "debounce", "max_wait": -1}, "from 0.001"),
    ],
)
def test_apply_delayed_many_refuses_a_max_wait_it_cannot_honour_and_parks_nothing(
    app: Celery, redis_client: redis.Redis, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        app.tasks["tests.record"].apply_delayed_many([(1,), (2,)], countdown=60, **options)
    _nothing_written(redis_client)


def test_a_canvas_and_send_delayed_refuse_a_max_wait_without_a_debounced_key(
    app: Celery, redis_client: redis.Redis
) -> None:
    with pytest.raises(ConfigurationError, match="max_wait="):
        celery_zdelay.apply_delayed(app.tasks["tests.record"].s(1), countdown=60, max_wait=60)
    with pytest.raises(ConfigurationError, match="got no key="):
        celery_zdelay.send_delayed(app, "tests.record", (1,), countdown=60, max_wait=60)
    _nothing_written(redis_client)


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({MAX_WAIT_HEADER: 60_000}, "got no key="),
        ({"zdelay_key": "k", "zdelay_on_key": "replace", MAX_WAIT_HEADER: 60_000}, "replace"),
        ({"zdelay_key": "k", "zdelay_on_key": "debounce", MAX_WAIT_HEADER: "60s"}, "whole number"),
        ({"zdelay_key": "k", "zdelay_on_key": "debounce", MAX_WAIT_HEADER: 0}, "whole number"),
    ],
)
def test_transparent_mode_refuses_a_bad_max_wait_header_and_parks_nothing(
    make_test_app: Callable[..., Celery],
    redis_client: redis.Redis,
    headers: dict[str, Any],
    message: str,
) -> None:
    app = make_test_app(conf={"zdelay_threshold": 60})
    with pytest.raises(ConfigurationError, match=message):
        app.tasks["tests.record"].apply_async((1,), countdown=3600, headers=headers)
    _nothing_written(redis_client)
    assert redis_client.llen("celery") == 0


def test_transparent_mode_takes_max_wait_from_its_header(
    make_test_app: Callable[..., Celery], redis_client: redis.Redis
) -> None:
    app = make_test_app(conf={"zdelay_threshold": 60})
    headers = {"zdelay_key": "k", "zdelay_on_key": "debounce", MAX_WAIT_HEADER: 120_000}
    parked = app.tasks["tests.record"].apply_async((1,), countdown=3600, headers=headers)
    assert _due_ms(redis_client, parked.id) == _first_call_ms(redis_client, parked.id) + 120_000


@pytest.mark.parametrize(
    ("value", "expected"),
    [(300, 300_000), (0.001, 1), (1.0019, 1001), (timedelta(minutes=5), 300_000)],
)
def test_max_wait_is_whole_milliseconds_rounded_down(value: Any, expected: int) -> None:
    assert max_wait_ms(value) == expected
