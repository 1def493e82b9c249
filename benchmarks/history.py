"""What a task's history costs (issue 36): Redis bytes per task, and P1 with it on and off.

``python -m benchmarks.history [--n 100000] [--rounds 5] [--seconds 86400]``
parks *n* due ``bench.noop`` tasks in bulk and times one companion
releasing them all by the atomic handoff (P1, as ``benchmarks.release``
does), once with ``zdelay_history_seconds`` = *seconds* and once with 0,
round after round in the order on, off, off, on, ... (each round on its own
private Redis), so that the machine's load falls on both alike. After a
round with history on, the history hash of every shard is
measured with ``MEMORY USAGE ... SAMPLES 0`` (exact): each task then holds
a record of two events (parked, released).

With ``--record`` it instead times the record alone: ``zdelay_h_released``
(``store/lua/_history.lua``) on 1,000 ids per call over 20,000 records that
hold their "parked" line, against the same script without it, ten rounds on
a private Redis, by Redis's own time in the scripts (``INFO commandstats``).

It prints the median release rate of each side with its spread, the median
of the per-pair ratios (on / off), the bulk park rate of each side, and
the bytes per task; and writes them to
``benchmarks/results/<stamp>-history.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime, timezone
from typing import Any

from celery_zdelay.companion import Companion

from .common import now_ms, park_bulk, release_all, spread
from .infra import ROOT, Resources
from .proj import make_app


def one_round(history_seconds: float, n: int) -> dict[str, Any]:
    """Park *n* due tasks on a private Redis, release them all; the figures of that round."""
    with Resources() as res:
        server = res.redis()
        url = f"{server.url}/0"
        app = make_app(broker=url, store=url, conf={"zdelay_history_seconds": history_seconds})
        res.callback(app.close)
        client = server.client()
        res.callback(client.close)
        companion = Companion(app)
        res.callback(companion.close)
        # Connected and past handoff detection before the clock starts.
        companion.release_due()
        companion.publisher.publish([])
        park_s = park_bulk(app, n, now_ms() - 1000)
        client.config_resetstat()
        cpu_before = _redis_cpu_s(client)
        started = time.perf_counter()
        release_all(companion, n, "handoff")
        seconds = time.perf_counter() - started
        # The Redis server's CPU time (INFO cpu): unlike the time a command
        # takes, it does not count the moments the process waits for a core
        # on a loaded machine.
        cpu_s = _redis_cpu_s(client) - cpu_before
        # Redis's own time in the scripts: steadier than the wall clock on a
        # shared machine.
        stats = client.info("commandstats")
        script_usec = sum(
            int(stats[name]["usec"])
            for name in ("cmdstat_evalsha", "cmdstat_eval")
            if name in stats
        )
        history_keys = [key for key in client.keys("*:history*") if key.endswith(b":history")]
        history_bytes = sum(int(client.memory_usage(key, samples=0) or 0) for key in history_keys)
        records = sum(int(client.hlen(key)) for key in history_keys if key.endswith(b":history"))
        lengths = [
            len(value)
            for key in history_keys
            if key.endswith(b":history")
            for value in client.hvals(key)[:1000]
        ]
        return {
            "history_seconds": history_seconds,
            "n": n,
            "release_rate": round(n / seconds),
            "script_us_per_task": round(script_usec / n, 2),
            "redis_cpu_us_per_task": round(cpu_s * 1e6 / n, 2),
            "park_rate": round(n / park_s),
            "records": records,
            "history_bytes": history_bytes,
            "bytes_per_task": round(history_bytes / n, 1),
            "record_value_bytes": statistics.median(lengths) if lengths else 0,
        }


def _redis_cpu_s(client: Any) -> float:
    cpu = client.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def record_cost(rounds: int = 10, n: int = 20_000) -> dict[str, Any]:
    """Redis time per task of recording a release (µs), and of the same script without it."""
    from celery_zdelay.store.scripts import GUARD, HISTORY

    with Resources() as res:
        client = res.redis().client()
        res.callback(client.close)
        ids = [f"{i:08x}-87cf-4033-9341-18f8ceebdab9" for i in range(n)]

        def script(body: str) -> Any:
            head = "local ids = {} for i = 1, #ARGV do ids[i] = ARGV[i] end\n"
            return client.register_script(GUARD.read() + HISTORY.read() + head + body + " return 1")

        scores = "local s = {} for j = 1, #ids do s[j] = 1733000000000 * 1024 end\n"
        park = script(
            "local e = {} for j = 1, #ids do e[j] = {ids[j], 1733000000000} end zdelay_h_parked(e)"
        )
        release = script(scores + "zdelay_h_released(ids, s, nil)")
        bare = script(scores)
        trailer = "\0zdelay-history\0bulk\0vm:14660:777af301"

        def run(each: Any, keys: list[str]) -> float:
            client.config_resetstat()
            for k in range(0, n, 1000):
                each(keys=keys, args=[*ids[k : k + 1000], *([trailer] if keys else [])])
            stats = client.info("commandstats")
            names = ("cmdstat_evalsha", "cmdstat_eval")
            return sum(int(stats[name]["usec"]) for name in names if name in stats) / n

        with_record: list[float] = []
        without: list[float] = []
        for _ in range(rounds):
            client.flushall()
            run(park, ["{z:0}:history"])
            with_record.append(run(release, ["{z:0}:history"]))
            without.append(run(bare, []))
        return {
            "release_record_us": spread(with_record, digits=2),
            "without_us": spread(without, digits=2),
        }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each side")
    parser.add_argument("--seconds", type=float, default=86_400.0, help="history kept (on side)")
    parser.add_argument("--record", action="store_true", help="time the record alone")
    args = parser.parse_args(argv)
    if args.record:
        print(json.dumps(record_cost(), indent=2))
        return

    on: list[dict[str, Any]] = []
    off: list[dict[str, Any]] = []
    for index in range(args.rounds):
        # on, off, off, on, ...: neither side always runs first
        order = [(on, args.seconds), (off, 0.0)]
        if index % 2:
            order.reverse()
        for side, seconds in order:
            side.append(one_round(seconds, args.n))
            print(json.dumps(side[-1]), flush=True)

    ratios = [a["release_rate"] / b["release_rate"] for a, b in zip(on, off, strict=True)]
    park_ratios = [a["park_rate"] / b["park_rate"] for a, b in zip(on, off, strict=True)]
    cpu_ratios = [
        a["redis_cpu_us_per_task"] / b["redis_cpu_us_per_task"]
        for a, b in zip(on, off, strict=True)
    ]
    script_ratios = [
        a["script_us_per_task"] / b["script_us_per_task"] for a, b in zip(on, off, strict=True)
    ]
    summary = {
        "n": args.n,
        "rounds": args.rounds,
        "history_seconds": args.seconds,
        "p1_on": spread([r["release_rate"] for r in on], digits=0),
        "p1_off": spread([r["release_rate"] for r in off], digits=0),
        "p1_ratio_on_off": spread(ratios),
        "script_us_on": spread([r["script_us_per_task"] for r in on], digits=2),
        "script_us_off": spread([r["script_us_per_task"] for r in off], digits=2),
        "script_ratio_on_off": spread(script_ratios),
        "redis_cpu_us_on": spread([r["redis_cpu_us_per_task"] for r in on], digits=2),
        "redis_cpu_us_off": spread([r["redis_cpu_us_per_task"] for r in off], digits=2),
        "redis_cpu_ratio_on_off": spread(cpu_ratios),
        "park_rate_on": spread([r["park_rate"] for r in on], digits=0),
        "park_rate_off": spread([r["park_rate"] for r in off], digits=0),
        "park_ratio_on_off": spread(park_ratios),
        "bytes_per_task": spread([r["bytes_per_task"] for r in on], digits=1),
        "record_value_bytes": on[0]["record_value_bytes"],
        "off_history_bytes": max(r["history_bytes"] for r in off),
        "rounds_on": on,
        "rounds_off": off,
    }
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = ROOT / "benchmarks" / "results" / f"{stamp}-history.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    for name in (
        "p1_on",
        "p1_off",
        "p1_ratio_on_off",
        "script_us_on",
        "script_us_off",
        "script_ratio_on_off",
        "redis_cpu_us_on",
        "redis_cpu_us_off",
        "redis_cpu_ratio_on_off",
        "park_ratio_on_off",
        "bytes_per_task",
    ):
        print(f"{name}: {json.dumps({k: v for k, v in summary[name].items() if k != 'rounds'})}")
    print(f"record value: {summary['record_value_bytes']} bytes; written to {path}")


if __name__ == "__main__":
    main()
