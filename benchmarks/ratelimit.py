"""Release control: the rate a global limit achieves, measured at the broker.

Three real ``celery zdelay`` processes share one private Redis (broker =
store, 4 shards) with ``zdelay_rate_limits = {"queue:bench": "<rate>/s"}``.
``rate x seconds + burst`` tasks of the limited queue and as many of an
unlimited queue fall due at one instant. A thread takes every message out of
both queue lists as it arrives (BRPOP, the oldest first) and notes when.

With ``cluster=True`` (``--only ratelimit_cluster``) the store is a 3-master
Redis Cluster (the 4 shards and the limit's bucket spread over its nodes) and
the broker a Redis of its own, which the tap reads.

Reported: the rate achieved after the first second (the burst), the count of
each 5 s window after it against the limit, the most in any 5 s span against
``burst + 5 x rate``, and when the unlimited queue's last task arrived.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import redis

import celery_zdelay

from .common import Sizes, eta_for, now_ms, park_bulk
from .infra import MachineLoad, Resources
from .proj import DEFAULT_QUEUE, make_app

#: The limit of the run (the figure issue 24 names).
RATE = 200
#: The queue without a limit, in the same run.
FREE_QUEUE = "bench-free"
WINDOW_S = 5.0


def run_ratelimit(
    sizes: Sizes, *, cluster: bool = False, rate: int = RATE, seconds: float | None = None
) -> dict[str, Any]:
    """Measure *rate*/s over *seconds* (default 10 s quick, 60 s full) at the broker.

    *rate* and *seconds* other than the defaults serve one-off runs, such as
    P4's 100,000 tasks due at one instant under a limit (``rate=1000,
    seconds=99``).
    """
    seconds = seconds or max(10.0, 2 * sizes.lateness_seconds)
    burst = rate
    n = int(rate * seconds) + burst
    with Resources() as res:
        server = res.redis()
        url = f"{server.url}/0"
        store = res.redis_cluster(3) if cluster else url
        conf = {"zdelay_shards": 4, "zdelay_rate_limits": {f"queue:{DEFAULT_QUEUE}": f"{rate}/s"}}
        app = make_app(broker=url, store=store, conf=conf)
        res.callback(app.close)
        for _ in range(3):
            res.companion(app)
        client = redis.Redis.from_url(url)
        res.callback(client.close)
        arrivals: dict[str, list[float]] = {DEFAULT_QUEUE: [], FREE_QUEUE: []}
        stop = threading.Event()

        def tap() -> None:
            while not stop.is_set():
                popped = client.brpop([DEFAULT_QUEUE, FREE_QUEUE], timeout=0.2)
                if popped is not None:
                    arrivals[popped[0].decode()].append(time.monotonic())

        thread = threading.Thread(target=tap, daemon=True)
        thread.start()
        # Everything is parked well before it is due: parking in this process
        # while releases run would hold the tap back and bunch its readings.
        # The margin is twice the time parking takes here, timed on a probe
        # of tasks due in an hour (a loaded 2-core machine, or a Cluster store,
        # parks 14,200 tasks in 15-40 s; a quiet one in a few).
        free_n = min(n, 2_000)
        probe_n = 500
        probe_s = park_bulk(app, probe_n, now_ms() + 3_600_000, start=n)
        park_s = probe_s * (n + free_n) / probe_n
        due = now_ms() + 3_000 + round(2_000 * park_s)
        noop = app.tasks["bench.noop"]
        with celery_zdelay.batch(app):
            for seq in range(free_n):
                noop.apply_delayed((seq, due), eta=eta_for(due), queue=FREE_QUEUE)
        park_bulk(app, n, due)
        if now_ms() >= due:
            stop.set()
            thread.join(timeout=5)
            return {"error": "parking took longer than the margin before the due time"}
        load = MachineLoad()
        deadline = time.monotonic() + seconds * 3 + 30
        while (
            len(arrivals[DEFAULT_QUEUE]) < n or len(arrivals[FREE_QUEUE]) < free_n
        ) and time.monotonic() < deadline:
            time.sleep(0.1)
        machine = load.stop()
        stop.set()
        thread.join(timeout=5)
    limited = sorted(arrivals[DEFAULT_QUEUE])
    free = sorted(arrivals[FREE_QUEUE])
    if len(limited) < n:
        return {"error": f"only {len(limited)} of {n} limited tasks arrived", "machine": machine}
    first, last = limited[0], limited[-1]
    after = [t for t in limited if t >= first + 1.0]
    achieved = len(after) / (last - first - 1.0)
    windows = []
    start = first + 1.0
    while start + WINDOW_S <= last:
        windows.append(sum(1 for t in limited if start <= t < start + WINDOW_S))
        start += WINDOW_S
    most, lo = 0, 0
    for hi, t in enumerate(limited):
        while t - limited[lo] > WINDOW_S:
            lo += 1
        most = max(most, hi - lo + 1)
    expected = rate * WINDOW_S
    return {
        "rate": rate,
        "burst": burst,
        "store": "3-master Redis Cluster" if cluster else "one Redis (broker = store)",
        "seconds": seconds,
        "park_estimate_s": round(park_s, 1),
        "companions": 3,
        "shards": 4,
        "n": n,
        "achieved_per_s": round(achieved, 2),
        "window_s": WINDOW_S,
        "window_counts": windows,
        "window_max_error_pct": round(
            max((abs(c - expected) / expected * 100 for c in windows), default=0.0), 2
        ),
        "most_in_window": most,
        "window_bound": int(burst + rate * WINDOW_S),
        "free_n": free_n,
        "free_arrived": len(free),
        "free_last_after_first_limited_s": round(free[-1] - first, 3) if free else None,
        "machine": machine,
    }
