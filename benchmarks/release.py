"""P1/P2: release rate of one companion, and the native ETA path beside it.

Release rate
    N tasks are parked already due; ``Companion(app).release_due()`` (the
    pass the ``celery zdelay`` loop runs) is timed in this process from call
    to return, and every message is then counted in the broker (LLEN of the
    kombu list, or the RabbitMQ queue's message count). Three brokers:

    * handoff: the broker is the store's own Redis database (handoff.lua);
    * generic, Redis: the broker is another redis-server (claim.lua, kombu's
      batch publishing, ack.lua);
    * generic, RabbitMQ: publisher confirms, collected per batch (what the
      companion does);
    * generic, RabbitMQ, unconfirmed: the same publishes without confirms,
      beside it in the same run, to show what the confirms cost. The
      companion never runs this way.

    Redis-side cost comes from INFO commandstats (EVALSHA calls and their
    server time) on the store.

Native ETA, end to end
    Celery's native path has no release step: the message sits in the worker
    from the start, and "release" is the worker's timer turning a held ETA
    task into an execution. So the comparison is end to end on equal terms:
    N tasks due at one instant T, one solo worker, rate = N / (time the
    N-th execution finished - T). Native: the worker holds all N before T
    (checked). celery-zdelay: a ``celery zdelay`` process hands them into the
    queue at T and the same kind of worker runs them. Both count executions
    with one INCR per run in a separate Redis database.
"""

from __future__ import annotations

import time
from typing import Any

from kombu import Connection

from celery_zdelay.companion import Companion
from celery_zdelay.companion.publish import Publisher

from .common import (
    READY_GUARD_MS,
    Sizes,
    eta_for,
    median_run,
    now_ms,
    park_bulk,
    prepare_before_due,
    release_all,
)
from .infra import (
    RABBITMQ_URL,
    BenchmarkError,
    MachineLoad,
    Resources,
    ScriptTimer,
    reset_stats,
    script_stats,
    unique,
)
from .proj import DONE_KEY, make_app

MODES = ("handoff", "generic-redis", "generic-rabbitmq", "generic-rabbitmq-unconfirmed")


def release_rate(
    mode: str, n: int, *, repeat: int = 1, profiler: Any = None
) -> list[dict[str, Any]]:
    """Park *n* due tasks, then time one companion releasing them all (in-process).

    The tasks are parked once; for each of *repeat* runs the store's keys are
    restored from a DUMP taken after parking and the broker's queue emptied,
    so every run releases the same *n* entries. *profiler* (a
    ``cProfile.Profile``) is enabled around the releases only.
    """
    with Resources() as res:
        store_server = res.redis()
        store_url = f"{store_server.url}/0"
        queue = unique("zbench") if is_rabbit(mode) else "bench"
        if mode == "handoff":
            broker = store_url
        elif mode == "generic-redis":
            broker = f"{res.redis().url}/0"
        else:
            broker = RABBITMQ_URL
        app = make_app(broker=broker, store=store_url, queue=queue)
        res.callback(app.close)
        store = store_server.client()
        res.callback(store.close)
        if is_rabbit(mode):
            _declare_rabbit_queue(app, queue)
            res.callback(_delete_rabbit_queue, app, queue)

        companion = Companion(app)
        if mode == "generic-rabbitmq-unconfirmed":
            # The comparison only: kombu's plain publish, acked on send.
            companion.publisher = Publisher(app, broker_wait=companion.lease_ms / 2000)
        res.callback(companion.close)
        # Connected and past handoff detection before the clock starts, as a
        # running companion is.
        companion.release_due()
        companion.publisher.publish([])
        park_s = park_bulk(app, n, now_ms() - 1000)
        # Keys that expired between KEYS and DUMP (park retry markers) are left out.
        dumps = {key: store.dump(key) for key in store.keys("*")}
        snapshot = {key: value for key, value in dumps.items() if value is not None}
        runs = []
        for run_no in range(repeat):
            if run_no:
                _empty_broker(mode, app, queue, broker)
                store.flushdb()
                for key, value in snapshot.items():
                    store.restore(key, 0, value)
            runs.append(_release_once(mode, n, app, queue, broker, companion, store, profiler))
            runs[-1]["park_seconds"] = round(park_s, 3)
        return runs


