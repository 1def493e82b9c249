"""Keys: one parked task per business key, whatever the number of producers.

Each story parks through real producers (threads, processes) into a private
Redis and releases through real companions and workers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

import celery_zdelay
from celery_zdelay import ConfigurationError
from celery_zdelay.companion import Companion
from celery_zdelay.keys import task_id_for
from celery_zdelay.parking import store_for
from celery_zdelay.store.marks import check_marks, key_owner, tagged_ids
from celery_zdelay.store.redis_keys import shard_of
from celery_zdelay.testing import RedisServer
from tests.helpers import ROOT, CeleryProcess, Runs, wait_for
from tests.project import app_env
from tests.support.clock import redis_ms
from tests.support.keys import SHARD0, keys_of

pytestmark = pytest.mark.timeout(120)

MODES = ("keep", "replace", "debounce", "until_finished")


def _release(app: Celery) -> int:
    with Companion(app) as companion:
        return companion.release_due().released


def _parked(client: redis.Redis, shards: int = 1) -> int:
    return sum(int(client.zcard(keys_of(s).due)) for s in range(shards))


def _index_is_exact(app: Celery) -> None:
    assert check_marks(store_for(app)) == []


# -- the modes -----------------------------------------------------------------------


def test_keep_parks_nothing_when_the_key_is_taken_and_returns_the_parked_task(
    app: Celery, redis_client: redis.Redis
) -> None:
    record = app.tasks["tests.record"]
    first = record.apply_delayed(("first",), countdown=3600, key="reminder:7")
    second = record.apply_delayed(("second",), countdown=10, key="reminder:7", on_key="keep")

    assert second.id == first.id
    assert _parked(redis_client) == 1
    found = celery_zdelay.lookup(first.id, app=app)
    assert found is not None
    assert found.key == "reminder:7"
    assert found.on_key == "keep"
    _index_is_exact(app)


def test_replace_cancels_the_parked_task_and_parks_the_new_one(
    app: Celery, redis_client: redis.Redis
) -> None:
    record = app.tasks["tests.record"]
    first = record.apply_delayed(("first",), countdown=3600, key="k", tags=["a"])
    second = record.apply_delayed(("second",), countdown=0, key="k", on_key="replace")

    assert second.id != first.id
    assert celery_zdelay.lookup(first.id, app=app) is None
    assert celery_zdelay.cancel_matching(tag="a", dry_run=True, app=app) == 0
    assert _release(app) == 1
    (raw,) = redis_client.lrange("celery", 0, -1)
    assert json.loads(raw)["headers"]["argsrepr"] == "('second',)"
    _index_is_exact(app)


def test_a_released_key_is_free_again(app: Celery) -> None:
    record = app.tasks["tests.record"]
    first = record.apply_delayed((1,), countdown=0, key="once")
    assert _release(app) == 1

    again = record.apply_delayed((2,), countdown=3600, key="once")

    assert again.id != first.id
    assert key_owner(store_for(app), "once") == (again.id, None)
    _index_is_exact(app)


def test_a_cancelled_keyed_task_frees_its_key(app: Celery) -> None:
    record = app.tasks["tests.record"]
    first = record.apply_delayed((1,), countdown=3600, key="k")
    assert celery_zdelay.cancel(first.id, app=app) is True
    assert key_owner(store_for(app), "k") is None

    assert record.apply_delayed((2,), countdown=3600, key="k").id != first.id


def test_debounce_releases_once_the_countdown_after_the_last_call(
    app: Celery, worker: Callable[..., CeleryProcess], runs: Runs, redis_client: redis.Redis
) -> None:
    worker(app)
    record = app.tasks["tests.record"]
    results = []
    for n in range(5):
        # Read before the call: the last call's due time is at least this
        # plus the countdown (read after it, a loaded machine's gap between
        # the park and the read would make a release on time look early).
        last_call_ms = redis_ms(redis_client)
        results.append(record.apply_delayed((n,), countdown=1.5, key="typing", on_key="debounce"))

    with Companion(app) as companion:
        wait_for(lambda: companion.release_due().released or runs.count(), timeout=30)
    (run,) = runs.wait_for_count(1)
    assert run["args"] == [4]
    assert run["id"] == results[-1].id
    assert run["redis_ms"] >= last_call_ms + 1500
    assert _parked(redis_client) == 0
    _index_is_exact(app)


# -- many producers ------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_threads_parking_one_key_leave_exactly_one_entry(
    app: Celery, redis_client: redis.Redis, mode: str
) -> None:
    record = app.tasks["tests.record"]
    returned: list[str] = []
    start = threading.Barrier(16)

    def produce(n: int) -> None:
        start.wait()
        for i in range(10):
            result = record.apply_delayed((n, i), countdown=3600, key="hot", on_key=mode)
            returned.append(result.id)

    threads = [threading.Thread(target=produce, args=(n,)) for n in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    assert _parked(redis_client) == 1
    (parked,) = redis_client.zrange(SHARD0.due, 0, -1)
    assert key_owner(store_for(app), "hot") == (parked.decode(), None)
    if mode in ("keep", "until_finished"):
        assert set(returned) == {parked.decode()}
    _index_is_exact(app)


_PRODUCER = """
import sys
from tests.project import app_from_env
app = app_from_env()
record = app.tasks["tests.record"]
for i in range(int(sys.argv[2])):
    print(record.apply_delayed((i,), countdown=3600, key="hot", on_key=sys.argv[1]).id)
