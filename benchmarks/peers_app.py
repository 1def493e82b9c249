"""The app of each system :mod:`benchmarks.peers` compares, and its producer.

This module runs in the benchmark's virtualenv and in the competitors' own
(celery-redis-plus needs Python 3.13), so it imports only Celery, redis-py
and, for the system it is asked for, that system's package. Everything comes
from ``ZPEERS_*`` environment variables:

``ZPEERS_SYSTEM``
    one of :data:`SYSTEMS`;
``ZPEERS_BROKER``, ``ZPEERS_STORE``
    broker URL and, for celery-zdelay and celery-longterm-scheduler, the Redis
    that holds the waiting tasks;
``ZPEERS_RECORD``
    a Redis of the benchmark's own: each run of ``peers.stamp`` appends
    ``"<seq> <started µs>"`` to :data:`RUNS_KEY` there (the machine's clock);
``ZPEERS_EVENTS``
    ``1``: Celery's task events on (``worker_send_task_events`` and
    ``task_send_sent_event``), as Flower's documentation asks; off otherwise.

Workers and companions: ``celery -A benchmarks.peers_app worker|zdelay``.
The producer: ``python -m benchmarks.peers_app schedule|act|mark`` reads a JSON
request on stdin and writes a JSON answer on stdout, so the benchmark drives
every system the same way, whatever interpreter it needs.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import redis
from celery import Celery

#: List each execution of ``peers.stamp`` appends ``"<seq> <µs>"`` to.
RUNS_KEY = "zpeers:runs"
#: Queue (and topic exchange, routing key) of every system.
QUEUE = "zpeers"

#: The systems compared: name -> how its tasks wait.
SYSTEMS = {
    "native-redis": "Celery native ETA, Redis broker",
    "rabbitmq-delayed": "Celery native delayed delivery, RabbitMQ quorum queue",
    "redis-plus": "celery-redis-plus, Redis broker",
    "longterm": "celery-longterm-scheduler, Redis broker",
    "zdelay-redis": "celery-zdelay, Redis broker (handoff)",
    "zdelay-rabbitmq": "celery-zdelay, RabbitMQ quorum queue",
}
#: zdelay_release_ahead_seconds of the "-ahead" systems: the due time goes
#: in the message's eta, and the worker's timer starts the task then.
#: ZPEERS_RELEASE_AHEAD_S overrides it (the systems' labels say how far).
RELEASE_AHEAD_S = float(os.environ.get("ZPEERS_RELEASE_AHEAD_S", "0.02"))
SYSTEMS.update(
    {
        "zdelay-redis-ahead": (
            f"celery-zdelay, Redis broker, released {RELEASE_AHEAD_S * 1000:g} ms ahead"
        ),
        "zdelay-rabbitmq-ahead": (
            f"celery-zdelay, RabbitMQ quorum queue, released {RELEASE_AHEAD_S * 1000:g} ms ahead"
        ),
    }
)

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def task_id(seq: int) -> str:
    """Every system gets the same deterministic id per task, so actions name it."""
    return f"zpeers-{seq}"


def eta_of(due_ms: int) -> datetime:
    return _EPOCH + timedelta(milliseconds=due_ms)


def make_app(system: str, broker: str, store: str, record: str, *, events: bool = False) -> Celery:
    """Return *system*'s app, configured as that system's documentation says."""
    if system not in SYSTEMS:
        raise SystemExit(f"unknown system {system!r}; one of {', '.join(SYSTEMS)}")
    task_cls = "celery.app.task:Task"
    if system.startswith("zdelay"):
        task_cls = "celery_zdelay:Task"
    elif system == "longterm":
        task_cls = "celery_longterm_scheduler:Task"
    # The current app: celery-longterm-scheduler looks the task up in it when it releases.
    app = Celery("zpeers", broker=broker, task_cls=task_cls)
    app.conf.update(
        task_default_queue=QUEUE,
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        worker_send_task_events=events,
        task_send_sent_event=events,
    )
    if "rabbitmq" in system:
        from kombu import Exchange, Queue

        # Celery's "Using Quorum Queues" (RabbitMQ broker guide): quorum queues
        # need publisher confirms, and native delayed delivery needs a topic
        # (not direct) exchange; worker_detect_quorum_queues is on by default.
        app.conf.update(
            task_queues=[
                Queue(
                    QUEUE,
                    Exchange(QUEUE, type="topic"),
                    routing_key=QUEUE,
                    queue_arguments={"x-queue-type": "quorum"},
                )
            ],
            task_default_exchange=QUEUE,
            task_default_exchange_type="topic",
            task_default_routing_key=QUEUE,
            broker_transport_options={"confirm_publish": True},
            worker_detect_quorum_queues=True,
        )
    if system == "redis-plus":
        import celery_redis_plus  # noqa: F401  (registers the transport)

        # Its README: a redis:// URL with broker_transport set to its Transport.
        app.conf.broker_transport = "celery_redis_plus.transport:Transport"
    if system.startswith("zdelay"):
        app.conf.zdelay_redis_url = store
    if system.endswith("-ahead"):
        app.conf.zdelay_release_ahead_seconds = RELEASE_AHEAD_S
    if system == "longterm":
        app.conf.longterm_scheduler_backend = store

    recorder: list[redis.Redis] = []

    @app.task(name="peers.stamp", shared=False)
    def stamp(seq: int, due_ms: int) -> None:
        started_us = time.time_ns() // 1000
        if not recorder:
            recorder.append(redis.Redis.from_url(record))
        recorder[0].rpush(RUNS_KEY, f"{seq} {started_us}")

    return app


def _app_from_env() -> Celery | None:
    system = os.environ.get("ZPEERS_SYSTEM")
    if not system:
        return None
    return make_app(
        system,
        os.environ["ZPEERS_BROKER"],
        os.environ.get("ZPEERS_STORE", ""),
        os.environ["ZPEERS_RECORD"],
        events=os.environ.get("ZPEERS_EVENTS") == "1",
    )


def _signal_ready(path: str) -> None:
    from celery.signals import worker_ready

    def touch(**kwargs: Any) -> None:
        with open(path, "w"):
            pass

    worker_ready.connect(touch, weak=False)


# -- the producer ---------------------------------------------------------------


def schedule(app: Celery, system: str, tasks: list[list[int]]) -> dict[str, Any]:
    """Schedule ``[seq, due_ms]`` pairs the way *system*'s users do; time it."""
    stamp = app.tasks["peers.stamp"]
    started = time.perf_counter()
    if system.startswith("zdelay"):
        import celery_zdelay

        for start in range(0, len(tasks), 1000):
            with celery_zdelay.batch(app):
                for seq, due_ms in tasks[start : start + 1000]:
                    stamp.apply_delayed((seq, due_ms), eta=eta_of(due_ms), task_id=task_id(seq))
    else:
        # One connection for all, except for celery-longterm-scheduler, which
        # stores every apply_async argument (a producer too) for its release.
        with contextlib.ExitStack() as stack:
            producer = None
            if system != "longterm":
                producer = stack.enter_context(app.producer_or_acquire())
            for seq, due_ms in tasks:
                stamp.apply_async(
                    (seq, due_ms), eta=eta_of(due_ms), task_id=task_id(seq), producer=producer
                )
    return {"seconds": round(time.perf_counter() - started, 3), "n": len(tasks)}


