"""Helpers shared by the benchmarks: run sizes, due times, parking in bulk."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import redis
from celery import Celery

import celery_zdelay

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
#: Tasks parked per ``celery_zdelay.batch`` block when a benchmark parks in bulk.
PARK_CHUNK = 1000


@dataclass(frozen=True)
class Sizes:
    """How big each benchmark is; ``--quick`` and the full run differ only here."""

    #: P1/P2: tasks released per measurement (handoff, generic on Redis).
    release_n: int
    #: P2: tasks released per measurement on RabbitMQ.
    release_rabbit_n: int
    #: Repetitions of each release measurement; the median is reported.
    release_repeat: int
    #: P1 against the limit: tasks moved by the handoff and by a bare Lua move.
    limit_n: int
    #: End to end (native ETA vs celery-zdelay through one worker): tasks, and
    #: the most seconds after the due time the executions are counted.
    e2e_n: int
    e2e_cap_seconds: float
    #: P3: seconds of steady load at ``lateness_rate`` due per second.
    lateness_seconds: float
    lateness_rate: int
    #: P4: tasks due at one instant.
    burst_n: int
    #: P5: calls per round and rounds (at least five, interleaved A, B, A, B...)
    #: of the per-call and bulk comparisons; bulk tasks in all.
    call_n: int
    call_rounds: int
    bulk_n: int
    #: P6/P7: tasks parked / held by the worker.
    memory_n: int
    #: P8: seconds the idle companion is watched.
    idle_seconds: float
    #: Seconds processes are left to settle before a reading.
    settle_seconds: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def spread(values: list[float], *, digits: int = 3) -> dict[str, Any]:
    """The median of *values* with its spread (min, max, interquartile range).

    Ratios are reported this way: one round's ratio on a shared machine moves
    by ±20 %, the median of interleaved rounds with its spread beside it can be
    compared across runs.
    """
    ordered = sorted(values)
    quartiles = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else ordered * 3
    return {
        "median": round(statistics.median(ordered), digits),
        "min": round(ordered[0], digits),
        "max": round(ordered[-1], digits),
        "q1": round(quartiles[0], digits),
        "q3": round(quartiles[2], digits),
        "rounds": [round(v, digits) for v in values],
    }


def percentile(values: list[float], q: float) -> float:
    """The *q* quantile (0..1) of *values*, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


QUICK = Sizes(
    release_n=5_000,
    release_rabbit_n=3_000,
    release_repeat=1,
    limit_n=5_000,
    e2e_n=1_000,
    e2e_cap_seconds=2.0,
    lateness_seconds=3.0,
    lateness_rate=1_000,
    burst_n=10_000,
    call_n=300,
    call_rounds=5,
    bulk_n=5_000,
    memory_n=5_000,
    idle_seconds=3.0,
    settle_seconds=1.0,
)

FULL = Sizes(
    release_n=100_000,
    release_rabbit_n=50_000,
    release_repeat=3,
    limit_n=20_000,
    e2e_n=20_000,
    e2e_cap_seconds=20.0,
    lateness_seconds=30.0,
    lateness_rate=1_000,
    burst_n=100_000,
    call_n=2_000,
    call_rounds=7,
    bulk_n=100_000,
    memory_n=100_000,
    idle_seconds=30.0,
    settle_seconds=3.0,
)


def eta_for(due_ms: int) -> datetime:
    """Return the eta datetime that celery-zdelay parks at exactly *due_ms*.

    The store rounds an eta up to the next millisecond, and a float timestamp
    of a whole millisecond may land a hair above it; one microsecond early
    makes the rounding land on *due_ms* itself.
    """
    return _EPOCH + timedelta(microseconds=due_ms * 1000 - 1)


def redis_now_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def now_ms() -> int:
    """The machine's wall clock in ms: the clock Redis TIME reads on this host."""
    return time.time_ns() // 1_000_000