def _release_once(
    mode: str,
    n: int,
    app: Any,
    queue: str,
    broker: str,
    companion: Companion,
    store: Any,
    profiler: Any,
) -> dict[str, Any]:
    before = (companion.totals.handed_off, companion.totals.published)
    reset_stats(store)
    timer = ScriptTimer(store)
    load = MachineLoad()
    if profiler is not None:
        profiler.enable()
    started = time.perf_counter()
    passes, _ = release_all(companion, n, mode)
    seconds = time.perf_counter() - started
    if profiler is not None:
        profiler.disable()
    machine = load.stop()
    stats = script_stats(store)
    per_script = timer.summary()
    in_broker = _count_in_broker(mode, app, queue, broker)
    if in_broker != n:
        raise BenchmarkError(f"{mode}: {in_broker} messages in the broker, expected {n}")
    return {
        "mode": mode,
        "n": n,
        "seconds": round(seconds, 4),
        "rate": round(n / seconds),
        "handoff_state": companion.handoff_state,
        "publisher": type(companion.publisher).__name__,
        "passes": passes,
        "handed_off": companion.totals.handed_off - before[0],
        "published": companion.totals.published - before[1],
        "redis_scripts": stats,
        "redis_script_calls": per_script,
        "machine": machine,
    }


def run_release(sizes: Sizes, modes: tuple[str, ...] = MODES) -> dict[str, Any]:
    """P1/P2: the release rate on each path, median of ``release_repeat`` runs."""
    results: dict[str, Any] = {}
    for mode in modes:
        n = sizes.release_rabbit_n if is_rabbit(mode) else sizes.release_n
        try:
            runs = release_rate(mode, n, repeat=sizes.release_repeat)
        except BenchmarkError as exc:
            results[mode] = {"error": str(exc)}
            continue
        best = median_run(runs, "rate")
        results[mode] = {**best, "runs": [run["rate"] for run in runs]}
    return results


#: Worker pools the end-to-end comparison runs: (name, pool, concurrency).
E2E_POOLS = (("solo", "solo", 1), ("prefork-2", "prefork", 2))


def run_end_to_end(sizes: Sizes) -> dict[str, Any]:
    """N tasks due at one instant, executed by one worker: native ETA vs celery-zdelay.

    Per pool, one Redis and one worker serve both: celery-zdelay first (it
    always runs to completion), then native ETA (which may hit the time cap
    and leave tasks behind in the worker).
    """
    results: dict[str, Any] = {}
    for label, pool, concurrency in E2E_POOLS:
        meta = {"pool": pool, "concurrency": concurrency}
        with Resources() as res:
            server = res.redis()
            url = f"{server.url}/0"
            app = make_app(broker=url, store=url, record=f"{server.url}/1")
            res.callback(app.close)
            client, record = server.client(0), server.client(1)
            res.callback(client.close)
            res.callback(record.close)
            e2e = _EndToEnd(res, app, client, record, sizes, pool, concurrency)
            for kind, measure in (("zdelay", e2e.zdelay), ("native", e2e.native)):
                try:
                    result = measure()
                except BenchmarkError as exc:
                    result = {"error": str(exc)}
                results[f"{kind}-{label}"] = {**meta, **result}
    order = [f"{kind}-{label}" for label, _, _ in E2E_POOLS for kind in ("native", "zdelay")]
    return {key: results[key] for key in order if key in results}