def _ms() -> int:
    return time.time_ns() // 1_000_000


def act(app: Celery, system: str, request: dict[str, Any]) -> dict[str, Any]:
    """Try what a user can do with a scheduled task; say what happened.

    ``list``: is the id of a scheduled task in what the system lists as
    scheduled? ``cancel``: the system's way to cancel one task (checked later
    by the benchmark: it must not run). ``reschedule``: move one task to
    another due time (checked later: it runs then, once).
    """
    answer: dict[str, Any] = {}
    listed, cancel, move = request["list"], request["cancel"], request["reschedule"]
    if system.startswith("zdelay"):
        import celery_zdelay
        from celery_zdelay.parking import store_for
        from celery_zdelay.store.listing import list_parked

        # What `celery -A proj zdelay list --due-after/--due-before` reads.
        listing = list_parked(
            store_for(app),
            due_after_ms=request["list_due_ms"],
            due_before_ms=request["list_due_ms"] + 1,
            limit=10_000,
        )
        ids = {entry.task_id for entry in listing.entries}
        answer["list"] = {"how": "celery -A proj zdelay list", "listed": task_id(listed) in ids}
        answer["cancel"] = {
            "how": "celery_zdelay.cancel(id)",
            "accepted": bool(celery_zdelay.cancel(task_id(cancel), app=app)),
            "at_ms": _ms(),
        }
        answer["reschedule"] = {
            "how": "celery_zdelay.reschedule(id, eta=...)",
            "accepted": bool(
                celery_zdelay.reschedule(task_id(move["seq"]), eta=eta_of(move["due_ms"]), app=app)
            ),
        }
        return answer
    if system == "longterm":
        from celery_longterm_scheduler import get_scheduler

        answer["list"] = {"how": "no listing API", "listed": False}
        answer["cancel"] = {
            "how": "get_scheduler(app).revoke(id)",
            "accepted": bool(get_scheduler(app).revoke(task_id(cancel))),
            "at_ms": _ms(),
        }
        answer["reschedule"] = {"how": "no API", "accepted": False}
        return answer
    # Celery's own means, the same on native ETA, RabbitMQ delayed delivery
    # and celery-redis-plus: revoke() makes each worker drop the id when it
    # receives it; inspect().scheduled() asks the workers what they hold.
    app.control.revoke(task_id(cancel))
    answer["cancel"] = {"how": "app.control.revoke(id)", "accepted": True, "at_ms": _ms()}
    # A worker holding thousands of ETA tasks replies with all of them: give it time.
    replies = app.control.inspect(timeout=5.0).scheduled() or {}
    held = {entry.get("request", {}).get("id") for entries in replies.values() for entry in entries}
    answer["list"] = {"how": "app.control.inspect().scheduled()", "listed": task_id(listed) in held}
    # Whether the worker took the revoke in (it keeps revoked ids in memory).
    revoked = app.control.inspect(timeout=3.0).revoked() or {}
    answer["cancel"]["worker_knows"] = any(task_id(cancel) in ids for ids in revoked.values())
    answer["reschedule"] = {"how": "no API (revoke, then send a new task)", "accepted": False}
    return answer


def mark(app: Celery, marker: str) -> dict[str, Any]:
    """Send one ``task-sent`` event named *marker*: Flower shows it once it listens."""
    with app.events.default_dispatcher() as dispatcher:
        dispatcher.send("task-sent", uuid=marker, name="zpeers.marker")
    return {"sent": marker}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if app is None or len(args) != 1 or args[0] not in ("schedule", "act", "mark"):
        print(
            "usage: ZPEERS_SYSTEM=... python -m benchmarks.peers_app schedule|act|mark"
            " < request.json"
        )
        return 2
    system = os.environ["ZPEERS_SYSTEM"]
    request = json.load(sys.stdin)
    try:
        if args[0] == "schedule":
            answer = schedule(app, system, request["tasks"])
        elif args[0] == "mark":
            answer = mark(app, request["marker"])
        else:
            answer = act(app, system, request)
    finally:
        app.close()
    json.dump(answer, sys.stdout)
    return 0


app = _app_from_env()
if app is not None and os.environ.get("ZBENCH_READY_FILE"):
    _signal_ready(os.environ["ZBENCH_READY_FILE"])

if __name__ == "__main__":
    sys.exit(main())
