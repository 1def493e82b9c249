"""Concurrency set at run time: ``celery_zdelay.set_concurrency`` and ``zdelay concurrency``.

Issue 36 (its closing note's gap): a concurrency control could come from
``zdelay_concurrency`` only, so changing it meant restarting every
companion and worker. Now it is stored in Redis, as a rate limit set at run
time is, and wins over the setting. The subtle part is the worker: it frees
a run's slots by the control names it knows, so a name new to the settings
is applied by companions only once workers have read it
(``CONCURRENCY_SETTLE_MS``), and a name stays known once set, so the slots
of tasks released under it are freed even after it is removed. Real Redis,
real companions, a real worker.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Callable

import pytest
import redis
from celery import Celery

import celery_zdelay
from celery_zdelay.companion import Companion
from celery_zdelay.concurrency import CONCURRENCY_SETTLE_MS, effective_concurrency
from celery_zdelay.errors import ConfigurationError
from celery_zdelay.limits import concurrency, controls
from celery_zdelay.parking import store_for
from celery_zdelay.store.control import ControlStore
from celery_zdelay.store.redis_keys import control_keys
from celery_zdelay.worker import CONCURRENCY_NAMES_RETRY_SECONDS, _concurrency_names
from tests.conftest import AppFactory
from tests.helpers import CeleryProcess, Runs, wait_for
from tests.support.cli import run

pytestmark = pytest.mark.timeout(120)

END_BY = "tests.end_by"
CONTROL = f"task:{END_BY}"
HASH = control_keys("zdelay").concurrency


def _live(app: Celery, slot: str) -> int:
    return ControlStore(store_for(app)).live_slots(slot)


def _applied(app: Celery, name: str, most: int | None) -> None:
    """Wait until companions apply *most* for *name* (a new name settles first)."""
    wait_for(lambda: concurrency(app=app).get(name) == most, timeout=10)


def _release(app: Celery) -> int:
    with Companion(app, store=store_for(app)) as companion:
        return companion.release_due().released


def test_a_name_new_to_the_settings_applies_once_workers_can_have_read_it() -> None:
    # A number for a name the settings lack waits CONCURRENCY_SETTLE_MS after
    # the name was first set; a name of the settings, or one removed, at once
    stored = {"task:a": (2, 10_000), "task:b": (3, 10_000), "task:c": (None, 0)}
    config = {"task:b": 1, "task:c": 4}
    early = 10_000 + CONCURRENCY_SETTLE_MS - 1
    assert effective_concurrency(config, stored, now_ms=early) == {"task:b": 3}
    late = 10_000 + CONCURRENCY_SETTLE_MS
    assert effective_concurrency(config, stored, now_ms=late) == {"task:a": 2, "task:b": 3}


def test_a_control_set_at_run_time_holds_releases_and_a_worker_frees_its_slots(
    make_test_app: AppFactory, worker: Callable[..., CeleryProcess], runs: Runs
) -> None:
    # Given no concurrency setting, a worker that has run a task already (it
    # read the names set at run time then: none), and a control set since
    app = make_test_app()
    worker(app)
    app.tasks[END_BY].apply_delayed(("first", 0), countdown=0)
    assert _release(app) == 1
    wait_for(lambda: any(r["result"] == "first" for r in runs.all()), timeout=30)
    assert celery_zdelay.set_concurrency(CONTROL, 1, app=app) == 1
    _applied(app, CONTROL, 1)

    # When three tasks fall due, each running a second
    ids = [app.tasks[END_BY].apply_delayed(("return", 1), countdown=0).id for _ in range(3)]
    assert _release(app) == 1

    # Then one was released and two wait for its slot, shown as such
    waiting = [celery_zdelay.lookup(i, app=app) for i in ids]
    held = [w for w in waiting if w is not None and w.held_reason == "concurrency"]
    assert len(held) == 2
    assert {w.held_by for w in held} == {CONTROL}
    (info,) = [c for c in controls(app=app) if c.name == CONTROL]
    assert (info.concurrency, info.concurrency_source, info.waiting) == (1, "runtime", 2)

    # And the worker, whose settings know no such control, frees the slot
    # when the run ends (a worker that read only its settings never would:
    # the slot would stay taken for zdelay_max_run_seconds, an hour)
    wait_for(lambda: any(r["result"] == "return" for r in runs.all()), timeout=30)
    wait_for(lambda: _live(app, CONTROL) == 0, timeout=10)
    # So the next one goes out
    assert _release(app) == 1


def test_a_removed_control_releases_what_waited_and_its_name_stays_known(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given a control of 1 set at run time, one task released and two held
    app = make_test_app()
    celery_zdelay.set_concurrency(CONTROL, 1, app=app)
    _applied(app, CONTROL, 1)
    for _ in range(3):
        app.tasks[END_BY].apply_delayed(("return", 0), countdown=0)
    assert _release(app) == 1

    # When it is removed
    assert celery_zdelay.set_concurrency(CONTROL, None, app=app) is None

    # Then it is not in force, and the next pass releases what waited
    assert CONTROL not in concurrency(app=app)
    assert CONTROL not in {c.name for c in controls(app=app) if c.concurrency}
    assert _release(app) == 2
    # And its name stays in Redis ("most": null), for workers to free the
    # slot of the task released under it; set again, it applies at once
    stored = json.loads(redis_client.hget(HASH, CONTROL))
    assert stored["most"] is None
    assert ControlStore(store_for(app)).concurrency_names() == {CONTROL}
    celery_zdelay.set_concurrency(CONTROL, 2, app=app)
    assert concurrency(app=app)[CONTROL] == 2
    assert json.loads(redis_client.hget(HASH, CONTROL))["at"] == stored["at"]


def test_a_control_set_at_run_time_wins_over_the_setting_and_can_remove_it(
    make_test_app: AppFactory,
) -> None:
    app = make_test_app(conf={"zdelay_concurrency": {CONTROL: 1}})
    assert concurrency(app=app) == {CONTROL: 1}
    # A name of the settings needs no settling: workers know it already
    celery_zdelay.set_concurrency(CONTROL, 3, app=app)
    assert concurrency(app=app) == {CONTROL: 3}
    (info,) = controls(app=app)
    assert (info.concurrency, info.concurrency_source) == (3, "runtime")
    for _ in range(4):
        app.tasks[END_BY].apply_delayed(("return", 0), countdown=0)
    assert _release(app) == 3
    celery_zdelay.set_concurrency(CONTROL, None, app=app)
    assert concurrency(app=app) == {}
    assert _release(app) == 1


@pytest.mark.parametrize("most", [0, -1, True, 1.5, "2", [2]])
def test_a_bad_number_says_what_to_give_and_stores_nothing(
    make_test_app: AppFactory, redis_client: redis.Redis, most: object
) -> None:
    app = make_test_app()
    with pytest.raises(ConfigurationError, match="whole number of tasks of at least 1"):
        celery_zdelay.set_concurrency(CONTROL, most, app=app)
    with pytest.raises(ConfigurationError, match="is not a control name"):
        celery_zdelay.set_concurrency("proj.export", 2, app=app)
    assert not redis_client.exists(HASH)


def test_a_value_written_into_redis_by_hand_is_refused_with_the_fix(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = make_test_app()
    redis_client.hset(HASH, CONTROL, "3")
    with pytest.raises(ConfigurationError, match=f"zdelay concurrency {CONTROL} N"):
        concurrency(app=app)
    # Setting it again mends it
    redis_client.hdel(HASH, CONTROL)
    celery_zdelay.set_concurrency(CONTROL, 3, app=app)
    assert json.loads(redis_client.hget(HASH, CONTROL))["most"] == 3


def test_the_command_line_sets_lists_and_removes_a_control_and_audits_it(
    make_test_app: AppFactory, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_test_app(conf={"zdelay_audit_log": True})
    with caplog.at_level(logging.INFO, logger="celery_zdelay.audit"):
        assert run(app, "concurrency", CONTROL, "2").output.strip() == f"{CONTROL}: concurrency 2"
        _applied(app, CONTROL, 2)
        listing = run(app, "concurrency").output
        assert "concurrency 2 (0 running, runtime)" in listing
        rows = json.loads(run(app, "concurrency", "--json").output)
        assert [(r["name"], r["concurrency"], r["concurrency_source"]) for r in rows] == [
            (CONTROL, 2, "runtime")
        ]
        assert run(app, "concurrency", CONTROL, "off").output.strip() == (
            f"{CONTROL}: no concurrency control"
        )
    lines = [r.getMessage() for r in caplog.records if r.name == "celery_zdelay.audit"]
    assert [line.split(" by ")[0] for line in lines] == [
        f"Concurrency of {CONTROL} set to 2",
        f"Concurrency of {CONTROL} removed",
    ]
    # Bad input: exit 78 with the message; a missing number: a usage error
    bad = run(app, "concurrency", CONTROL, "many")
    assert bad.exit_code == 78
    assert "whole number of tasks of at least 1" in bad.stderr
    assert run(app, "concurrency", CONTROL).exit_code == 2


def test_a_worker_whose_store_does_not_answer_tries_again_later_not_at_every_run_end(
    make_test_app: AppFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a worker-side app whose store refuses connections (nothing listens)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app = make_test_app(conf={"zdelay_redis_url": f"redis://127.0.0.1:{port}/0"})
    app.conf.zdelay_concurrency = {CONTROL: 1}

    # When three runs end in a row
    with caplog.at_level(logging.WARNING, logger="celery_zdelay.worker"):
        names = [_concurrency_names(app) for _ in range(3)]

    # Then the settings' names serve, and the store was tried once, said once
    assert names == [frozenset({CONTROL})] * 3
    said = [r.getMessage() for r in caplog.records if "set at run time" in r.getMessage()]
    assert len(said) == 1, said
    assert f"trying again in {CONCURRENCY_NAMES_RETRY_SECONDS} s" in said[0]