class _EndToEnd:
    """One pool's end-to-end runs on one Redis; restarts the worker when needed."""

    def __init__(
        self,
        res: Resources,
        app: Any,
        client: Any,
        record: Any,
        sizes: Sizes,
        pool: str,
        concurrency: int,
    ) -> None:
        self.res, self.app, self.client, self.record = res, app, client, record
        self.sizes, self.pool, self.concurrency = sizes, pool, concurrency
        self.worker: Any = None

    def _start_worker(self) -> None:
        self.worker = self.res.worker(self.app, pool=self.pool, concurrency=self.concurrency)
        # A warm stop would restore every held task to the queue: not measured.
        self.res.callback(lambda worker=self.worker: worker.stop(timeout=5, kill=True))

    def _restart_clean(self) -> None:
        """Kill the worker (and what it holds), empty Redis, start a fresh worker."""
        if self.worker is not None:
            self.worker.stop(timeout=5, kill=True)
        self.client.flushall()
        self._start_worker()

    def zdelay(self) -> dict[str, Any]:
        n = self.sizes.e2e_n
        if self.worker is None:
            self._start_worker()
        companion = self.res.companion(self.app)

        def prepare(due_ms: int) -> bool:
            park_bulk(self.app, n, due_ms)
            return True

        def reset() -> None:
            self.client.flushdb()
            time.sleep(1)  # let the few tasks a worker prefetched finish
            self.record.delete(DONE_KEY)

        self.record.delete(DONE_KEY)
        due_ms = prepare_before_due(prepare, reset, 1.0 + n / 5000, what="celery-zdelay e2e")
        result = _measure_executions(self.record, n, due_ms, self.sizes.e2e_cap_seconds)
        companion.stop()
        return result

    def native(self) -> dict[str, Any]:
        n = self.sizes.e2e_n
        noop = self.app.tasks["bench.noop"]

        def prepare(due_ms: int) -> bool:
            with self.app.producer_or_acquire() as producer:
                for seq in range(n):
                    noop.apply_async((seq, due_ms), eta=eta_for(due_ms), producer=producer)
            # The worker must hold every task before they are due.
            deadline = due_ms - READY_GUARD_MS
            while now_ms() < deadline:
                if self.client.hlen("unacked") >= n:
                    return True
                time.sleep(0.05)
            return False

        if self.worker is None or self.client.llen("bench") or self.client.hlen("unacked"):
            self._restart_clean()  # no tasks left over from the celery-zdelay run
        self.record.delete(DONE_KEY)
        due_ms = prepare_before_due(
            prepare, self._restart_clean, 1.5 + n / 1500, what="native ETA e2e"
        )
        return _measure_executions(self.record, n, due_ms, self.sizes.e2e_cap_seconds)


def _measure_executions(record: Any, n: int, due_ms: int, cap_s: float) -> dict[str, Any]:
    """Wait until *n* executions or *cap_s* seconds after the due time; return the rate."""

    def done() -> int:
        return int(record.get(DONE_KEY) or 0)

    time.sleep(max(0.0, (due_ms - now_ms()) / 1000))
    load = MachineLoad()
    deadline_ms = due_ms + int(cap_s * 1000)
    executed = done()
    while executed < n and now_ms() < deadline_ms:
        time.sleep(0.005)
        executed = done()
    end_ms = now_ms()
    seconds = (end_ms - due_ms) / 1000
    return {
        "n": n,
        "executed": executed,
        "completed": executed >= n,
        "seconds_after_due": round(seconds, 3),
        "rate": round(executed / seconds) if seconds > 0 else None,
        "machine": load.stop(),
    }


def _declare_rabbit_queue(app: Any, name: str) -> None:
    with Connection(RABBITMQ_URL) as connection:
        app.amqp.queues[name].bind(connection.default_channel).declare()


def _delete_rabbit_queue(app: Any, name: str) -> None:
    with Connection(RABBITMQ_URL) as connection:
        app.amqp.queues[name].bind(connection.default_channel).delete()


def is_rabbit(mode: str) -> bool:
    """Whether *mode* publishes to RabbitMQ."""
    return mode.startswith("generic-rabbitmq")


def _empty_broker(mode: str, app: Any, queue: str, broker: str) -> None:
    if is_rabbit(mode):
        with Connection(RABBITMQ_URL) as connection:
            app.amqp.queues[queue].bind(connection.default_channel).purge()
        return
    import redis

    client = redis.Redis.from_url(broker)
    try:
        client.delete(queue)
    finally:
        client.close()


def _count_in_broker(mode: str, app: Any, queue: str, broker: str) -> int:
    if is_rabbit(mode):
        with Connection(RABBITMQ_URL) as connection:
            bound = app.amqp.queues[queue].bind(connection.default_channel)
            return int(bound.queue_declare(passive=True).message_count)
    import redis

    client = redis.Redis.from_url(broker)
    try:
        return int(client.llen(queue))
    finally:
        client.close()
