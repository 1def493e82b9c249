"""P3/P4: how late tasks reach the broker, steady and in a burst.

Both run a real companion process (``celery -A benchmarks.proj zdelay``).

P3, steady load
    ``rate`` tasks per second are parked (before the first is due) with due
    times ``T0 + i / rate``; the companion releases them as they fall due.
    A consumer thread in this process BRPOPs the kombu list and stamps each
    message with the machine clock as the pop returns; lateness = that stamp
    - the due time carried in the task's arguments. Redis runs on this
    machine, so its TIME (which decides due-ness) and this stamp read the
    same clock. The figure is an upper bound of "reached the broker - due":
    it includes the consumer's own wake-up. The companion's self-report (its
    ``batch_released`` signal: Redis TIME at the claim call minus due, whole
    ms) is recorded beside it.

P4, burst
    N tasks are parked due at one instant T; time from T until the kombu list
    holds all N (LLEN polled every 2 ms).

Redis time of every script call comes from SLOWLOG (see ``ScriptTimer``).
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from celery_zdelay.parking import store_for

from .common import (
    PARK_CHUNK,
    Sizes,
    now_ms,
    park_bulk,
    parked_due_range,
    prepare_before_due,
    quantiles,
    wait_for_list,
)
from .infra import (
    BenchmarkError,
    CeleryProcess,
    MachineLoad,
    Resources,
    ScriptTimer,
    cpu_seconds,
    wait_for,
)
from .proj import make_app

#: Seconds between the end of parking and the first due time.
LEAD_SECONDS = 1.0


def run_lateness(
    sizes: Sizes, path: str = "handoff", *, on_start: Callable[[int, float], Any] | None = None
) -> dict[str, Any]:
    """P3: lateness of each task at a steady due rate, through a real companion.

    *on_start* is called with the companion's pid and the seconds until the
    last task is due, just before the first is due (the profiler hooks in here).
    """
    rate = sizes.lateness_rate
    n = int(rate * sizes.lateness_seconds)
    with Resources() as res:
        store_server = res.redis()
        store_url = f"{store_server.url}/0"
        broker = store_url if path == "handoff" else f"{res.redis().url}/0"
        app = make_app(broker=broker, store=store_url)
        res.callback(app.close)
        store = store_server.client()
        broker_client = redis.Redis.from_url(broker)
        res.callback(store.close)
        res.callback(broker_client.close)
        companion = _Companion(res, app)
        interval_us = 1_000_000 // rate

        def prepare(t0: int) -> bool:
            park_bulk(app, n, lambda seq: t0 + seq * interval_us // 1000)
            return True

        def reset() -> None:
            companion.stop()
            store.flushdb()
            broker_client.flushdb()
            companion.start()

        t0 = prepare_before_due(prepare, reset, _parking_margin(app, n), what="lateness: parking")

        def due_of(seq: int) -> int:
            return t0 + seq * interval_us // 1000

        if parked_due_range(store, app) != (due_of(0), due_of(n - 1)):
            raise BenchmarkError("parked due times differ from the ones meant")
        timer = ScriptTimer(store)
        if on_start is not None:
            on_start(companion.pid, (due_of(n - 1) - now_ms()) / 1000 + 0.5)
        consumer = _Consumer(broker_client, "bench", n, deadline_ms=due_of(n - 1) + 30_000)
        consumer.start()
        load = MachineLoad()
        assert store_server._process is not None
        cpu_pids = {"companion": companion.pid, "store_redis": store_server._process.pid}
        cpu_before = {name: cpu_seconds(pid) for name, pid in cpu_pids.items()}
        wall_started = time.monotonic()
        consumer.join()
        wall = time.monotonic() - wall_started
        cpu = {
            f"{name}_cpu_pct": round(100 * (cpu_seconds(pid) - cpu_before[name]) / wall, 1)
            for name, pid in cpu_pids.items()
        }
        machine = load.stop()
        scripts = timer.summary()
        companion.stop()
        observed, early = consumer.lateness_ms()
        reported = _reported_lateness(companion.lateness_file)
    if len(observed) != n:
        raise BenchmarkError(f"the consumer saw {len(observed)} of {n} messages")
    return {
        "path": path,
        "rate": rate,
        "seconds": sizes.lateness_seconds,
        "n": n,
        "observed_ms": quantiles(observed),
        "early": early,
        "reported_ms": quantiles([float(x) for x in reported]),
        "redis_scripts": scripts,
        # CPU of the companion process and of the store's redis-server while
        # the tasks fell due (from the first due until the consumer had all).
        "cpu": cpu,
        "machine": machine,
        # Kept for the plot; rounded to microseconds.
        "samples_ms": [round(x, 3) for x in observed],
    }


def run_burst(sizes: Sizes) -> dict[str, Any]:
    """P4: N tasks due at one instant, all handed off; seconds from due to the last."""
    n = sizes.burst_n
    with Resources() as res:
        _, app, client = res.redis_app()
        companion = _Companion(res, app)

        def prepare(due_ms: int) -> bool:
            park_bulk(app, n, due_ms)
            return True

        def reset() -> None:
            companion.stop()
            client.flushdb()
            companion.start()

        due_ms = prepare_before_due(prepare, reset, _parking_margin(app, n), what="burst: parking")
        timer = ScriptTimer(client)
        time.sleep(max(0.0, (due_ms - now_ms()) / 1000 - 0.05))
        load = MachineLoad()
        deadline = time.monotonic() + 60 + n / 1000
        first_ms, stamp = wait_for_list(client, "bench", n, deadline, "burst")
        machine = load.stop()
        scripts = timer.summary()
        companion.stop()
        reported = _reported_lateness(companion.lateness_file)
    return {
        "n": n,
        "seconds": round((stamp - due_ms) / 1000, 3),
        "first_seen_ms": None if first_ms is None else first_ms - due_ms,
        "rate": round(n / max((stamp - due_ms) / 1000, 1e-3)),
        "reported_ms": quantiles([float(x) for x in reported]),
        "redis_scripts": scripts,
        "machine": machine,
    }


def _parking_margin(app: Any, n: int) -> float:
    """Return seconds that should be enough to park *n* tasks (retried if not).

    The parking rate is sampled on a twin app whose entries live under
    another key prefix, so the companion never sees them.
    """
    sample = min(PARK_CHUNK, n)
    twin = make_app(
        broker=app.conf.broker_url,
        store=app.conf.zdelay_redis_url,
        conf={"zdelay_key_prefix": "zbench-sample"},
    )
    try:
        seconds = park_bulk(twin, sample, now_ms() + 86_400_000)
    finally:
        store_for(twin).close()
        twin.close()
    return seconds / sample * n * 1.5 + LEAD_SECONDS


class _Companion:
    """A ``celery zdelay`` process that writes its self-reported lateness to a file."""

    def __init__(self, res: Resources, app: Any) -> None:
        self.res, self.app = res, app
        self.process: CeleryProcess | None = None
        self.lateness_file = ""
        self.start()

    def start(self) -> None:
        self.lateness_file = _temp_path(self.res)
        self.process = self.res.companion(
            self.app, env={"ZBENCH_LATENESS_FILE": self.lateness_file}
        )

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


class _Consumer(threading.Thread):
    """BRPOPs the kombu list and stamps each message as the pop returns."""

    def __init__(self, client: redis.Redis, key: str, n: int, *, deadline_ms: int) -> None:
        super().__init__(name="zbench-consumer", daemon=True)
        self.client = client
        self.key = key
        self.n = n
        self.deadline_ms = deadline_ms
        self.received: list[tuple[int, bytes]] = []

    def run(self) -> None:
        brpop = self.client.brpop
        received = self.received
        while len(received) < self.n and now_ms() < self.deadline_ms:
            item = brpop([self.key], timeout=1)
            stamp_ns = time.time_ns()
            if item is not None:
                received.append((stamp_ns, item[1]))

    def lateness_ms(self) -> tuple[list[float], int]:
        """Return each message's lateness in ms, and how many arrived early."""
        values = []
        for stamp_ns, raw in self.received:
            envelope = json.loads(raw)
            args = json.loads(base64.b64decode(envelope["body"]))[0]
            values.append(stamp_ns / 1e6 - int(args[1]))
        return values, sum(1 for v in values if v < 0)


def _temp_path(res: Resources) -> str:
    fd, name = tempfile.mkstemp(prefix="zbench-lateness-", suffix=".json")
    os.close(fd)
    os.unlink(name)
    res.callback(Path(name).unlink, True)
    return name


def _reported_lateness(path: str) -> list[int]:
    """Return the lateness the companion's batch_released signal reported."""
    try:
        wait_for(lambda: os.path.exists(path), timeout=10, what="the companion's lateness file")
        batches = json.loads(Path(path).read_text())
    except (BenchmarkError, ValueError):
        return []
    return [value for _, values in batches for value in values]
