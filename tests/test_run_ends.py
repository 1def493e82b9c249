"""Every end of a run frees the key it took: an ``until_finished`` key, or a schedule's overlap key.

Issue 33 item 4: Celery calls no ``after_return`` for ``Ignore``,
``Reject`` or a revoke, and the key stayed taken for
``zdelay_max_run_seconds`` (an hour by default): every call with the key
meanwhile parked nothing. Each story runs the task in a real worker (solo,
or prefork where a pool process must be terminated or lost), released by a
real companion step, against a private Redis.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import pytest
import redis
from celery import Celery

from celery_zdelay.companion import Companion
from celery_zdelay.parking import store_for
from celery_zdelay.periodic.overlap import overlap_key
from celery_zdelay.store.headers import OVERLAP_HEADER, SCHEDULE_HEADER
from celery_zdelay.store.marks import check_marks, key_owner
from tests.helpers import CeleryProcess, Runs, wait_for

pytestmark = pytest.mark.timeout(120)

END_BY = "tests.end_by"
KEY = "import:7"


def _release(app: Celery) -> int:
    with Companion(app) as companion:
        return companion.release_due().released


def _park_and_run(app: Celery, runs: Runs, how: str, seconds: float = 0) -> str:
    """Park ``tests.end_by(how)`` under KEY (until_finished), release it; return its id."""
    task = app.tasks[END_BY]
    first = task.apply_delayed((how, seconds), countdown=0, key=KEY, on_key="until_finished")
    assert _release(app) == 1
    wait_for(lambda: any(r["result"] == "started" for r in runs.all()), timeout=30)
    return str(first.id)


def _parks_a_new_task(app: Celery, held_by: str) -> bool:
    """Whether a call with KEY now parks a task of its own (the key is free)."""
    task = app.tasks[END_BY]
    again = task.apply_delayed(("return",), countdown=3600, key=KEY, on_key="until_finished")
    return again.id != held_by


@pytest.mark.parametrize("how", ["return", "fail", "ignore", "reject"])
def test_an_until_finished_key_is_free_once_its_run_ends_however_it_ends(
    app: Celery, worker: Callable[..., CeleryProcess], runs: Runs, how: str
) -> None:
    # Given a worker and the default max run of an hour
    worker(app)

    # When an until_finished task returns, fails, raises Ignore or Reject(requeue=False)
    first = _park_and_run(app, runs, how)
    wait_for(lambda: any(r["result"] == how for r in runs.all()), timeout=30)

    # Then its key is free at once, and the next call parks its own task
    wait_for(lambda: key_owner(store_for(app), KEY) is None, timeout=10)
    assert _parks_a_new_task(app, first)
    assert check_marks(store_for(app)) == []


def test_a_run_rejected_back_to_the_broker_keeps_the_key_until_the_run_after_it_ends(
    app: Celery, worker: Callable[..., CeleryProcess], runs: Runs
) -> None:
    # Given an acks_late task that gives its message back once (Reject(requeue=True))
    worker(app)
    first = _park_and_run(app, runs, "reject_once", 1.0)

    # When the broker delivers it again and it runs a second time, under its id
    wait_for(lambda: [r["result"] for r in runs.all()].count("started") == 2, timeout=30)

    # Then the key stayed with it meanwhile (the task is not finished)
    assert not _parks_a_new_task(app, first)
    # And it is free once that second run returned
    wait_for(lambda: [r["result"] for r in runs.all()].count("reject_once") == 2, timeout=30)
    wait_for(lambda: key_owner(store_for(app), KEY) is None, timeout=10)


def test_a_retry_sent_to_the_broker_keeps_the_key_until_its_last_run_ends(
    app: Celery, worker: Callable[..., CeleryProcess], runs: Runs
) -> None:
    # Given an until_finished task whose retry(countdown=3) goes to the broker
    # (no zdelay_threshold: the worker holds the retry's ETA itself)
    worker(app)
    task = app.tasks["tests.retry_once"]
    first = task.apply_delayed((3,), countdown=0, key=KEY, on_key="until_finished")
    assert _release(app) == 1
    runs.wait_for_count(1, timeout=30)

    # Then while the retry waits, the key stays with the task, every time we look
    def retried() -> bool:
        if runs.count() >= 2:
            return True
        owner = key_owner(store_for(app), KEY)
        assert owner is not None, "the key was freed while the retry waited"
        assert owner[0] == first.id
        return False

    wait_for(retried, timeout=30, interval=0.05)
    # And it is free after the last run
    wait_for(lambda: key_owner(store_for(app), KEY) is None, timeout=10)


def test_revoke_with_terminate_frees_the_key_of_the_run_it_ended(
    app: Celery, worker: Callable[..., CeleryProcess], runs: Runs
) -> None:
    # Given an until_finished task running in a prefork worker's pool process
    worker(app, pool="prefork")
    first = _park_and_run(app, runs, "return", 60)

    # When it is revoked with terminate=True
    app.control.revoke(first, terminate=True)

    # Then its key is free long before the hour of zdelay_max_run_seconds
    wait_for(lambda: key_owner(store_for(app), KEY) is None, timeout=20)
    assert _parks_a_new_task(app, first)
    assert app.AsyncResult(first).state == "REVOKED"


def test_a_task_revoked_before_it_ran_frees_its_key_when_the_worker_drops_it(
    app: Celery, worker: Callable[..., CeleryProcess], runs: Runs
) -> None:
    # Given a worker that was told to revoke a task id (Celery's revoke, not a cancel)
    running = worker(app)
    task = app.tasks[END_BY]
    first = task.apply_delayed(("return",), countdown=0, key=KEY, on_key="until_finished")
    replies = app.control.revoke(first.id, reply=True, timeout=10)
    assert replies, "the worker did not answer the revoke"

    # When the task is released and the worker drops it unrun
    assert _release(app) == 1
    running.wait_for_log(f"Discarding revoked task: {END_BY}[{first.id}]")

    # Then its key is free
    wait_for(lambda: key_owner(store_for(app), KEY) is None, timeout=10)
    assert runs.count() == 0


def test_a_pool_process_killed_mid_run_frees_the_key_through_the_workers_main_process(
    app: Celery, worker: Callable[..., CeleryProcess], runs: Runs
) -> None:
    # Given an until_finished task running in a prefork worker's pool process
    worker(app, pool="prefork")
    first = _park_and_run(app, runs, "return", 60)
    active = app.control.inspect(timeout=10).active() or {}
    (pid,) = [t["worker_pid"] for tasks in active.values() for t in tasks if t["id"] == first]

    # When that process is SIGKILLed (the main process lives on)
    os.kill(pid, signal.SIGKILL)

    # Then the main process reports the run lost and frees its key
    wait_for(lambda: key_owner(store_for(app), KEY) is None, timeout=20)
    assert _parks_a_new_task(app, first)


def test_a_run_ended_by_its_hard_time_limit_frees_the_key_at_once(
    app: Celery, worker: Callable[..., CeleryProcess], runs: Runs
) -> None:
    # Given an until_finished task with a hard time limit of 2 s that runs
    # for a minute in a prefork worker's pool process (the max run is an hour)
    worker(app, pool="prefork")
    task = app.tasks[END_BY]
    first = task.apply_delayed(
        ("return", 60), countdown=0, key=KEY, on_key="until_finished", time_limit=2
    )
    assert _release(app) == 1
    wait_for(lambda: any(r["result"] == "started" for r in runs.all()), timeout=30)

    # When the limit strikes
    # Then the key is free long before the max run would end
    wait_for(lambda: key_owner(store_for(app), KEY) is None, timeout=30)
    assert _parks_a_new_task(app, first.id)
    assert [r["result"] for r in runs.all()] == ["started"]


def test_a_second_delivery_refused_by_the_guard_leaves_the_key_to_the_run_that_owns_it(
    make_test_app: Callable[..., Celery],
    worker: Callable[..., CeleryProcess],
    runs: Runs,
    redis_client: redis.Redis,
) -> None:
    # Given the worker-side guard, and a released until_finished task whose
    # message reached the broker twice (as a companion that died after publishing)
    app = make_test_app(conf={"zdelay_worker_dedupe": True})
    task = app.tasks[END_BY]
    first = task.apply_delayed(("return", 4), countdown=0, key=KEY, on_key="until_finished")
    assert _release(app) == 1
    (message,) = redis_client.lrange("celery", 0, -1)

    # When one (solo) worker runs it, and while it runs another worker gets
    # the second delivery and refuses it (Ignore). The second delivery goes to
    # a queue only the second worker reads: in the first one's queue, a read
    # the first worker had already sent to Redis could take it (seen under
    # load), and it would then be refused after the run, by the first worker.
    worker(app)
    wait_for(lambda: any(r["result"] == "started" for r in runs.all()), timeout=30)
    redis_client.rpush("second", message)
    second_worker = worker(app, "second")
    second_worker.wait_for_log("Dropped a second delivery")

    # Then the key stays the running task's, every time we look, until that run returned
    def returned() -> bool:
        if any(r["result"] == "return" for r in runs.all()):
            return True
        owner = key_owner(store_for(app), KEY)
        assert owner is not None, "the refused delivery freed the key of the running task"
        assert owner[0] == first.id
        return False

    wait_for(returned, timeout=30, interval=0.05)
    # And then it is free
    wait_for(lambda: key_owner(store_for(app), KEY) is None, timeout=10)


@pytest.mark.parametrize("how", ["return", "ignore", "reject"])
def test_a_schedules_overlap_key_is_freed_however_its_run_ends(
    app: Celery, worker: Callable[..., CeleryProcess], runs: Runs, how: str
) -> None:
    # Given a worker and an occurrence of a schedule with zdelay_overlap="skip"
    worker(app)
    headers = {SCHEDULE_HEADER: "nightly", OVERLAP_HEADER: "skip"}
    occurrence = app.tasks[END_BY].apply_async((how, 1.0), headers=headers)

    # While it runs, it owns its schedule's key
    wait_for(lambda: any(r["result"] == "started" for r in runs.all()), timeout=30)
    owner = key_owner(store_for(app), overlap_key("nightly"))
    assert owner is not None
    assert owner[0] == occurrence.id

    # When it returns, raises Ignore or Reject(requeue=False), the key is free
    wait_for(lambda: any(r["result"] == how for r in runs.all()), timeout=30)
    wait_for(lambda: key_owner(store_for(app), overlap_key("nightly")) is None, timeout=10)