"""


@pytest.mark.parametrize("mode", MODES)
def test_processes_parking_one_key_leave_exactly_one_entry(
    app: Celery, redis_client: redis.Redis, mode: str
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **app_env(app)}
    producers = [
        subprocess.Popen(
            [sys.executable, "-c", _PRODUCER, mode, "25"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(4)
    ]
    returned: set[str] = set()
    for producer in producers:
        out, err = producer.communicate(timeout=90)
        assert producer.returncode == 0, err.decode()[-2000:]
        returned |= set(out.decode().split())

    assert _parked(redis_client) == 1
    (parked,) = redis_client.zrange(SHARD0.due, 0, -1)
    if mode in ("keep", "until_finished"):
        assert returned == {parked.decode()}
    _index_is_exact(app)


# -- until_finished ------------------------------------------------------------------


@pytest.mark.parametrize("path", ["handoff", "generic"])
def test_until_finished_keeps_the_key_while_the_task_runs_and_frees_the_key_after(
    make_test_app: Callable[..., Celery],
    broker_server: RedisServer,
    worker: Callable[..., CeleryProcess],
    runs: Runs,
    path: str,
) -> None:
    # The generic path acknowledges the release in ack.lua, the handoff in handoff.lua
    app = make_test_app(broker=f"{broker_server.url}/0" if path == "generic" else None)
    worker(app)
    slow = app.tasks["tests.slow_late"]
    first = slow.apply_delayed((2.0,), countdown=0, key="import:7", on_key="until_finished")
    assert _release(app) == 1
    wait_for(lambda: any(r["result"] == "started" for r in runs.all()), timeout=30)

    # Running: a second call parks nothing and gets the running task.
    assert slow.apply_delayed((0,), countdown=0, key="import:7", on_key="until_finished").id == (
        first.id
    )
    wait_for(lambda: any(r["result"] == "finished" for r in runs.all()), timeout=30)
    wait_for(lambda: key_owner(store_for(app), "import:7") is None, timeout=10)

    after = slow.apply_delayed((0,), countdown=3600, key="import:7", on_key="until_finished")
    assert after.id != first.id
    _index_is_exact(app)


def test_until_finished_keeps_its_key_through_a_parked_retry_and_frees_it_after_the_last_run(
    make_test_app: Callable[..., Celery],
    worker: Callable[..., CeleryProcess],
    companion: Callable[..., CeleryProcess],
    runs: Runs,
) -> None:
    # Given transparent mode, so that Celery's retry(countdown=2) is parked too
    app = make_test_app(conf={"zdelay_threshold": 1})
    worker(app)
    companion(app)
    task = app.tasks["tests.retry_once"]

    # When an until_finished task retries once, under its own id
    first = task.apply_delayed((2,), countdown=0, key="import:7", on_key="until_finished")

    # Then the retry is parked (not taken for a second call of a taken key) and runs
    done = runs.wait_for_count(2, timeout=30)
    assert [(r["id"], r["result"]) for r in done] == [(first.id, 0), (first.id, 1)]
    # And the key is taken until that last run ended, then free
    wait_for(lambda: key_owner(store_for(app), "import:7") is None, timeout=10)
    _index_is_exact(app)


def test_until_finished_frees_the_key_of_a_killed_worker_within_its_bound(
    make_test_app: Callable[..., Celery], worker: Callable[..., CeleryProcess], runs: Runs
) -> None:
    app = make_test_app(conf={"zdelay_max_run_seconds": 3})
    running = worker(app)
    slow = app.tasks["tests.slow_late"]
    first = slow.apply_delayed((60,), countdown=0, key="k", on_key="until_finished")
    assert _release(app) == 1
    wait_for(lambda: any(r["result"] == "started" for r in runs.all()), timeout=30)
    running.kill()

    assert slow.apply_delayed((0,), countdown=3600, key="k", on_key="until_finished").id == (
        first.id
    )
    # Taken for at most zdelay_max_run_seconds after the release, then free.
    second = wait_for(
        lambda: (
            r
            if (r := slow.apply_delayed((0,), countdown=3600, key="k", on_key="until_finished")).id
            != first.id
            else None
        ),
        timeout=15,
        interval=0.2,
    )
    assert key_owner(store_for(app), "k") == (second.id, None)


# -- shards ----------------------------------------------------------------------------


def test_on_four_shards_a_keyed_task_lives_on_its_keys_shard_and_is_found_by_id(
    make_test_app: Callable[..., Celery], redis_client: redis.Redis
) -> None:
    app = make_test_app(conf={"zdelay_shards": 4})
    record = app.tasks["tests.record"]
    results = {key: record.apply_delayed((key,), countdown=3600, key=key) for key in "abcdefgh"}

    for key, result in results.items():
        assert shard_of(result.id, 4) == shard_of(key, 4)
        found = celery_zdelay.lookup(result.id, app=app)
        assert found is not None
        assert found.key == key
    assert _parked(redis_client, 4) == 8
    assert all(celery_zdelay.cancel(r.id, app=app) for r in results.values())
    _index_is_exact(app)


def test_a_task_id_off_its_keys_shard_is_refused(make_test_app: Callable[..., Celery]) -> None:
    app = make_test_app(conf={"zdelay_shards": 4})
    record = app.tasks["tests.record"]
    off = next(f"id-{n}" for n in range(100) if shard_of(f"id-{n}", 4) != shard_of("k", 4))

    with pytest.raises(ConfigurationError, match="different shards"):
        record.apply_delayed((1,), countdown=60, key="k", task_id=off)
    on = task_id_for("k", 4)
    assert record.apply_delayed((1,), countdown=60, key="k", task_id=on).id == on


def test_apply_delayed_many_with_keys_parks_one_per_key(
    make_test_app: Callable[..., Celery], redis_client: redis.Redis
) -> None:
    app = make_test_app(conf={"zdelay_shards": 4})
    record = app.tasks["tests.record"]
    kept = record.apply_delayed(("kept",), countdown=3600, key="b")

    results = record.apply_delayed_many(
        [(1,), (2,), (3,), (4,)], countdown=3600, keys=["a", "b", None, "a"], tags=["batch"]
    )

    assert results[1].id == kept.id
    assert results[0].id == results[3].id  # keep: the first of the batch owns "a"
    assert _parked(redis_client, 4) == 3
    assert celery_zdelay.cancel_matching(tag="batch", dry_run=True, app=app) == 2
    _index_is_exact(app)


@pytest.mark.parametrize("mode", ["replace", "debounce"])
def test_apply_delayed_many_takes_one_on_key_for_its_keys(
    make_test_app: Callable[..., Celery], redis_client: redis.Redis, mode: str
) -> None:
    # Given a task parked under "b", and a batch whose calls 1 and 4 share "a"
    app = make_test_app(conf={"zdelay_shards": 4})
    record = app.tasks["tests.record"]
    kept = record.apply_delayed(("kept",), countdown=3600, key="b")

    # When the batch is parked with on_key= for every call
    results = record.apply_delayed_many(
        [(1,), (2,), (3,), (4,)], countdown=3600, keys=["a", "b", None, "a"], on_key=mode
    )

    # Then the last call of "a" owns it, "b" is replaced, and "a" and "b" say so
    assert results[0].id == results[3].id
    assert celery_zdelay.lookup(kept.id, app=app) is None
    found = celery_zdelay.lookup(results[1].id, app=app)
    assert found is not None
    assert (found.key, found.on_key) == ("b", mode)
    assert _parked(redis_client, 4) == 3
    _index_is_exact(app)


@pytest.mark.parametrize("mode", MODES)
def test_threads_parking_the_same_keys_with_apply_delayed_many_leave_one_entry_per_key(
    make_test_app: Callable[..., Celery], redis_client: redis.Redis, mode: str
) -> None:
    # Given 8 threads, each parking batches of 6 calls over keys k0..k2, on 4 shards
    app = make_test_app(conf={"zdelay_shards": 4})
    record = app.tasks["tests.record"]
    start = threading.Barrier(8)
    failures: list[BaseException] = []

    def produce(n: int) -> None:
        start.wait()
        try:
            for i in range(10):
                record.apply_delayed_many(
                    [(n, i, j) for j in range(6)],
                    countdown=3600,
                    keys=[f"k{j % 3}" for j in range(6)],
                    on_key=mode,
                    tags=["batch"],
                )
        except BaseException as exc:  # reported below, not lost in the thread
            failures.append(exc)

    threads = [threading.Thread(target=produce, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    # Then each key has exactly one entry, found by its tag too
    assert failures == []
    assert _parked(redis_client, 4) == 3
    owners = {key_owner(store_for(app), f"k{j}") for j in range(3)}
    assert len(owners) == 3
    assert sorted(tagged_ids(store_for(app), "batch")) == sorted(h[0] for h in owners if h)
    _index_is_exact(app)


def test_transparent_mode_takes_key_and_tags_from_headers(
    make_test_app: Callable[..., Celery], redis_client: redis.Redis
) -> None:
    app = make_test_app(conf={"zdelay_threshold": 60})
    record = app.tasks["tests.record"]
    first = record.apply_async(
        (1,), countdown=3600, headers={"zdelay_key": "t", "zdelay_tags": ["x"]}
    )
    record.apply_async((2,), countdown=3600, headers={"zdelay_key": "t"})

    assert _parked(redis_client) == 1
    found = celery_zdelay.lookup(first.id, app=app)
    assert found is not None
    assert found.key == "t"
    assert found.tags == ("x",)


# -- bad input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"key": ""}, "empty"),
        ({"key": "x" * 201}, "more than 200"),
        ({"key": 7}, "must be a string"),
        ({"key": "a\nb"}, "control character"),
        ({"key": "k", "on_key": "sometimes"}, "not a mode"),
        ({"on_key": "keep"}, "needs key"),
        ({"tags": "order:42"}, "list of strings"),
        ({"tags": ["ok", ""]}, "empty"),
        ({"tags": [None]}, "tag= must be a string such as 'order:42'"),
        ({"key": b"k"}, "must be a string"),
        ({"key": "k", "on_key": ""}, "not a mode"),
        ({"key": "k", "on_key": ["keep"]}, "not a mode"),
        ({"tags": 7}, "list of strings"),
        ({"tags": [b"order:42"]}, "must be a string"),
        ({"tags": ["x" * 201]}, "more than 200"),
        ({"tags": [f"t{n}" for n in range(33)]}, "more than 32"),
    ],
)
def test_a_bad_key_tag_or_mode_is_refused_and_nothing_is_parked(
    app: Celery, redis_client: redis.Redis, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        app.tasks["tests.record"].apply_delayed((1,), countdown=60, **options)
    with pytest.raises(ConfigurationError, match=message):
        celery_zdelay.send_delayed(app, "tests.record", (1,), countdown=60, **options)
    assert _parked(redis_client) == 0
    assert redis_client.exists(SHARD0.marks, SHARD0.tagged) == 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"keys": ["a", "b", ""]}, "empty"),
        ({"keys": ["a", "b", 3]}, "must be a string"),
        ({"keys": ["a", "b"]}, "one key .or None. per call"),
        ({"keys": ["a", "b", "c"], "on_key": "sometimes"}, "not a mode"),
        ({"on_key": "replace"}, "pass keys="),
        ({"tags": ["ok", 3]}, "must be a string"),
    ],
)
def test_apply_delayed_many_with_one_bad_key_or_tag_parks_none_of_its_calls(
    app: Celery, redis_client: redis.Redis, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        app.tasks["tests.record"].apply_delayed_many([(1,), (2,), (3,)], countdown=60, **options)
    assert _parked(redis_client) == 0
    assert redis_client.exists(SHARD0.marks, SHARD0.tagged) == 0


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({"zdelay_key": ""}, "empty"),
        ({"zdelay_key": 5}, "must be a string"),
        ({"zdelay_key": "k", "zdelay_on_key": "sometimes"}, "not a mode"),
        ({"zdelay_on_key": "replace"}, "needs a zdelay_key header"),
        ({"zdelay_tags": "order:42"}, "list of strings"),
    ],
)
def test_transparent_mode_refuses_bad_key_headers_and_parks_and_sends_nothing(
    make_test_app: Callable[..., Celery],
    redis_client: redis.Redis,
    headers: dict[str, Any],
    message: str,
) -> None:
    app = make_test_app(conf={"zdelay_threshold": 60})
    with pytest.raises(ConfigurationError, match=message):
        app.tasks["tests.record"].apply_async((1,), countdown=3600, headers=headers)
    assert _parked(redis_client) == 0
    assert redis_client.llen("celery") == 0
    assert redis_client.exists(SHARD0.marks, SHARD0.tagged) == 0


def test_unkeyed_untagged_parks_leave_no_index(app: Celery, redis_client: redis.Redis) -> None:
    app.tasks["tests.record"].apply_delayed((1,), countdown=60)
    assert _release(app) == 0
    assert redis_client.exists(SHARD0.marks, SHARD0.tagged) == 0


def test_a_forged_key_cannot_make_replace_cancel_a_signed_entry_parked_under_another_key(
    make_test_app: Callable[..., Celery], redis_client: redis.Redis
) -> None:
    app = make_test_app(conf={"zdelay_signing_key": "s" * 32})
    record = app.tasks["tests.record"]
    victim = record.apply_delayed(("victim",), countdown=3600, key="invoice:1")
    # Someone with write access to Redis points key "promo" at the victim
    redis_client.hset(SHARD0.marks, "k:promo", victim.id)

    kept = record.apply_delayed(("promo",), countdown=3600, key="promo", on_key="keep")
    replaced = record.apply_delayed(("promo",), countdown=3600, key="promo", on_key="replace")

    assert victim.id not in (kept.id, replaced.id)
    found = celery_zdelay.lookup(victim.id, app=app)
    assert found is not None
    assert found.key == "invoice:1"
    assert _parked(redis_client) == 2


def test_a_forged_running_owner_cannot_make_keep_return_a_signed_entry(
    make_test_app: Callable[..., Celery], redis_client: redis.Redis
) -> None:
    # Given a signed entry parked under "invoice:1"
    app = make_test_app(conf={"zdelay_signing_key": "s" * 32})
    record = app.tasks["tests.record"]
    victim = record.apply_delayed(("victim",), countdown=3600, key="invoice:1")
    # Someone with write access to Redis writes "promo" as owned by it, running for ever
    redis_client.hset(SHARD0.marks, "k:promo", f"{victim.id}\n99999999999999")

    # When a producer parks "promo"
    kept = record.apply_delayed(("promo",), countdown=3600, key="promo", on_key="keep")

    # Then it gets its own entry, not the victim, which keeps its own key
    assert kept.id != victim.id
    assert key_owner(store_for(app), "promo") == (kept.id, None)
    found = celery_zdelay.lookup(victim.id, app=app)
    assert found is not None
    assert found.key == "invoice:1"
    assert _parked(redis_client) == 2


def test_a_key_or_tags_on_a_canvas_are_refused(app: Celery, redis_client: redis.Redis) -> None:
    record = app.tasks["tests.record"]
    with pytest.raises(ConfigurationError, match="task's own call"):
        celery_zdelay.apply_delayed(record.s(1) | record.s(), countdown=60, key="k", app=app)
    with pytest.raises(ConfigurationError, match="task's own call"):
        celery_zdelay.apply_delayed(record.s(1), countdown=60, tags=["t"], app=app)
    assert _parked(redis_client) == 0


def test_producers_replacing_keys_while_a_companion_releases_leave_an_exact_index(
    make_test_app: Callable[..., Celery], redis_client: redis.Redis
) -> None:
    # Given 8 producer threads replacing and debouncing 10 keys, due at once,
    # while a companion releases in another thread
    app = make_test_app(conf={"zdelay_shards": 2})
    record = app.tasks["tests.record"]
    stop = threading.Event()
    released = 0

    def release() -> None:
        nonlocal released
        with Companion(app) as companion:
            while not stop.is_set():
                released += companion.release_due().released

    def produce(n: int) -> None:
        for i in range(60):
            mode = "replace" if (n + i) % 2 else "debounce"
            record.apply_delayed((n, i), countdown=0, key=f"k{i % 10}", on_key=mode, tags=["x"])

    releaser = threading.Thread(target=release)
    releaser.start()
    producers = [threading.Thread(target=produce, args=(n,)) for n in range(8)]
    for thread in producers:
        thread.start()
    for thread in producers:
        thread.join(timeout=90)

    # When the producers are done and everything due is released
    wait_for(lambda: _parked(redis_client, 2) == 0, timeout=60, message="all released")
    stop.set()
    releaser.join(timeout=30)

    # Then no key or tag is left pointing anywhere, and nothing ran twice
    _index_is_exact(app)
    assert all(redis_client.exists(keys_of(s).marks, keys_of(s).tagged) == 0 for s in range(2))
    assert 10 <= released <= 480
    assert redis_client.llen("celery") == released


def test_transparent_mode_with_shards_parks_a_key_only_under_an_id_on_its_shard(
    make_test_app: Callable[..., Celery], redis_client: redis.Redis
) -> None:
    app = make_test_app(conf={"zdelay_threshold": 60, "zdelay_shards": 4})
    record = app.tasks["tests.record"]
    off = next(f"id-{n}" for n in range(100) if shard_of(f"id-{n}", 4) != shard_of("t", 4))

    with pytest.raises(ConfigurationError, match="different shards"):
        record.apply_async((1,), countdown=3600, task_id=off, headers={"zdelay_key": "t"})
    assert _parked(redis_client, 4) == 0
    on = task_id_for("t", 4)
    parked = record.apply_async((1,), countdown=3600, task_id=on, headers={"zdelay_key": "t"})
    assert parked.id == on
    assert _parked(redis_client, 4) == 1
