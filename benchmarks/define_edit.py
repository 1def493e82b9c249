"""Redis's time to store an edit of one schedule among many: ``python -m benchmarks.define_edit``.

``python -m benchmarks.define_edit [--rows 100000] [--edits 5] [--out FILE]``:
on a private Redis, ``--rows`` django-celery-beat rows (daily) are stored
through :meth:`PeriodicStore.store_config`, then ``--edits`` times one row
is edited (made every 5 s) and the configuration stored again, once whole
(``define.lua``'s "config" mode, each store on a store of its own) and once
as its changes ("diff" mode, ``incremental=True``). For each store: Redis's
time in the script (``INFO commandstats``, reset before it: what every
other client waits) and the caller's (building and sending the arguments
too). What ``benchmarks.beat_rows`` shows as the slowest ``PING`` of an
edit, without the companions, the database and the rows read again.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import redis

from celery_zdelay.parking import store_for
from celery_zdelay.periodic.definition import SOURCE_DJANGO_BEAT, Definition, from_beat_entry
from celery_zdelay.periodic.store import PeriodicStore

from .infra import MachineLoad, Resources
from .proj import make_app


def _row(i: int, seconds: float = 86_400.0) -> Definition:
    return from_beat_entry(
        f"day-{i}",
        {"task": "bench.tick", "schedule": seconds},
        source=SOURCE_DJANGO_BEAT,
        display_name=f"day-{i}",
    )


def measure(url: str, rows: int, edits: int, *, incremental: bool) -> dict[str, Any]:
    """Store *rows* rows, then *edits* edits of one row each; the times of the edits."""
    app = make_app(broker=url, store=url, record=url)
    periodic_store = PeriodicStore(store_for(app))
    client = redis.Redis.from_url(url, socket_timeout=None)
    definitions = [_row(i) for i in range(rows)]
    periodic_store.store_config(
        definitions, "h0", writer="bench", force=False, made=1, reading=2, incremental=incremental
    )
    redis_ms: list[float] = []
    caller_ms: list[float] = []
    for edit in range(1, edits + 1):
        definitions[rows - edit] = _row(rows - edit, 5.0)
        client.config_resetstat()
        started = time.perf_counter()
        status, changed = periodic_store.store_config(
            definitions,
            f"h{edit}",
            writer="bench",
            force=False,
            made=1 + edit,
            reading=2,
            incremental=incremental,
        )
        caller_ms.append(round((time.perf_counter() - started) * 1000, 1))
        if (status, changed) != ("done", [("changed", f"day-{rows - edit}")]):
            raise RuntimeError(f"edit {edit} stored as {status} {changed[:3]}")
        stats = client.info("commandstats")
        usec = sum(v["usec"] for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))
        redis_ms.append(round(usec / 1000, 1))
    client.close()
    return {
        "redis_ms": redis_ms,
        "redis_ms_median": statistics.median(redis_ms),
        "caller_ms": caller_ms,
        "caller_ms_median": statistics.median(caller_ms),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.define_edit")
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--edits", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    load = MachineLoad()
    result: dict[str, Any] = {"rows": args.rows, "edits": args.edits}
    with Resources() as res:
        server = res.redis()
        # Whole, then as changes, each on a database of its own.
        result["whole"] = measure(f"{server.url}/0", args.rows, args.edits, incremental=False)
        result["diff"] = measure(f"{server.url}/1", args.rows, args.edits, incremental=True)
    result["machine"] = load.stop()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