def park_bulk(app: Celery, n: int, due_ms: Any, *, start: int = 0) -> float:
    """Park *n* ``bench.noop`` tasks in batches; return the seconds it took.

    *due_ms* is one due time for all, or a function of the task's sequence
    number. Each task carries its due time in its arguments.
    """
    noop = app.tasks["bench.noop"]
    due_of = due_ms if callable(due_ms) else (lambda seq: due_ms)
    started = time.perf_counter()
    for chunk_start in range(start, start + n, PARK_CHUNK):
        with celery_zdelay.batch(app):
            for seq in range(chunk_start, min(chunk_start + PARK_CHUNK, start + n)):
                due = due_of(seq)
                noop.apply_delayed((seq, due), eta=eta_for(due))
    return time.perf_counter() - started


def parked_due_range(client: redis.Redis, app: Celery) -> tuple[int, int] | None:
    """Return the (earliest, latest) due ms parked on shard 0, as the store holds them."""
    from celery_zdelay.parking import store_for

    due_key = store_for(app).keys(0).due
    first = client.zrange(due_key, 0, 0, withscores=True)
    last = client.zrange(due_key, -1, -1, withscores=True)
    if not first:
        return None
    return int(first[0][1]) // 1024, int(last[0][1]) // 1024


def quantiles(values: list[float]) -> dict[str, float]:
    """Return p50/p90/p99/p99.9/max/mean/min of *values* (nearest-rank)."""
    if not values:
        return {}
    ordered = sorted(values)

    def rank(p: float) -> float:
        index = max(0, min(len(ordered) - 1, round(p / 100 * len(ordered) + 0.5) - 1))
        return ordered[index]

    return {
        "n": len(ordered),
        "min": round(ordered[0], 3),
        "p50": round(rank(50), 3),
        "p90": round(rank(90), 3),
        "p99": round(rank(99), 3),
        "p99_9": round(rank(99.9), 3),
        "max": round(ordered[-1], 3),
        "mean": round(statistics.fmean(ordered), 3),
    }


def median_run(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Return the run whose *key* is the median (the lower middle one for even counts)."""
    ordered = sorted(runs, key=lambda run: run[key])
    return ordered[(len(ordered) - 1) // 2]


#: A prepared run must be ready this long before its due time to count.
READY_GUARD_MS = 300


def prepare_before_due(
    prepare: Callable[[int], bool],
    reset: Callable[[], None],
    margin_s: float,
    *,
    what: str,
    attempts: int = 3,
) -> int:
    """Run *prepare(due_ms)* with a due time it can finish before; return that due time.

    *prepare* parks or publishes what the benchmark needs, due at *due_ms*,
    and returns whether it is ready. When it is not ready in time (a busy
    machine parks slower than estimated), *reset* undoes it and the next
    attempt allows twice as long as this one took.
    """
    from .infra import BenchmarkError

    for _ in range(attempts):
        due_ms = now_ms() + int(margin_s * 1000)
        started = time.monotonic()
        if prepare(due_ms) and now_ms() < due_ms - READY_GUARD_MS:
            return due_ms
        reset()
        margin_s = (time.monotonic() - started) * 2 + 1.0
    raise BenchmarkError(f"{what}: not ready before the due time in {attempts} attempts")


def release_all(companion: Any, n: int, what: str) -> tuple[int, int]:
    """Run release passes of *companion* until *n* tasks are out; return (passes, handed off).

    A pass that fails or releases nothing stops the benchmark: the store
    holds fewer due entries than it was given, or the broker is gone.
    """
    from .infra import BenchmarkError

    released = passes = handed_off = 0
    while released < n:
        passes += 1
        report = companion.release_due()
        if report.failed or report.released == 0:
            raise BenchmarkError(f"{what}: release stalled at {released}/{n}")
        released += report.released
        handed_off += report.handed_off
    return passes, handed_off


def wait_for_list(
    client: redis.Redis, queue: str, n: int, deadline: float, what: str
) -> tuple[int | None, int]:
    """Poll broker list *queue* until it holds *n* messages, every 2 ms, until *deadline*.

    Returns (epoch ms the first message was seen, epoch ms all were): the
    burst benchmarks' "due until all in the broker".
    """
    from .infra import BenchmarkError

    first_ms = None
    while True:
        count = int(client.llen(queue))
        stamp = now_ms()
        if count and first_ms is None:
            first_ms = stamp
        if count >= n:
            return first_ms, stamp
        if time.monotonic() > deadline:
            raise BenchmarkError(f"{what}: {count:,} of {n:,} released within the deadline")
        time.sleep(0.002)
