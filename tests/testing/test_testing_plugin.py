"""The ``zdelay`` pytest fixture, run the way its users run it: in their test suites.

Each test writes a small user test suite with pytester and runs it, with the
plugin loaded from its ``pytest11`` entry point. Given tasks parked with
``apply_delayed``, when the suite advances the ``zdelay`` clock, then what
falls due is released in due order through the companion's code: into the
broker for a real worker, or, under ``task_always_eager``, run in the test
as a worker would run it. Parallel workers (pytest-xdist) never see each
other's entries, and nothing is left in Redis afterwards.
"""

from __future__ import annotations

import pytest
import redis

from celery_zdelay.testing import RedisServer, free_port

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.timeout(120)

#: pytest configuration of every user suite: warnings are errors, as here.
INI = """
[pytest]
filterwarnings = error
timeout = 60
"""

#: A user's conftest: a Celery app on *broker* with two delayed tasks that
#: record each run, and the ``celery_app`` fixture the plugin binds.
CONFTEST = """
import pytest
from celery import Celery

RUNS = []


def make_app(broker, **conf):
    app = Celery("shop", broker=broker, task_cls="celery_zdelay:Task", set_as_current=False)
    app.conf.update(conf)

    @app.task(name="shop.remind", bind=True, shared=False)
    def remind(self, customer):
        RUNS.append(("remind", customer, self.request.id, self.request.is_eager))
        return f"reminded {customer}"

    @app.task(name="shop.cancel", bind=True, shared=False)
    def cancel(self, order, then_remind_in=None):
        RUNS.append(("cancel", order, self.request.id, self.request.is_eager))
        if then_remind_in is not None:
            remind.apply_delayed((f"owner of {order}",), countdown=then_remind_in)
        if order == "boom":
            raise ValueError("cannot cancel boom")
        return f"cancelled {order}"

    return app


@pytest.fixture(autouse=True)
def _forget_runs():
    RUNS.clear()
"""


def _suite(pytester: pytest.Pytester, conftest_extra: str, tests: str) -> None:
    pytester.makeini(INI)
    pytester.makeconftest(CONFTEST + conftest_extra)
    pytester.makepyfile(test_user=tests)


EAGER_APP = """

@pytest.fixture
def celery_app():
    app = make_app("redis://127.0.0.1:9/0", task_always_eager=True)
    yield app
    app.close()
"""


BROKER_APP = """

@pytest.fixture
def celery_app(zdelay_redis_url):
    app = make_app(zdelay_redis_url)
    yield app
    app.close()
"""


def test_under_eager_advancing_runs_released_tasks_here_in_due_order(
    pytester: pytest.Pytester,
) -> None:
    _suite(
        pytester,
        EAGER_APP,
        """
        from conftest import RUNS


        def test_story(celery_app, zdelay):
            remind, cancel = celery_app.tasks["shop.remind"], celery_app.tasks["shop.cancel"]
            late = cancel.apply_delayed(("order-1",), countdown=1800)
            early = remind.apply_delayed(("ann",), countdown=600)
            middle = remind.apply_delayed(("bob",), countdown=1200)

            parked = zdelay.parked()
            assert [(t.id, t.name, t.argsrepr) for t in parked] == [
                (early.id, "shop.remind", "('ann',)"),
                (middle.id, "shop.remind", "('bob',)"),
                (late.id, "shop.cancel", "('order-1',)"),
            ]
            assert [round(t.due_in) for t in parked] == [600, 1200, 1800]
            assert RUNS == []

            assert zdelay.advance(599) == []
            released = zdelay.advance(1201)

            assert [(t.id, t.state, t.result) for t in released] == [
                (early.id, "SUCCESS", "reminded ann"),
                (middle.id, "SUCCESS", "reminded bob"),
                (late.id, "SUCCESS", "cancelled order-1"),
            ]
            # Run as a worker runs them, not as eager calls.
            assert RUNS == [
                ("remind", "ann", early.id, False),
                ("remind", "bob", middle.id, False),
                ("cancel", "order-1", late.id, False),
            ]
            assert zdelay.parked() == []


        def test_apply_async_stays_eager(celery_app, zdelay):
            assert celery_app.tasks["shop.remind"].delay("now").get() == "reminded now"
            assert zdelay.parked() == []
        """,
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=2)


