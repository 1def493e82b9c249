"""``python -m benchmarks.percall``: where the time of one ``apply_delayed`` goes.

Beside ``apply_async(countdown=)`` to the same private Redis (broker = store),
for each kind of call users make (``--calls``, all by default):

* ``plain``: ``apply_delayed(args, countdown=3600)`` against
  ``apply_async(args, countdown=3600)``;
* ``queue``: both with ``queue="orders"`` (a queue not in ``task_queues``,
  as ``queue=`` is mostly used);
* ``key``: ``apply_delayed(..., key="order:<n>")`` (a key of its own per
  call, so every call parks) against plain ``apply_async``, which has no key;
* ``tags``: ``apply_delayed(..., tags=["tenant:<n mod 100>", "order:<n>"])``
  against plain ``apply_async``.

Every path runs in each round, the order turned round from round to round;
per round the p50 of each path, and per kind the ratio of the two p50s.
Reported: the median of each ratio over the rounds with its spread
(min-max), and, per path:

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
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .common import percentile, spread
from .infra import MachineLoad, Resources, ScriptTimer, commands_per_task, reset_stats

RESULTS = Path(__file__).resolve().parent / "results"


#: The kinds of call measured: (apply_delayed's options, apply_async's), each
#: a function of the call's sequence number.
CALLS: dict[str, tuple[Callable[[int], dict[str, Any]], Callable[[int], dict[str, Any]]]] = {
    "plain": (lambda seq: {}, lambda seq: {}),
    "queue": (lambda seq: {"queue": "orders"}, lambda seq: {"queue": "orders"}),
    "key": (lambda seq: {"key": f"order:{seq}"}, lambda seq: {}),
    "tags": (lambda seq: {"tags": [f"tenant:{seq % 100}", f"order:{seq}"]}, lambda seq: {}),
}


def profile(
    n: int, rounds: int, calls: list[str] | None = None, *, timing_only: bool = False
) -> dict[str, Any]:
    """Time the *calls* (kinds of :data:`CALLS`) in *rounds* interleaved rounds of *n*.

    Then, unless *timing_only* (``before_after --percall``), each path's
    Redis commands, script times and cProfile.
    """
    kinds = calls or list(CALLS)
    with Resources() as res:
        _, app, client = res.redis_app()
        noop = app.tasks["bench.noop"]
        paths: dict[str, tuple[Any, Callable[[int], dict[str, Any]]]] = {}
        for kind in kinds:
            delayed, plain = CALLS[kind]
            suffix = "" if kind == "plain" else f" {kind}="
            paths[f"apply_delayed{suffix}"] = (noop.apply_delayed, delayed)
            if kind in ("plain", "queue"):
                paths[f"apply_async{suffix}"] = (noop.apply_async, plain)
            else:  # apply_async takes no key or tags: against the plain call
                paths.setdefault("apply_async", (noop.apply_async, CALLS["plain"][1]))
        seq = 0

        def run(path: tuple[Any, Callable[[int], dict[str, Any]]], count: int) -> list[float]:
            nonlocal seq
            call, options = path
            times = []
            clock = time.perf_counter
            for _ in range(count):
                given = options(seq)
                started = clock()
                call((seq, 0), countdown=3600, **given)
                times.append(clock() - started)
                seq += 1
            return times

        for path in paths.values():
            run(path, 200)
        load = MachineLoad()
        out: dict[str, Any] = {"n": n, "rounds": rounds, "paths": {}}
        wall: dict[str, list[float]] = {name: [] for name in paths}
        cpu: dict[str, list[float]] = {name: [] for name in paths}
        for round_no in range(rounds):
            names = list(paths)
            shift = round_no % len(names)
            order = names[shift:] + names[:shift]
            if round_no % 2:
                order.reverse()
            for name in order:
                cpu_started = time.process_time()
                wall[name].append(percentile(run(paths[name], n), 0.5) * 1e6)
                cpu[name].append((time.process_time() - cpu_started) * 1e6 / n)
            client.flushdb()
        out["machine"] = load.stop()
        out["ratios"] = {}
        for kind in kinds:
            suffix = "" if kind == "plain" else f" {kind}="
            against = f"apply_async{suffix}" if kind in ("plain", "queue") else "apply_async"
            out["ratios"][f"apply_delayed{suffix} / {against}"] = spread(
                [d / a for d, a in zip(wall[f"apply_delayed{suffix}"], wall[against], strict=True)]
            )
        for name, path in paths.items():
            out["paths"][name] = {
                "wall_p50_us": spread(wall[name], digits=1),
                "cpu_us": round(statistics.median(cpu[name]), 1),
            }
            if timing_only:
                continue
            client.flushdb()
            reset_stats(client)
            run(path, n)
            commands = commands_per_task(client, n)
            # SLOWLOG at threshold 0 costs Redis time of its own: timed apart.
            slowlog = ScriptTimer(client)
            run(path, n)
            scripts = slowlog.summary()
            profiler = cProfile.Profile()
            profiler.enable()
            run(path, n)
            profiler.disable()
            out["paths"][name].update(
                commands=commands, scripts=scripts, python=_own_time(profiler, n)
            )
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
    machine = out["machine"]
    lines = [
        f"per call, N={out['n']:,} calls, {out['rounds']} interleaved rounds; load average "
        f"{machine['loadavg_start']} -> {machine['loadavg_end']}, "
        f"{machine['cpu_busy_pct']} % of the CPUs busy",
        "",
        f"{'ratio of p50s (median of the rounds)':<48} {'median':>7} {'min-max':>13}",
    ]
    for name, value in out["ratios"].items():
        lines.append(
            f"{name:<48} {value['median']:>7.2f} {value['min']:>6.2f}-{value['max']:<6.2f}"
        )
    for name, path in out["paths"].items():
        wall = path["wall_p50_us"]
        lines += [
            "",
            f"== {name}: wall p50 {wall['median']:.0f} µs [{wall['min']:.0f}-{wall['max']:.0f}], "
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
    parser.add_argument(
        "--calls",
        default=",".join(CALLS),
        help=f"kinds of call, comma-separated (default {','.join(CALLS)})",
    )
    options = parser.parse_args()
    calls = [kind.strip() for kind in options.calls.split(",") if kind.strip()]
    unknown = [kind for kind in calls if kind not in CALLS]
    if unknown:
        parser.error(f"unknown kind of call {unknown[0]!r}: choose from {', '.join(CALLS)}")
    out = profile(options.n, options.rounds, calls)
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = RESULTS / f"{stamp}-percall.json"
    path.write_text(json.dumps(out, indent=1))
    print(render(out))
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
