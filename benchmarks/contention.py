"""Several companions on many shards: the Redis time they spend, with and
without shard ownership leases (``zdelay_shard_leases``).

Every claim is atomic, so companions sharing shards never release an entry
twice; but woken by the same due time they race for the same entries, and
the losers' calls still cost Redis time. This measures that cost: N tasks
due at one instant on 16 shards, released into a Redis broker by one
companion, by four, and by four that split the shards with leases. Each
figure is the store's total Lua time (SLOWLOG) from the due time until the
last task is in the queue.
"""

from __future__ import annotations

import time
from typing import Any

from celery_zdelay.config import get_config
from celery_zdelay.store.redis_keys import shard_keys

from .common import Sizes, now_ms, park_bulk, prepare_before_due
from .infra import BenchmarkError, MachineLoad, Resources, ScriptTimer, wait_for
from .proj import DEFAULT_QUEUE, make_app

__all__ = ["SHARDS", "run_contention"]

#: Shards of the contention benchmark: a few per companion.
SHARDS = 16

#: (label, companions, shard leases)
SETUPS = (
    ("1 companion", 1, False),
    ("4 companions", 4, False),
    ("4 companions, shard leases", 4, True),
)


def run_contention(sizes: Sizes) -> dict[str, Any]:
    n = sizes.burst_n // 2
    return {label: _release(n, companions, leases) for label, companions, leases in SETUPS}


def _release(n: int, companions: int, leases: bool) -> dict[str, Any]:
    with Resources() as res:
        server = res.redis()
        url = f"{server.url}/0"
        app = make_app(
            broker=url,
            store=url,
            conf={"zdelay_shards": SHARDS, "zdelay_shard_leases": leases},
        )
        res.callback(app.close)
        client = server.client()
        res.callback(client.close)
        prefix = get_config(app).key_prefix
        keys = [shard_keys(prefix, s) for s in range(SHARDS)]
        for _ in range(companions):
            res.companion(app)
        if leases:
            # Wait until the shards are split: every one owned, by each companion.
            def split() -> bool:
                owners = [client.get(k.owner) for k in keys]
                return None not in owners and len(set(owners)) == companions

            wait_for(split, timeout=60, interval=0.05, what="the shards to be split")

        def prepare(due_ms: int) -> bool:
            park_bulk(app, n, due_ms)
            return True

        def reset() -> None:
            client.delete(*[k.due for k in keys])

        due_ms = prepare_before_due(prepare, reset, max(2.0, n / 5000), what="contention: parking")
        timer = ScriptTimer(client)
        time.sleep(max(0.0, (due_ms - now_ms()) / 1000 - 0.05))
        load = MachineLoad()
        deadline = time.monotonic() + 60 + n / 1000
        while client.llen(DEFAULT_QUEUE) < n:
            if time.monotonic() > deadline:
                raise BenchmarkError(f"contention: {client.llen(DEFAULT_QUEUE)} of {n} released")
            time.sleep(0.002)
        seconds = (now_ms() - due_ms) / 1000
        machine = load.stop()
        scripts = timer.summary()
    handoff = scripts.get("handoff", {"calls": 0, "total_ms": 0.0})
    recover = scripts.get("recover", {"calls": 0, "total_ms": 0.0})
    return {
        "n": n,
        "shards": SHARDS,
        "companions": companions,
        "shard_leases": leases,
        "seconds": round(seconds, 3),
        "handoff_calls": handoff["calls"],
        "redis_ms": round(handoff["total_ms"] + recover["total_ms"], 1),
        "redis_us_per_task": round(1000 * (handoff["total_ms"] + recover["total_ms"]) / n, 2),
        "redis_scripts": scripts,
        "machine": machine,
    }