def test_a_task_parked_by_a_released_task_counts_from_when_it_ran(
    pytester: pytest.Pytester,
) -> None:
    _suite(
        pytester,
        EAGER_APP,
        """
        from conftest import RUNS


        def test_story(celery_app, zdelay):
            cancel = celery_app.tasks["shop.cancel"]
            cancel.apply_delayed(("order-2",), kwargs={"then_remind_in": 600}, countdown=1800)

            # 30 minutes: the cancel runs and parks a reminder due 10 minutes later.
            released = zdelay.advance(1800)
            assert [t.name for t in released] == ["shop.cancel"]
            (reminder,) = zdelay.parked()
            assert reminder.name == "shop.remind"
            assert round(reminder.due_in) == 600

            assert zdelay.advance(599) == []
            assert [t.name for t in zdelay.advance(1)] == ["shop.remind"]


        def test_one_advance_runs_the_follow_up_too(celery_app, zdelay):
            cancel = celery_app.tasks["shop.cancel"]
            cancel.apply_delayed(("order-3",), kwargs={"then_remind_in": 600}, countdown=1800)

            released = zdelay.advance(2400)

            assert [t.name for t in released] == ["shop.cancel", "shop.remind"]
            assert [run[:2] for run in RUNS] == [
                ("cancel", "order-3"),
                ("remind", "owner of order-3"),
            ]
        """,
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=2)


def test_a_debounce_max_wait_counts_on_the_tests_clock(pytester: pytest.Pytester) -> None:
    _suite(
        pytester,
        EAGER_APP,
        """
        from conftest import RUNS


        def test_story(celery_app, zdelay):
            remind = celery_app.tasks["shop.remind"]
            options = {"key": "typing", "on_key": "debounce", "max_wait": 100}
            remind.apply_delayed(("first",), countdown=60, **options)

            # 50 s later, another call: its 60 s would pass the cap, 100 s
            # after the first call, 50 s from now on the test's clock.
            assert zdelay.advance(50) == []
            remind.apply_delayed(("second",), countdown=60, **options)
            (parked,) = zdelay.parked()
            assert round(parked.due_in) == 50

            assert zdelay.advance(49) == []
            assert [t.name for t in zdelay.advance(1)] == ["shop.remind"]
            assert [run[:2] for run in RUNS] == [("remind", "second")]
        """,
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=1)


def test_release_due_now_and_clear(pytester: pytest.Pytester) -> None:
    _suite(
        pytester,
        EAGER_APP,
        """
        from datetime import datetime, timedelta, timezone

        from conftest import RUNS


        def test_release_due_by_a_datetime(celery_app, zdelay):
            remind = celery_app.tasks["shop.remind"]
            start = datetime.now(timezone.utc)
            remind.apply_delayed(("ann",), eta=start + timedelta(minutes=10))
            remind.apply_delayed(("bob",), eta=start + timedelta(hours=2))

            assert zdelay.release_due() == []
            released = zdelay.release_due(now=start + timedelta(hours=1))

            assert [t.argsrepr for t in released] == ["('ann',)"]
            (left,) = zdelay.parked()
            assert left.argsrepr == "('bob',)"
            assert 3500 < left.due_in <= 3600
            # The clock never goes back.
            assert zdelay.release_due(now=start) == []


        def test_clear_drops_everything_parked(celery_app, zdelay):
            celery_app.tasks["shop.remind"].apply_delayed(("ann",), countdown=5)
            zdelay.clear()
            assert zdelay.parked() == []
            assert zdelay.advance(3600) == []
            assert RUNS == []


        def test_parked_filters_by_task_name(celery_app, zdelay):
            celery_app.tasks["shop.remind"].apply_delayed(("ann",), countdown=5)
            celery_app.tasks["shop.cancel"].apply_delayed(("order-4",), countdown=5)
            assert [t.argsrepr for t in zdelay.parked("shop.cancel")] == ["('order-4',)"]
        """,
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=3)


def test_a_failing_released_task_raises_when_eager_propagates(
    pytester: pytest.Pytester,
) -> None:
    _suite(
        pytester,
        EAGER_APP,
        """
        from datetime import datetime, timedelta, timezone

        import pytest

        from conftest import RUNS


        def test_without_propagation_the_failure_is_reported(celery_app, zdelay):
            celery_app.tasks["shop.cancel"].apply_delayed(("boom",), countdown=60)
            (released,) = zdelay.advance(60)
            assert released.state == "FAILURE"
            assert isinstance(released.result, ValueError)


        def test_with_propagation_advance_raises_after_the_step_ran(celery_app, zdelay):
            celery_app.conf.task_eager_propagates = True
            cancel = celery_app.tasks["shop.cancel"]
            in_a_minute = datetime.now(timezone.utc) + timedelta(seconds=60)
            cancel.apply_delayed(("boom",), eta=in_a_minute)
            cancel.apply_delayed(("order-5",), eta=in_a_minute)
            cancel.apply_delayed(("order-6",), countdown=120)

            with pytest.raises(ValueError, match="cannot cancel boom"):
                zdelay.advance(300)

            # Both due at the same instant ran; the clock stopped there.
            assert sorted(run[1] for run in RUNS) == ["boom", "order-5"]
            assert [t.argsrepr for t in zdelay.parked()] == ["('order-6',)"]
        """,
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=2)


