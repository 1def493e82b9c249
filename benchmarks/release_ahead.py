"""Releasing ahead (``zdelay_release_ahead_seconds``): lateness at the worker, off and on.

``python -m benchmarks.release_ahead [--rounds 3] [--rate 200] [--seconds 10]
[--ahead-ms 0,5,20] [--pool threads]`` runs, in interleaved rounds (each
round starts one case further on), one case per broker (Redis: the atomic
handoff; RabbitMQ: the confirmed generic path, a classic queue) and per
setting: ``rate`` tasks a second fall due for ``seconds`` seconds, released
by a real companion to a real worker (``celery worker -P threads -c 8``, the
peers benchmark's), each on fresh private servers.

Per task, on the machine's clock (Redis and RabbitMQ run here too):

- the worker stamps when the message reached it (Celery's ``task_received``,
  before any ETA timer) and when the task started;
- the companion (wrapped in this benchmark only, see ``benchmarks/proj.py``)
  stamps when its claim call started and ended, and when the release was
  done (the handoff's reply; the broker's acknowledgement on RabbitMQ).

So today's lateness (start - due) splits into: *wake* (the claim call
started this long after due: the companion's wake-up), *claim* (the call),
*publish* (claim end to the broker's acknowledgement; 0 on the handoff),
*pickup* (release to the worker's receipt: broker and consumer), *start*
(receipt, or the due time if later, to the task's start: the worker's
timer and pool). *Held* is what released ahead costs the worker: how many
tasks waited on its ETA timer at once (received before due, not started),
and the worker's CPU time per task (``/proc/<pid>/stat`` over the case).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import now_ms, park_bulk, prepare_before_due, quantiles
from .infra import (
    RESULTS_DIR,
    BenchmarkError,
    MachineLoad,
    Resources,
    cpu_seconds,
    loadavg,
    wait_for,
)
from .lateness import _parking_margin
from .peers import rabbitmq_vhost, spread
from .proj import STAMPS_KEY, app_env, make_app

BROKERS = ("redis", "rabbitmq")
#: Seconds after the last due time that stamps are still waited for.
CAP_S = 30.0


def run_case(
    broker: str, ahead_ms: int, *, rate: int, seconds: float, pool: str, concurrency: int
) -> dict[str, Any]:
    """One case: *rate* tasks/s due for *seconds* s, released *ahead_ms* ahead (0: off)."""
    n = int(rate * seconds)
    with Resources() as res:
        store_server = res.redis()
        store_url = f"{store_server.url}/0"
        record = res.redis()
        record_url = f"{record.url}/0"
        if broker == "redis":
            broker_url = store_url
        else:
            _, broker_url = res.stack.enter_context(rabbitmq_vhost())
        conf = {"zdelay_release_ahead_seconds": ahead_ms / 1000} if ahead_ms else {}
        app = make_app(broker=broker_url, store=store_url, record=record_url, conf=conf)
        res.callback(app.close)
        env = {**app_env(app), "ZBENCH_STAMPS": "1"}
        fd, profile = tempfile.mkstemp(prefix="zbench-ahead-", suffix=".json")
        os.close(fd)
        res.callback(Path(profile).unlink, True)
        worker = res.worker(None, pool=pool, concurrency=concurrency, env=env)
        companion = res.companion(None, env={**env, "ZBENCH_PROFILE_FILE": profile})
        recorder = record.client()
        res.callback(recorder.close)
        interval_us = 1_000_000 // rate

        def prepare(t0: int) -> bool:
            park_bulk(app, n, lambda seq: t0 + seq * interval_us // 1000)
            return True

        def reset() -> None:
            raise BenchmarkError("parking took past the first due time")

        t0 = prepare_before_due(prepare, reset, _parking_margin(app, n), what="ahead: parking")
        load = MachineLoad()
        cpu_before = {"worker": cpu_seconds(worker.pid), "companion": cpu_seconds(companion.pid)}
        last_due = t0 + (n - 1) * interval_us // 1000
        deadline = time.monotonic() + (last_due - now_ms()) / 1000 + CAP_S
        while recorder.llen(STAMPS_KEY) < 2 * n and time.monotonic() < deadline:
            time.sleep(0.2)
        machine = load.stop()
        cpu = {
            f"{name}_cpu_us_per_task": round(
                (cpu_seconds(process.pid) - cpu_before[name]) * 1e6 / n, 1
            )
            for name, process in (("worker", worker), ("companion", companion))
        }
        machine.update(cpu)
        companion.stop()
        wait_for(lambda: os.path.getsize(profile) > 0, timeout=20, what="the companion's profile")
        releases = json.loads(Path(profile).read_text())
        stamps = [item.decode().split() for item in recorder.lrange(STAMPS_KEY, 0, -1)]
        worker.stop(timeout=5, kill=True)
    return _figures(broker, ahead_ms, n, t0, interval_us, releases, stamps, machine)


def _figures(
    broker: str,
    ahead_ms: int,
    n: int,
    t0: int,
    interval_us: int,
    releases: list[list[int]],
    stamps: list[list[str]],
    machine: dict[str, Any],
) -> dict[str, Any]:
    due_ns = {seq: (t0 + seq * interval_us // 1000) * 1_000_000 for seq in range(n)}
    seq_of_due = {due // 1_000_000: seq for seq, due in due_ns.items()}
    received: dict[int, int] = {}
    started: dict[int, int] = {}
    for kind, seq, ns in stamps:
        (received if kind == "r" else started).setdefault(int(seq), int(ns))
    released = {seq_of_due[row[0]]: row[1:] for row in releases if row[0] in seq_of_due}
    ms = 1e-6
    late = [(started[s] - due_ns[s]) * ms for s in range(n) if s in started]
    parts: dict[str, list[float]] = {k: [] for k in ("wake", "claim", "publish", "pickup", "start")}
    for s in range(n):
        if s not in started or s not in received or s not in released:
            continue
        claim_start, claim_end, done = released[s]
        parts["wake"].append((claim_start - due_ns[s]) * ms)
        parts["claim"].append((claim_end - claim_start) * ms)
        parts["publish"].append((done - claim_end) * ms)
        parts["pickup"].append((received[s] - done) * ms)
        parts["start"].append((started[s] - max(received[s], due_ns[s])) * ms)
    # On the worker's ETA timer: received before due, until started.
    events = []
    held_ms = []
    for s, at in received.items():
        if at < due_ns[s] and s in started:
            events += [(at, 1), (started[s], -1)]
            held_ms.append((started[s] - at) * ms)
    most = now = 0
    for _, step in sorted(events):
        now += step
        most = max(most, now)
    return {
        "broker": broker,
        "ahead_ms": ahead_ms,
        "n": n,
        "ran": len(started),
        "early": sum(1 for x in late if x < 0),
        "lateness_ms": quantiles(late) if late else {},
        "parts_p50_ms": {k: round(statistics.median(v), 3) for k, v in parts.items() if v},
        "parts_p99_ms": {k: quantiles(v)["p99"] for k, v in parts.items() if v},
        "held_at_once": most,
        "held_n": len(held_ms),
        "held_ms": quantiles(held_ms) if held_ms else {},
        "machine": machine,
        "worker_cpu_us_per_task": machine.get("worker_cpu_us_per_task"),
    }


def run(
    *,
    rounds: int,
    rate: int,
    seconds: float,
    aheads: list[int],
    pool: str,
    concurrency: int,
    brokers: tuple[str, ...] = BROKERS,
) -> dict[str, Any]:
    cases = [(broker, ahead) for broker in brokers for ahead in aheads]
    results: list[dict[str, Any]] = []
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    for round_no in range(rounds):
        shift = round_no % len(cases)
        for broker, ahead in cases[shift:] + cases[:shift]:
            try:
                figures = run_case(
                    broker, ahead, rate=rate, seconds=seconds, pool=pool, concurrency=concurrency
                )
            except BenchmarkError as exc:
                figures = {"broker": broker, "ahead_ms": ahead, "error": str(exc)}
            figures["round"] = round_no
            figures["loadavg"] = loadavg()
            results.append(figures)
            print(_line(figures), flush=True)
    return {
        "started": started,
        "rate": rate,
        "seconds": seconds,
        "pool": f"{pool} -c {concurrency}",
        "rounds": results,
        "summary": _summary(results, cases),
    }


def _line(f: dict[str, Any]) -> str:
    if "error" in f:
        return f"{f['broker']:9} ahead {f['ahead_ms']:3} ms: {f['error']}"
    late = f["lateness_ms"]
    return (
        f"{f['broker']:9} ahead {f['ahead_ms']:3} ms round {f['round']}: lateness p50 "
        f"{late.get('p50', 0):.2f} p99 {late.get('p99', 0):.1f} max {late.get('max', 0):.1f} ms, "
        f"early {f['early']}, ran {f['ran']}/{f['n']}, held at once {f['held_at_once']}, "
        f"worker CPU {f['worker_cpu_us_per_task']} us/task, "
        f"parts p50 {f['parts_p50_ms']}, load {f['loadavg']}"
    )


def _summary(results: list[dict[str, Any]], cases: list[tuple[str, int]]) -> list[dict[str, Any]]:
    rows = []
    for broker, ahead in cases:
        ok = [r for r in results if r["broker"] == broker and r["ahead_ms"] == ahead and "n" in r]
        if not ok:
            continue
        row: dict[str, Any] = {"broker": broker, "ahead_ms": ahead, "rounds": len(ok)}
        for q in ("p50", "p99", "max"):
            row[f"lateness_{q}_ms"] = spread([r["lateness_ms"][q] for r in ok])
        for part in ("wake", "claim", "publish", "pickup", "start"):
            values = [r["parts_p50_ms"][part] for r in ok if part in r["parts_p50_ms"]]
            row[f"{part}_p50_ms"] = spread(values) if values else None
        row["held_at_once"] = spread([float(r["held_at_once"]) for r in ok])
        row["worker_cpu_us_per_task"] = spread([r["worker_cpu_us_per_task"] for r in ok])
        row["early"] = sum(r["early"] for r in ok)
        row["not_run"] = sum(r["n"] - r["ran"] for r in ok)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.release_ahead")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=int, default=200, help="tasks due per second")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--ahead-ms", default="0,5,20", help="settings to compare, in ms (0: off)")
    parser.add_argument("--pool", default="threads")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--brokers", default=",".join(BROKERS))
    args = parser.parse_args(argv)
    aheads = [int(x) for x in args.ahead_ms.split(",")]
    result = run(
        rounds=args.rounds,
        rate=args.rate,
        seconds=args.seconds,
        aheads=aheads,
        pool=args.pool,
        concurrency=args.concurrency,
        brokers=tuple(args.brokers.split(",")),
    )
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{time.strftime('%Y%m%d-%H%M%S')}-release-ahead.json"
    path.write_text(json.dumps(result, indent=1))
    for row in result["summary"]:
        print(json.dumps(row))
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
