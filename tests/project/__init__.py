"""The Celery project that the tests' workers and companions run.

A test builds its app with :func:`make_app`; subprocesses (``celery -A
tests.project.worker_app worker|zdelay``) build the same app from the
environment variables :func:`app_env` returns, so both sides agree on
broker, store, queues and settings.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery
from celery.exceptions import Ignore, Reject
from kombu import Exchange, Queue

from tests.support.clock import redis_ms

#: Redis list each run of a recording task is appended to, as JSON.
RUNS_KEY = "zdelay-test:runs"
#: Redis list a worker started with :data:`RECORD_RECEIVED_ENV` appends each
#: message it receives to, as JSON ``{"id", "redis_ms"}``: the moment the
#: broker handed it over, before the pool runs it.
RECEIVED_KEY = "zdelay-test:received"
#: Environment variable (``"1"``) that makes a worker record :data:`RECEIVED_KEY`.
RECORD_RECEIVED_ENV = "ZDELAY_TEST_RECORD_RECEIVED"
#: Environment variable: seconds of ``zdelay_release_ahead_seconds`` that
#: every test app gets unless its test sets one, to run test files with
#: releases ahead (``ZDELAY_TEST_RELEASE_AHEAD=0.005 pytest tests/test_pause.py``).
RELEASE_AHEAD_ENV = "ZDELAY_TEST_RELEASE_AHEAD"
#: Environment variable (a number N): the process SIGKILLs itself on the Nth
#: ``tasks_parked`` signal, sent after a park and before anything else (for
#: ``zdelay adopt``: between parking a batch and acknowledging it to the broker).
KILL_ON_PARKED_ENV = "ZDELAY_TEST_KILL_ON_PARKED"


def make_app(
    broker: str,
    backend: str,
    record: str,
    *,
    conf: dict[str, Any] | None = None,
    queues: list[dict[str, Any]] | None = None,
) -> Celery:
    """Return the test app; *queues* are kombu Queue keyword arguments."""
    ahead = os.environ.get(RELEASE_AHEAD_ENV)
    if ahead:
        conf = {"zdelay_release_ahead_seconds": float(ahead), **(conf or {})}
    # Not the current app: test modules build many apps in one process, and
    # shared tasks elsewhere (example_project) must keep resolving to theirs.
    app = Celery(
        "zdelaytest",
        broker=broker,
        backend=backend,
        task_cls="celery_zdelay:Task",
        set_as_current=False,
    )
    app.conf.update(
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        result_expires=600,
        accept_content=["json", "msgpack", "pickle"],
        result_accept_content=["json", "msgpack", "pickle"],
    )
    if queues:
        app.conf.task_queues = [_queue(**spec) for spec in queues]
    app.conf.update(conf or {})
    app._zdelay_test_env = {  # type: ignore[attr-defined]
        "ZDELAY_TEST_BROKER": broker,
        "ZDELAY_TEST_BACKEND": backend,
        "ZDELAY_TEST_RECORD": record,
        "ZDELAY_TEST_CONF": json.dumps(conf or {}),
        "ZDELAY_TEST_QUEUES": json.dumps(queues or []),
    }
    _register_tasks(app, record)
    return app


def close_app(app: Celery) -> None:
    """Close every connection *app* and celery-zdelay opened."""
    parking = getattr(app, "_zdelay_parking", None)
    if parking is not None:
        parking.store.close()
    if "backend" in app.__dict__ or getattr(app, "_local", None) is not None:
        backend = app.backend
        consumer = getattr(backend, "result_consumer", None)
        if consumer is not None:
            consumer.stop()
        client = getattr(backend, "client", None)
        if client is not None:
            client.close()
    app.close()


def app_env(app: Celery) -> dict[str, str]:
    """Return the environment that rebuilds *app* in a subprocess."""
    return dict(app._zdelay_test_env)  # type: ignore[attr-defined]


def app_from_env() -> Celery:
    return make_app(
        os.environ["ZDELAY_TEST_BROKER"],
        os.environ["ZDELAY_TEST_BACKEND"],
        os.environ["ZDELAY_TEST_RECORD"],
        conf=json.loads(os.environ.get("ZDELAY_TEST_CONF", "{}")),
        queues=json.loads(os.environ.get("ZDELAY_TEST_QUEUES", "[]")),
    )


def _queue(name: str, exchange: str | None = None, **kwargs: Any) -> Queue:
    if exchange is not None:
        kwargs["exchange"] = Exchange(exchange, type=kwargs.pop("exchange_type", "direct"))
    return Queue(name, **kwargs)


def _register_tasks(app: Celery, record_url: str) -> None:
    recorder = redis.Redis.from_url(record_url)

    def record_run(task: Any, result: Any = None) -> None:
        request = task.request
        ran_ms = redis_ms(recorder)
        recorder.rpush(
            RUNS_KEY,
            json.dumps(
                {
                    "id": request.id,
                    "task": task.name,
                    "args": list(request.args or ()),
                    "kwargs": dict(request.kwargs or {}),
                    "eta": request.eta,
                    # The eta header of the message the worker got (a worker
                    # holds a message that has one): celery-zdelay releases
                    # with none and carries the ETA in zdelay_eta, which the
                    # worker puts back into request.eta.
                    "message_eta": None if getattr(request, "zdelay_eta", None) else request.eta,
                    "expires": request.expires,
                    "root_id": request.root_id,
                    "parent_id": request.parent_id,
                    "group": request.group,
                    "retries": request.retries,
                    "priority": (request.delivery_info or {}).get("priority"),
                    "routing_key": (request.delivery_info or {}).get("routing_key"),
                    "headers": {
                        k: v
                        for k, v in (request.headers or {}).items()
                        if isinstance(v, (str, int, float, bool, type(None)))
                    },
                    "custom": getattr(request, "x_custom", None),
                    "redis_ms": ran_ms,
                    "wall": time.time(),
                    "result": result,
                }
            ),
        )

    @app.task(name="tests.record", shared=False, bind=True)
    def record(self: Any, *args: Any, **kwargs: Any) -> list[Any]:
        record_run(self, list(args))
        return list(args)

    @app.task(name="tests.add", shared=False, bind=True)
    def add(self: Any, x: Any, y: Any) -> Any:
        record_run(self, x + y)
        return x + y

    @app.task(name="tests.mul", shared=False, bind=True)
    def mul(self: Any, x: Any, y: Any) -> Any:
        record_run(self, x * y)
        return x * y

    @app.task(name="tests.tsum", shared=False, bind=True)
    def tsum(self: Any, numbers: list[Any]) -> Any:
        record_run(self, sum(numbers))
        return sum(numbers)

    @app.task(name="tests.fail", shared=False, bind=True)
    def fail(self: Any, *args: Any) -> None:
        record_run(self, "failed")
        raise ValueError("tests.fail always fails")

    @app.task(name="tests.on_error", shared=False, bind=True)
    def on_error(self: Any, failed_task_id: str) -> None:
        record_run(self, f"errback for {failed_task_id}")

    @app.task(name="tests.reject_once", shared=False, bind=True, acks_late=True)
    def reject_once(self: Any) -> str:
        """Give the message back to the broker (requeue) the first time it runs."""
        record_run(self, "delivered")
        if recorder.incr(f"zdelay-test:rejected:{self.request.id}") == 1:
            raise Reject("requeue me once", requeue=True)
        return "ran"

    @app.task(name="tests.slow_late", shared=False, bind=True, acks_late=True)
    def slow_late(self: Any, seconds: float) -> str:
        """Acknowledged after it ends: a worker killed meanwhile gets it redelivered."""
        record_run(self, "started")
        time.sleep(seconds)
        record_run(self, "finished")
        return "finished"

    @app.task(name="tests.retry_once", shared=False, bind=True, max_retries=3)
    def retry_once(self: Any, countdown: float) -> str:
        record_run(self, self.request.retries)
        if self.request.retries == 0:
            raise self.retry(countdown=countdown)
        return "retried"

    @app.task(name="tests.end_by", shared=False, bind=True, acks_late=True)
    def end_by(self: Any, how: str, seconds: float = 0) -> str:
        """Run for *seconds*, then end as *how* says: return, fail, ignore or reject.

        ``reject`` gives the message up (``Reject(requeue=False)``),
        ``reject_once`` gives it back to the broker the first time
        (``Reject(requeue=True)``) and returns the second.
        """
        record_run(self, "started")
        time.sleep(seconds)
        record_run(self, how)
        if how == "fail":
            raise ValueError("tests.end_by fails as asked")
        if how == "ignore":
            raise Ignore()
        if how == "reject":
            raise Reject("given up", requeue=False)
        if how == "reject_once" and recorder.incr(f"zdelay-test:rejected:{self.request.id}") == 1:
            raise Reject("requeue me once", requeue=True)
        return how