def test_the_apps_settings_are_restored_after_the_test(pytester: pytest.Pytester) -> None:
    _suite(
        pytester,
        """

APP = make_app(
    "redis://127.0.0.1:9/0",
    task_always_eager=True,
    zdelay_redis_url="redis://127.0.0.1:9/3",
)


@pytest.fixture
def celery_app():
    return APP
""",
        """
        from conftest import APP


        def test_a_uses_zdelay(celery_app, zdelay):
            assert APP.conf.zdelay_redis_url != "redis://127.0.0.1:9/3"
            assert APP.conf.zdelay_key_prefix.startswith("zdelay-test-")


        def test_b_sees_its_own_settings_again():
            assert APP.conf.zdelay_redis_url == "redis://127.0.0.1:9/3"
            assert APP.conf.get("zdelay_key_prefix") is None
            assert APP.conf.broker_write_url == "redis://127.0.0.1:9/0"
            assert APP.conf.broker_transport_options == {}
            assert not hasattr(APP, "_zdelay_park_when_eager")
        """,
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=2)


def test_without_a_url_the_plugin_runs_a_private_redis_for_the_session(
    pytester: pytest.Pytester,
) -> None:
    _suite(
        pytester,
        BROKER_APP,
        """
        import pathlib


        def test_parks_in_a_private_redis(celery_app, zdelay, zdelay_redis_url):
            assert zdelay_redis_url.startswith("redis://127.0.0.1:")
            result = celery_app.tasks["shop.remind"].apply_delayed(("ann",), countdown=1)
            assert [t.id for t in zdelay.parked()] == [result.id]
            assert [t.id for t in zdelay.advance(1)] == [result.id]
            assert zdelay.store.client.llen("celery") == 1
            pathlib.Path("url.txt").write_text(zdelay_redis_url)
        """,
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=1)

    url = (pytester.path / "url.txt").read_text()
    client = redis.Redis.from_url(url, socket_connect_timeout=1)
    try:
        with pytest.raises(redis.exceptions.ConnectionError):
            client.ping()
    finally:
        client.close()


def test_without_an_app_the_fixture_says_how_to_name_it(pytester: pytest.Pytester) -> None:
    _suite(
        pytester,
        "",
        """
        def test_needs_an_app(zdelay):
            pass
        """,
    )
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*zdelay fixture needs your Celery app*zdelay_app*"])


def test_an_unreachable_test_redis_is_a_clear_error(pytester: pytest.Pytester) -> None:
    _suite(
        pytester,
        BROKER_APP,
        """
        def test_needs_redis(zdelay):
            pass
        """,
    )
    result = pytester.runpytest(f"--zdelay-redis-url=redis://127.0.0.1:{free_port()}/0")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*Cannot reach the celery-zdelay store at redis://127.0.0.1:*"])


