"""What stale releases cost the atomic handoff: ``python -m benchmarks.stale``.

N tasks are parked due one second ago (a backlog: every one is claimed more
than a second late, so handoff.lua reads each one's ``max_late``), then one
companion releases them in-process (handoff mode, the store's own Redis as
the broker), timed from the first pass to the last. Cases, interleaved
round by round so the machine's load falls on all alike:

- ``plain``: no ``max_late`` anywhere (what every release pays now: one
  subtraction, and for a late entry two anchored matches that fail);
- ``max_late``: each task parked with ``max_late=3600``, none stale (the
  match that finds the field, and the fast-entry form with it);
- ``stale-dead``: each task parked with ``max_late=1`` and due 5 s ago:
  all stale, leased to the companion and dead-lettered (the stale path);
- ``stale-run``: the same with ``zdelay_on_stale = "run"``: leased,
  counted and pushed by push.lua.

Prints, per case, the median rate with its spread and the median per-round
ratio to ``plain``, and writes ``benchmarks/results/<stamp>-stale.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime, timezone
from typing import Any

import celery_zdelay
from celery_zdelay.companion import Companion

from .common import PARK_CHUNK, eta_for, now_ms
from .infra import ROOT, BenchmarkError, MachineLoad, Resources
from .proj import make_app

CASES = ("plain", "max_late", "stale-dead", "stale-run")


def _park(app: Any, n: int, due_ms: int, max_late: float | None) -> None:
    noop = app.tasks["bench.noop"]
    options = {} if max_late is None else {"max_late": max_late}
    for start in range(0, n, PARK_CHUNK):
        with celery_zdelay.batch(app):
            for seq in range(start, min(start + PARK_CHUNK, n)):
                noop.apply_delayed((seq, due_ms), eta=eta_for(due_ms), **options)


def release_case(case: str, n: int) -> dict[str, Any]:
    """Park *n* tasks for *case*, then time one companion draining them."""
    with Resources() as res:
        server = res.redis()
        url = f"{server.url}/0"
        conf = {"zdelay_on_stale": "run"} if case == "stale-run" else {}
        app = make_app(broker=url, store=url, conf=conf)
        res.callback(app.close)
        client = server.client()
        res.callback(client.close)
        companion = Companion(app)
        res.callback(companion.close)
        companion.release_due()  # connected, past handoff detection
        stale = case.startswith("stale")
        due_ms = now_ms() - (5000 if stale else 1000)
        _park(app, n, due_ms, 1 if stale else 3600 if case == "max_late" else None)
        due_key = companion.store.keys(0).due
        load = MachineLoad()
        started = time.perf_counter()
        passes = 0
        while client.zcard(due_key):
            passes += 1
            report = companion.release_due()
            if report.failed:
                raise BenchmarkError(f"{case}: a pass failed")
        seconds = time.perf_counter() - started
        machine = load.stop()
        out = client.llen("bench")
        dead = client.zcard(companion.store.keys(0).dead)
        expected = (0, n) if case == "stale-dead" else (n, 0)
        if (out, dead) != expected:
            raise BenchmarkError(f"{case}: {out} in the broker, {dead} dead; expected {expected}")
        return {
            "case": case,
            "n": n,
            "seconds": round(seconds, 4),
            "rate": round(n / seconds),
            "passes": passes,
            "stale": dict(companion.totals.stale),
            "machine": machine,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000, help="tasks per case and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rounds: list[dict[str, dict[str, Any]]] = []
    for number in range(args.rounds):
        order = CASES if number % 2 == 0 else tuple(reversed(CASES))
        rounds.append({case: release_case(case, args.n) for case in order})
    summary = {}
    for case in CASES:
        rates = [r[case]["rate"] for r in rounds]
        ratios = [r[case]["rate"] / r["plain"]["rate"] for r in rounds]
        summary[case] = {
            "median_rate": statistics.median(rates),
            "min_rate": min(rates),
            "max_rate": max(rates),
            "median_ratio_to_plain": round(statistics.median(ratios), 3),
        }
        print(
            f"{case:>10}: {statistics.median(rates):>8,.0f}/s "
            f"[{min(rates):,}-{max(rates):,}]  x{statistics.median(ratios):.3f} of plain"
        )
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = ROOT / "benchmarks" / "results" / f"{stamp}-stale.json"
    path.write_text(json.dumps({"n": args.n, "rounds": rounds, "summary": summary}, indent=1))
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
