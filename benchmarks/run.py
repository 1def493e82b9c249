"""Run the benchmark suite: ``python -m benchmarks [--quick] [--only ...]``.

Each benchmark starts its own private redis-server processes and Celery
subprocesses and stops them when it ends (also on Ctrl-C or SIGTERM). The
run prints a table of DESIGN §7's targets and writes
``benchmarks/results/<timestamp>.json`` and ``<timestamp>-lateness.png``.

``--render-docs FILE`` refreshes the generated parts of
``docs/performance.rst`` and ``docs/_static/lateness.png`` from a results
file without measuring anything; ``--update-docs`` does so after the run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .common import FULL, QUICK, Sizes
from .infra import (
    RESULTS_DIR,
    LoadSampler,
    git_describe,
    interrupts_as_keyboard_interrupt,
    loadavg,
    machine_info,
    rabbitmq_version,
)

SCHEMA = 1


def _release(sizes: Sizes) -> dict[str, Any]:
    from .release import MODES, run_release

    modes = MODES if rabbitmq_version() else tuple(m for m in MODES if "rabbitmq" not in m)
    results = run_release(sizes, modes)
    if "generic-rabbitmq" not in results:
        results["generic-rabbitmq"] = {"error": "RabbitMQ not reachable"}
    return results


def _limit(sizes: Sizes) -> dict[str, Any]:
    from .limit import run_limit

    return run_limit(sizes)


def _end_to_end(sizes: Sizes) -> dict[str, Any]:
    from .release import run_end_to_end

    return run_end_to_end(sizes)


def _lateness(sizes: Sizes) -> dict[str, Any]:
    from .lateness import run_lateness

    return run_lateness(sizes)


def _lateness_generic(sizes: Sizes) -> dict[str, Any]:
    from .lateness import run_lateness

    result = run_lateness(sizes, path="generic-redis")
    result.pop("samples_ms", None)
    return result


def _burst(sizes: Sizes) -> dict[str, Any]:
    from .lateness import run_burst

    return run_burst(sizes)


def _producer(sizes: Sizes) -> dict[str, Any]:
    from .producer import run_producer

    return run_producer(sizes)


def _contention(sizes: Sizes) -> dict[str, Any]:
    from .contention import run_contention

    return run_contention(sizes)


def _memory(sizes: Sizes) -> dict[str, Any]:
    from .memory import run_memory

    return run_memory(sizes)


def _beat(sizes: Sizes) -> dict[str, Any]:
    from .beat import run_beat

    return run_beat(sizes)


def _idle(sizes: Sizes) -> dict[str, Any]:
    from .idle import run_idle

    return run_idle(sizes)


def _ratelimit(sizes: Sizes) -> dict[str, Any]:
    from .ratelimit import run_ratelimit

    return run_ratelimit(sizes)


def _ratelimit_cluster(sizes: Sizes) -> dict[str, Any]:
    from .ratelimit import run_ratelimit

    return run_ratelimit(sizes, cluster=True)


def _fairness(sizes: Sizes) -> dict[str, Any]:
    from .fairness import run_fairness

    return run_fairness(sizes)


def _web(sizes: Sizes) -> dict[str, Any]:
    from .web import run_web, table

    result = run_web(sizes)
    print(table(result), file=sys.stderr)  # the P1-P8 table does not show it
    return result


def _scale(sizes: Sizes) -> dict[str, Any]:
    from .scale import FULL_SIZES, PLOT, QUICK_SIZES, run_scale, table

    quick = sizes == QUICK
    # A quick run's plot stays beside the results; a full run's is the docs' one.
    plot = RESULTS_DIR / "scale-quick.png" if quick else PLOT
    result = run_scale(QUICK_SIZES if quick else FULL_SIZES, quick=quick, plot=plot)
    print(table(result), file=sys.stderr)  # the P1-P8 table does not show it
    return result


def _recovery(sizes: Sizes) -> dict[str, Any]:
    from .recovery import SIZES_FULL, SIZES_QUICK, run_recovery, table

    quick = sizes == QUICK
    result = run_recovery(SIZES_QUICK if quick else SIZES_FULL, quick=quick)
    print(table(result), file=sys.stderr)  # the P1-P8 table does not show it
    return result


def _burst_brokers(sizes: Sizes) -> dict[str, Any]:
    from .burst_brokers import SIZES_FULL, SIZES_QUICK, run_burst_brokers, table

    quick = sizes == QUICK
    result = run_burst_brokers(SIZES_QUICK if quick else SIZES_FULL, quick=quick)
    print(table(result), file=sys.stderr)
    return result


def _cluster_scale(sizes: Sizes) -> dict[str, Any]:
    from .cluster_scale import SIZES_FULL, SIZES_QUICK, run_cluster_scale, table

    quick = sizes == QUICK
    result = run_cluster_scale(SIZES_QUICK if quick else SIZES_FULL, quick=quick)
    print(table(result), file=sys.stderr)
    return result


def _peers(sizes: Sizes) -> dict[str, Any]:
    from .peers import FULL as PEERS_FULL
    from .peers import QUICK as PEERS_QUICK
    from .peers import RESULTS_DIR as PEERS_DIR
    from .peers import plot, run_peers, table

    result = run_peers(PEERS_QUICK if sizes == QUICK else PEERS_FULL)
    print(table(result), file=sys.stderr)  # the P1-P8 table does not show it
    stamp = result["started"].replace("-", "").replace(":", "").replace("+0000", "Z")
    plot(result, PEERS_DIR / f"{stamp}-peers.png")
    return result


#: Benchmarks in run order: name -> (targets it covers, function).
BENCHMARKS: dict[str, tuple[str, Callable[[Sizes], dict[str, Any]]]] = {
    "release": ("P1 P2", _release),
    "limit": ("P1 (handoff vs a bare Lua move)", _limit),
    "end_to_end": ("P1 P2 (native comparison)", _end_to_end),
    "lateness": ("P3", _lateness),
    "lateness_generic": ("P3 (generic path, full runs only)", _lateness_generic),
    "burst": ("P4", _burst),
    "producer": ("P5", _producer),
    "memory": ("P6 P7", _memory),
    "idle": ("P8", _idle),
    "contention": ("scale-out: several companions, shard leases", _contention),
    "beat": ("periodic: companion vs celery beat, failover", _beat),
    "ratelimit": ("release control: achieved rate vs a global limit", _ratelimit),
    "ratelimit_cluster": (
        "release control: the same limit with the store on a 3-master Redis Cluster",
        _ratelimit_cluster,
    ),
    "fairness": ("release control: per-key limits, exact per key and fair between keys", _fairness),
    "web": ("dashboard pages over 1,000,000 parked", _web),
    "scale": ("cost as the work grows: 0 to 10,000,000 parked", _scale),
    "recovery": (
        "a companion's start, SIGKILL mid-burst, a Redis restart from AOF, with a backlog",
        _recovery,
    ),
    "burst_brokers": (
        "100,000 due at once with a backlog behind, into a Redis broker and RabbitMQ",
        _burst_brokers,
    ),
    "cluster_scale": (
        "park and release rates on a Redis Cluster of 1, 2 and 3 masters, with a backlog",
        _cluster_scale,
    ),
    "peers": (
        "beside native ETA, RabbitMQ delayed delivery, celery-redis-plus, "
        "celery-longterm-scheduler (only with --only peers)",
        _peers,
    ),
}
#: Run only when named (``--only scale,peers``): they take long (scale: 27 minutes and
#: 7 GB of Redis in full; recovery, burst_brokers, cluster_scale: minutes each and a
#: backlog of 1,000,000), or need what the suite does not (peers: Python 3.13).
OPT_IN = frozenset({"scale", "peers", "recovery", "burst_brokers", "cluster_scale"})


def is_full_suite(run: dict[str, Any]) -> bool:
    """Whether *run* ran every benchmark of its mode (not ``--only`` a few)."""
    skipped_in_quick = {"lateness_generic"} if run.get("mode") == "quick" else set()
    return set(BENCHMARKS) - skipped_in_quick - OPT_IN <= set(run.get("benchmarks") or [])


def _selected(only: str | None, *, quick: bool) -> list[str]:
    if not only:
        return [
            name
            for name in BENCHMARKS
            if (name != "lateness_generic" or not quick) and name not in OPT_IN
        ]
    wanted = {part.strip().lower() for part in only.split(",") if part.strip()}
    chosen = [
        name
        for name, (targets, _) in BENCHMARKS.items()
        if name in wanted
        or (
            any(t.lower() in wanted for t in targets.split())
            and not (quick and name == "lateness_generic")
        )
    ]
    unknown = wanted - set(BENCHMARKS) - {f"p{i}" for i in range(1, 9)}
    if unknown or not chosen:
        raise SystemExit(
            f"--only: unknown {', '.join(sorted(unknown)) or only!r}; use target ids P1..P8 "
            f"or names: {', '.join(BENCHMARKS)}"
        )
    return chosen


def run_suite(
    sizes: Sizes, mode: str, names: list[str], out_dir: Path
) -> tuple[dict[str, Any], Path]:
    started = datetime.now(timezone.utc)
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    out_dir.mkdir(parents=True, exist_ok=True)
    run: dict[str, Any] = {
        "schema": SCHEMA,
        "mode": mode,
        "started": started.isoformat(timespec="seconds"),
        "sizes": sizes.as_dict(),
        "benchmarks": names,
        "results": {},
        "timings_s": {},
    }
    from celery_zdelay.testing import RedisServer

    with RedisServer() as probe:
        from .infra import redis_version

        run["machine"] = machine_info(redis_version(probe), rabbitmq_version())
    run["load"] = {"before": loadavg()}
    sampler = LoadSampler().start()
    t0 = time.monotonic()
    try:
        for name in names:
            print(f"[{time.monotonic() - t0:6.1f}s] {name} ...", file=sys.stderr, flush=True)
            began = time.monotonic()
            try:
                run["results"][name] = BENCHMARKS[name][1](sizes)
            except KeyboardInterrupt:
                run["interrupted"] = name
                raise
            except Exception as exc:
                traceback.print_exc()
                run["results"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            run["timings_s"][name] = round(time.monotonic() - began, 1)
    finally:
        run["duration_s"] = round(time.monotonic() - t0, 1)
        # Others may commit or edit celery_zdelay/ while a long run goes on: say so.
        run["git_end"] = git_describe()
        run["code_changed_during_run"] = run["git_end"] != run["machine"]["git"]
        run["load"]["after"] = loadavg()
        run["load"]["samples"] = sampler.stop()
        from .report import plot_lateness, verdicts

        run["targets"] = [v.as_dict() for v in verdicts(run)]
        path = out_dir / f"{stamp}.json"
        path.write_text(json.dumps(run, indent=1) + "\n")
        plot_lateness(run, out_dir / f"{stamp}-lateness.png")
    return run, path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="celery-zdelay benchmark suite (DESIGN §7 targets P1-P8).",
    )
    parser.add_argument(
        "--quick", action="store_true", help="small sizes, under a minute (for development)"
    )
    parser.add_argument(
        "--only",
        metavar="LIST",
        help=f"comma-separated target ids (P1..P8) or names: {', '.join(BENCHMARKS)}",
    )
    parser.add_argument(
        "--out", type=Path, default=RESULTS_DIR, help="results directory (default: %(default)s)"
    )
    parser.add_argument(
        "--update-docs",
        action="store_true",
        help="after the run, refresh docs/performance.rst and docs/_static/lateness.png",
    )
    parser.add_argument(
        "--render-docs",
        metavar="RESULTS_JSON",
        type=Path,
        help="measure nothing: refresh the docs from an existing results file",
    )
    parser.add_argument(
        "--show", metavar="RESULTS_JSON", type=Path, help="measure nothing: print a results file"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile the release and parking paths with cProfile instead of benchmarking",
    )
    args = parser.parse_args(argv)

    from . import report

    if args.render_docs or args.show:
        path = args.render_docs or args.show
        run = json.loads(path.read_text())
        print(report.console_table(run))
        if args.render_docs:
            plot = path.with_name(path.stem + "-lateness.png")
            if not plot.exists():
                plot = report.plot_lateness(run, plot) or plot
            print(f"\nwrote {report.render_docs(run, path, plot, full=is_full_suite(run))}")
        return 0

    sizes = QUICK if args.quick else FULL
    mode = "quick" if args.quick else "full"
    with interrupts_as_keyboard_interrupt():
        if args.profile:
            from .profiling import run_profile

            print(run_profile(sizes, args.out))
            return 0
        try:
            run, path = run_suite(sizes, mode, _selected(args.only, quick=args.quick), args.out)
        except KeyboardInterrupt:
            print("\ninterrupted: every server and process started was stopped", file=sys.stderr)
            return 130
    print()
    print(report.console_table(run))
    print(f"\nresults: {path}")
    if args.update_docs:
        plot = path.with_name(path.stem + "-lateness.png")
        print(f"docs: {report.render_docs(run, path, plot, full=is_full_suite(run))}")
    failed = [name for name, value in run["results"].items() if "error" in value]
    return 1 if failed else 0
