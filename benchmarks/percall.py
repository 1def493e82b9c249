"""``python -m benchmarks.percall``: where the time of one ``apply_delayed`` goes.

Beside ``apply_async(countdown=)`` to the same private Redis (broker = store):

* Redis side: ``INFO commandstats`` per call of each path (every command a
  script runs is counted under its own name, its time inside EVALSHA's), and
  the SLOWLOG (threshold 0) of each script call: the time one ``park.lua``
  call holds Redis;
* client side: the wall time per call (p50 of interleaved rounds), this
  process's CPU time per call, and a cProfile of N calls of each path
  (functions by own time, per call). cProfile slows Python down; its shares
  are what matter, not its absolute times.

Prints a report and writes ``results/<timestamp>-percall.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .common import percentile
from .infra import Resources, ScriptTimer, commands_per_task, reset_stats

RESULTS = Path(__file__).resolve().parent / "results"


def profile(n: int, rounds: int) -> dict[str, Any]:
    with Resources() as res:
        _, app, client = res.redis_app()
        noop = app.tasks["bench.noop"]
        paths = {"apply_delayed": noop.apply_delayed, "apply_async": noop.apply_async}
        seq = 0

        def run(call: Any, count: int) -> list[float]:
            nonlocal seq
            times = []
            for _ in range(count):
                started = time.perf_counter()
                call((seq, 0), countdown=3600)
                times.append(time.perf_counter() - started)
                seq += 1
            return times

        for call in paths.values():
            run(call, 200)
        out: dict[str, Any] = {"n": n, "rounds": rounds, "paths": {}}
        wall: dict[str, list[float]] = {name: [] for name in paths}
        cpu: dict[str, list[float]] = {name: [] for name in paths}
        for round_no in range(rounds):
            order = list(paths.items())
            if round_no % 2:
                order.reverse()
            for name, call in order:
                cpu_started = time.process_time()
                wall[name].append(percentile(run(call, n), 0.5) * 1e6)
                cpu[name].append((time.process_time() - cpu_started) * 1e6 / n)
        for name, call in paths.items():
            client.flushdb()
            reset_stats(client)
            slowlog = ScriptTimer(client)
            run(call, n)
            commands = commands_per_task(client, n)
            scripts = slowlog.summary()
            profiler = cProfile.Profile()
            profiler.enable()
            run(call, n)
            profiler.disable()
            out["paths"][name] = {
                "wall_p50_us": round(statistics.median(wall[name]), 1),
                "cpu_us": round(statistics.median(cpu[name]), 1),
                "commands": commands,
                "scripts": scripts,
                "python": _own_time(profiler, n),
            }
    return out


def _own_time(profiler: cProfile.Profile, n: int, top: int = 25) -> dict[str, Any]:
    stats = pstats.Stats(profiler)
    total = sum(row[2] for row in stats.stats.values())  # type: ignore[attr-defined]
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)  # type: ignore[attr-defined]
    return {
        "total_us_per_call": round(total * 1e6 / n, 1),
        "top": [
            {
                "function": f"{Path(file).name}:{line}({func})",
                "calls_per_call": round(row[1] / n, 2),
                "own_us_per_call": round(row[2] * 1e6 / n, 2),
                "cum_us_per_call": round(row[3] * 1e6 / n, 2),
            }
            for (file, line, func), row in rows[:top]
        ],
    }


def render(out: dict[str, Any]) -> str:
    lines = [f"per call, N={out['n']:,} calls, {out['rounds']} interleaved rounds"]
    for name, path in out["paths"].items():
        lines += [
            "",
            f"== {name}: wall p50 {path['wall_p50_us']:.0f} µs, "
            f"CPU of this process {path['cpu_us']:.0f} µs per call",
            "Redis commands per call (calls, server µs):",
        ]
        for command, value in path["commands"].items():
            lines.append(
                f"  {command:<22} {value['per_task']:>6.2f}  {value['us_per_task']:>8.2f} µs"
            )
        for script, value in path["scripts"].items():
            lines.append(
                f"  script {script}: mean {value['mean_ms'] * 1000:.1f} µs, "
                f"p50 {value['p50_ms'] * 1000:.0f} µs, p99 {value['p99_ms'] * 1000:.0f} µs"
            )
        python = path["python"]
        lines.append(
            f"Python (cProfile, {python['total_us_per_call']:.0f} µs per call under the "
            "profiler), by own time per call:"
        )
        for row in python["top"]:
            lines.append(
                f"  {row['own_us_per_call']:>7.2f} µs own  {row['cum_us_per_call']:>8.2f} cum  "
                f"x{row['calls_per_call']:<5} {row['function']}"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2000, help="calls per round (default 2000)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    options = parser.parse_args()
    out = profile(options.n, options.rounds)
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = RESULTS / f"{stamp}-percall.json"
    path.write_text(json.dumps(out, indent=1))
    print(render(out))
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
