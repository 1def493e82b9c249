"""P8: CPU a companion uses while nothing is due.

Two real ``celery zdelay`` processes run side by side, each on its own
private Redis (broker = store): one with an empty store, one with N tasks
parked an hour ahead (it has a next due time, just not yet). After they
start and settle, each one's CPU time (utime + stime of all its threads, from
/proc/<pid>/stat) is read at the start and end of ``idle_seconds`` of wall
time: CPU % of one core = CPU seconds / wall seconds. The CPU of each Redis
server over the same window is recorded too (only that companion talks to it).
"""

from __future__ import annotations

import time
from typing import Any

from .common import Sizes, now_ms, park_bulk
from .infra import MachineLoad, Resources, cpu_seconds
from .proj import make_app


def run_idle(sizes: Sizes) -> dict[str, Any]:
    with Resources() as res:
        watched: dict[str, tuple[int, int]] = {}
        for label, parked in (("empty", 0), ("parked", sizes.memory_n // 10)):
            server = res.redis()
            url = f"{server.url}/0"
            app = make_app(broker=url, store=url)
            res.callback(app.close)
            if parked:
                park_bulk(app, parked, now_ms() + 3_600_000)
            companion = res.companion(app)
            assert server._process is not None
            watched[label] = (companion.pid, server._process.pid)
        time.sleep(sizes.settle_seconds)
        load = MachineLoad()
        start = {label: (cpu_seconds(c), cpu_seconds(r)) for label, (c, r) in watched.items()}
        t0 = time.monotonic()
        time.sleep(sizes.idle_seconds)
        wall = time.monotonic() - t0
        end = {label: (cpu_seconds(c), cpu_seconds(r)) for label, (c, r) in watched.items()}
        machine = load.stop()
    result: dict[str, Any] = {"seconds": round(wall, 2), "machine": machine}
    for label in watched:
        companion_cpu = end[label][0] - start[label][0]
        redis_cpu = end[label][1] - start[label][1]
        result[label] = {
            "companion_cpu_s": round(companion_cpu, 3),
            "companion_cpu_pct": round(100 * companion_cpu / wall, 3),
            "redis_cpu_pct": round(100 * redis_cpu / wall, 3),
        }
    result["parked_n"] = sizes.memory_n // 10
    return result