def test_the_app_can_be_named_in_the_ini_file(
    pytester: pytest.Pytester, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"{redis_server.url}/5"
    monkeypatch.setenv("PROJ_BROKER", url)
    pytester.makeini(INI + "zdelay_app = proj:app\n")
    pytester.makepyfile(
        proj="""
        import os

        from celery import Celery

        app = Celery("proj", broker=os.environ["PROJ_BROKER"], task_cls="celery_zdelay:Task")


        @app.task(name="proj.ping", shared=False)
        def ping():
            return "pong"
        """,
        test_user="""
        from proj import app


        def test_named_app(zdelay):
            assert zdelay.app is app
            result = app.tasks["proj.ping"].apply_delayed(countdown=1)
            assert [t.id for t in zdelay.advance(1)] == [result.id]
            assert zdelay.store.client.llen("celery") == 1
        """,
    )
    result = pytester.runpytest(f"--zdelay-redis-url={url}")
    result.assert_outcomes(passed=1)


def test_without_eager_released_tasks_go_to_the_broker_for_a_real_worker(
    pytester: pytest.Pytester, redis_server: RedisServer
) -> None:
    """The app's own Redis broker: the release is the companion's handoff."""
    _suite(
        pytester,
        """

@pytest.fixture
def celery_app(zdelay_redis_url):
    app = make_app(zdelay_redis_url)
    yield app
    app.close()
""",
        """
        import json
        import os
        import subprocess
        import sys
        import time

        import redis

        from conftest import RUNS


        def _worker(broker):
            return subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "worker_app", "worker", "-P", "solo",
                 "-l", "INFO", "--without-gossip", "--without-mingle", "--without-heartbeat"],
                env={**os.environ, "BROKER": broker, "PYTHONPATH": os.getcwd()},
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )


        def test_story(celery_app, zdelay, zdelay_redis_url):
            remind = celery_app.tasks["shop.remind"]
            later = remind.apply_delayed(("bob",), countdown=1200)
            sooner = remind.apply_delayed(("ann",), countdown=600)
            broker = redis.Redis.from_url(zdelay_redis_url)
            try:
                assert zdelay.advance(599) == []
                assert broker.llen("celery") == 0

                released = zdelay.advance(601)
                assert [(t.id, t.state) for t in released] == [(sooner.id, None), (later.id, None)]
                # In the broker, oldest first (kombu pops from the right).
                queued = [json.loads(raw)["headers"] for raw in broker.lrange("celery", 0, -1)]
                assert [h["id"] for h in reversed(queued)] == [sooner.id, later.id]
                assert [h["argsrepr"] for h in reversed(queued)] == ["('ann',)", "('bob',)"]
                assert RUNS == []

                worker = _worker(zdelay_redis_url)
                try:
                    deadline = time.monotonic() + 30
                    while broker.llen("worker-runs") < 2:
                        assert time.monotonic() < deadline, "the worker did not run both tasks"
                        time.sleep(0.05)
                finally:
                    worker.terminate()
                    worker.wait(timeout=30)
                runs = [json.loads(raw) for raw in broker.lrange("worker-runs", 0, -1)]
                assert runs == [[sooner.id, "ann"], [later.id, "bob"]]
            finally:
                broker.close()
        """,
    )
    pytester.makepyfile(
        worker_app="""
        import json
        import os

        import redis
        from celery import Celery

        app = Celery("shop", broker=os.environ["BROKER"], task_cls="celery_zdelay:Task")
        app.conf.worker_hijack_root_logger = False
        runs = redis.Redis.from_url(os.environ["BROKER"])


        @app.task(name="shop.remind", bind=True)
        def remind(self, customer):
            runs.rpush("worker-runs", json.dumps([self.request.id, customer]))
        """
    )
    result = pytester.runpytest(f"--zdelay-redis-url={redis_server.url}/0")
    result.assert_outcomes(passed=1)


XDIST_SUITE = """
import time

import redis


def _barrier(client, name):
    client.incr(name)
    deadline = time.monotonic() + 30
    while int(client.get(name)) < 2:
        assert time.monotonic() < deadline, "the other xdist worker never arrived"
        time.sleep(0.02)


def test_each_worker_sees_only_its_own_entries(celery_app, zdelay, zdelay_redis_url, worker_id):
    celery_app.tasks["shop.remind"].apply_delayed((worker_id,), countdown=60)
    client = redis.Redis.from_url(zdelay_redis_url)
    try:
        _barrier(client, "parked")
        # Both workers have parked now, each under its own prefix.
        assert len(client.keys("{zdelay-test-gw*:0}:due")) == 2
        assert [t.argsrepr for t in zdelay.parked()] == [repr((worker_id,))]
        _barrier(client, "listed")
        released = zdelay.advance(60)
        assert [t.argsrepr for t in released] == [repr((worker_id,))]
    finally:
        client.close()
"""


def test_xdist_workers_do_not_see_each_others_entries(
    pytester: pytest.Pytester, redis_server: RedisServer
) -> None:
    _suite(pytester, BROKER_APP, XDIST_SUITE)
    url = f"{redis_server.url}/4"
    result = pytester.runpytest_subprocess("-n", "2", "--dist", "each", f"--zdelay-redis-url={url}")
    result.assert_outcomes(passed=2)

    client = redis.Redis.from_url(url)
    try:
        # Each worker released its own task to the shared broker queue;
        # everything either worker parked was deleted when its test ended.
        assert client.llen("celery") == 2
        assert sorted(client.keys("*")) == [b"celery", b"listed", b"parked"]
    finally:
        client.close()
