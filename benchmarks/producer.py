"""P5: what parking costs the producer, beside plain ``apply_async(countdown=)``.

Per call
    ``noop.apply_delayed(args, countdown=3600)`` against
    ``noop.apply_async(args, countdown=3600)``, both to the same private Redis
    (broker = store), one call at a time as application code makes them.
    ``call_n`` calls of each, alternating which goes first, for ``call_rounds``
    rounds; the per-call time of each is the median over rounds, and the ratio
    is taken between those medians. Both paths are warmed up first (connections,
    script loading).

Bulk
    ``bulk_n`` tasks parked inside ``with celery_zdelay.batch(app):`` blocks of
    1,000 calls each; rate = tasks / wall time.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import celery_zdelay

from .common import PARK_CHUNK, Sizes
from .infra import MachineLoad, Resources
from .proj import make_app


def run_producer(sizes: Sizes) -> dict[str, Any]:
    with Resources() as res:
        server = res.redis()
        url = f"{server.url}/0"
        app = make_app(broker=url, store=url)
        res.callback(app.close)
        noop = app.tasks["bench.noop"]

        def delayed(n: int, offset: int) -> float:
            started = time.perf_counter()
            for seq in range(offset, offset + n):
                noop.apply_delayed((seq, 0), countdown=3600)
            return (time.perf_counter() - started) / n

        def plain(n: int, offset: int) -> float:
            started = time.perf_counter()
            for seq in range(offset, offset + n):
                noop.apply_async((seq, 0), countdown=3600)
            return (time.perf_counter() - started) / n

        delayed(200, 0)
        plain(200, 0)
        load = MachineLoad()
        per_call: dict[str, list[float]] = {"apply_delayed": [], "apply_async": []}
        offset = 1000
        for round_no in range(sizes.call_rounds):
            order = [("apply_delayed", delayed), ("apply_async", plain)]
            if round_no % 2:
                order.reverse()
            for name, fn in order:
                per_call[name].append(fn(sizes.call_n, offset))
                offset += sizes.call_n
        calls_machine = load.stop()

        load = MachineLoad()
        started = time.perf_counter()
        for chunk in range(0, sizes.bulk_n, PARK_CHUNK):
            with celery_zdelay.batch(app):
                for seq in range(chunk, min(chunk + PARK_CHUNK, sizes.bulk_n)):
                    noop.apply_delayed((offset + seq, 0), countdown=3600)
        bulk_s = time.perf_counter() - started
        bulk_machine = load.stop()

    delayed_us = statistics.median(per_call["apply_delayed"]) * 1e6
    plain_us = statistics.median(per_call["apply_async"]) * 1e6
    return {
        "call_n": sizes.call_n,
        "rounds": sizes.call_rounds,
        "apply_delayed_us": round(delayed_us, 1),
        "apply_async_us": round(plain_us, 1),
        "ratio": round(delayed_us / plain_us, 3),
        "rounds_us": {k: [round(v * 1e6, 1) for v in vs] for k, vs in per_call.items()},
        "calls_machine": calls_machine,
        "bulk_n": sizes.bulk_n,
        "bulk_chunk": PARK_CHUNK,
        "bulk_seconds": round(bulk_s, 3),
        "bulk_rate": round(sizes.bulk_n / bulk_s),
        "bulk_machine": bulk_machine,
    }
