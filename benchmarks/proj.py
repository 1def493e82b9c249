"""The Celery project every benchmark uses, in this process and in its subprocesses.

The benchmark builds its app with :func:`make_app`; the workers and companions
it starts (``celery -A benchmarks.proj worker|zdelay``) rebuild the same app
from the ``ZBENCH_*`` environment variables :func:`app_env` returns, so both
sides agree on broker, store, queue and settings.

The one task, ``bench.noop(seq, due_ms)``, carries its due time in its
arguments so a consumer can tell how late a message arrived without trusting
the code under test. When ``ZBENCH_RECORD`` names a Redis database, each run
increments a counter there, so end-to-end benchmarks can count executions.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from typing import Any

import redis
from celery import Celery

#: Counter each execution of ``bench.noop`` increments in the record database.
DONE_KEY = "zbench:done"
#: List each execution of ``bench.tick`` appends ``[task id, Redis ms]`` to.
TICKS_KEY = "zbench:ticks"
#: With ``ZBENCH_STAMPS=1``: list the worker appends ``"r <seq> <ns>"`` to as
#: each ``bench.noop`` message reaches it (Celery's ``task_received``, before
#: any ETA timer) and ``"s <seq> <ns>"`` as it starts; the machine's clock.
STAMPS_KEY = "zbench:stamps"
#: Default queue of the benchmark app (and the kombu list key on Redis).
DEFAULT_QUEUE = "bench"


def make_app(
    *,
    broker: str,
    store: str,
    queue: str = DEFAULT_QUEUE,
    record: str | None = None,
    conf: dict[str, Any] | None = None,
) -> Celery:
    """Return the benchmark app: no result backend, one queue, ``bench.noop``."""
    app = Celery("zbench", broker=broker, task_cls="celery_zdelay:Task", set_as_current=False)
    app.conf.update(
        zdelay_redis_url=store,
        task_default_queue=queue,
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        task_send_sent_event=False,
    )
    app.conf.update(conf or {})
    app._zbench_env = {  # type: ignore[attr-defined]
        "ZBENCH_BROKER": broker,
        "ZBENCH_STORE": store,
        "ZBENCH_QUEUE": queue,
        "ZBENCH_RECORD": record or "",
        "ZBENCH_CONF": json.dumps(conf or {}),
    }
    recorder: list[redis.Redis] = []

    stamps = os.environ.get("ZBENCH_STAMPS") == "1"

    @app.task(name="bench.noop", shared=False)
    def noop(seq: int, due_ms: int) -> None:
        if record and stamps:
            started_ns = time.time_ns()
            if not recorder:
                recorder.append(redis.Redis.from_url(record))
            recorder[0].rpush(STAMPS_KEY, f"s {seq} {started_ns}")
        elif record:
            if not recorder:
                recorder.append(redis.Redis.from_url(record))
            recorder[0].incr(DONE_KEY)

    @app.task(name="bench.tick", bind=True, shared=False)
    def tick(self: Any) -> None:
        # A periodic task (benchmarks/beat.py): when it started, on the Redis clock.
        if record:
            if not recorder:
                recorder.append(redis.Redis.from_url(record))
            seconds, micros = recorder[0].time()
            started_ms = int(seconds) * 1000 + int(micros) // 1000
            recorder[0].rpush(TICKS_KEY, json.dumps([self.request.id, started_ms]))

    return app


def app_env(app: Celery) -> dict[str, str]:
    """Return the environment variables that rebuild *app* in a subprocess."""
    return dict(app._zbench_env)  # type: ignore[attr-defined]


def _app_from_env() -> Celery | None:
    broker = os.environ.get("ZBENCH_BROKER")
    if not broker:
        return None
    return make_app(
        broker=broker,
        store=os.environ["ZBENCH_STORE"],
        queue=os.environ.get("ZBENCH_QUEUE", DEFAULT_QUEUE),
        record=os.environ.get("ZBENCH_RECORD") or None,
        conf=json.loads(os.environ.get("ZBENCH_CONF") or "{}"),
    )


def _record_lateness(path: str) -> None:
    """In a companion: write every ``batch_released`` lateness to *path* at exit.

    The values are the companion's own view: the Redis ``TIME`` of the claim
    call (handoff) or of the broker's acknowledgement (generic path) minus the
    due time, in whole milliseconds.
    """
    from celery_zdelay import signals

    batches: list[tuple[str, list[int]]] = []

    def on_released(sender: Any, lateness_ms: list[int], **kwargs: Any) -> None:
        batches.append((kwargs["path"], list(lateness_ms)))

    def dump(**kwargs: Any) -> None:
        with open(path, "w") as out:
            json.dump(batches, out)

    signals.batch_released.connect(on_released, weak=False)
    signals.companion_stopped.connect(dump, weak=False)
    # A companion killed before it could stop cleanly still leaves what it saw.
    atexit.register(lambda: None if os.path.exists(path) else dump())


def _stamp_received(record: str) -> None:
    """In a worker: append ``"r <seq> <ns>"`` to :data:`STAMPS_KEY` as each message arrives."""
    from celery.signals import task_received

    client = redis.Redis.from_url(record)

    def received(request: Any, **kwargs: Any) -> None:
        if request.name == "bench.noop":
            client.rpush(STAMPS_KEY, f"r {request.args[0]} {time.time_ns()}")

    task_received.connect(received, weak=False)


def _profile_releases(path: str) -> None:
    """In a companion: write, per released entry, when it was claimed and released, at exit.

    ``[due_ms, claim_start_ns, claim_end_ns, released_ns]`` for each entry
    (machine clock): the claim call (handoff.lua, or claim.lua) and the
    moment the release was done (the handoff's reply, or the broker's
    acknowledgement of the generic path). Wraps two methods of the release
    pass, in this benchmark's companion only.
    """
    from celery_zdelay import signals
    from celery_zdelay.companion.release import ReleasePass

    rows: list[list[int]] = []
    claims: dict[int, tuple[int, int]] = {}
    claim, released = ReleasePass.claim, ReleasePass._released

    def timed_claim(self: Any, shard: int, **kwargs: Any) -> Any:
        start = time.time_ns()
        result = claim(self, shard, **kwargs)
        end = time.time_ns()
        for due in result.handed_due_ms:
            rows.append([due, start, end, end])
        for entry in result.entries:
            claims[entry.due_ms] = (start, end)
        return result

    def timed_released(self: Any, shard: int, path: str, done: Any, *args: Any) -> None:
        now = time.time_ns()
        for entry, _ in done:
            start, end = claims.pop(entry.due_ms, (now, now))
            rows.append([entry.due_ms, start, end, now])
        released(self, shard, path, done, *args)

    def dump(**kwargs: Any) -> None:
        with open(path, "w") as out:
            json.dump(rows, out)

    ReleasePass.claim = timed_claim  # type: ignore[method-assign]
    ReleasePass._released = timed_released  # type: ignore[method-assign]
    signals.companion_stopped.connect(dump, weak=False)


def _signal_ready(path: str) -> None:
    """In a worker: create *path* once it consumes (workers here log at WARNING)."""
    from celery.signals import worker_ready

    def touch(**kwargs: Any) -> None:
        with open(path, "w"):
            pass

    worker_ready.connect(touch, weak=False)


app = _app_from_env()
if app is not None:
    if os.environ.get("ZBENCH_LATENESS_FILE"):
        _record_lateness(os.environ["ZBENCH_LATENESS_FILE"])
    if os.environ.get("ZBENCH_READY_FILE"):
        _signal_ready(os.environ["ZBENCH_READY_FILE"])
    if os.environ.get("ZBENCH_STAMPS") == "1" and os.environ.get("ZBENCH_RECORD"):
        _stamp_received(os.environ["ZBENCH_RECORD"])
    if os.environ.get("ZBENCH_PROFILE_FILE"):
        _profile_releases(os.environ["ZBENCH_PROFILE_FILE"])
