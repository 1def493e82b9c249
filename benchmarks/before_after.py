"""P1, P3 and P5 of the package as it is against the package at an earlier commit, interleaved.

``python -m benchmarks.before_after --base COMMIT [--rounds 5]`` answers "did
this change slow anything?" in one run: the package at *COMMIT* (``git
archive`` of ``celery_zdelay/`` into a temporary directory) and the package
of this checkout take turns, round by round (before, after, after, before,
...), each round in a fresh process that imports its own package first on
``PYTHONPATH``, with ``PYTHONSAFEPATH`` set so that no process puts its
working directory in front (the workers and companions it starts inherit
both). The
benchmark code is this checkout's for both, so only the package differs.

Each round measures, at the sizes of :data:`SIZES`:

- P1: tasks released per second by the atomic handoff (``release``,
  mode ``handoff``);
- P3: lateness at a steady 1,000 due/s seen by a real worker, p50 and p99;
- P5: ``apply_delayed`` against ``apply_async(countdown=)`` per call (its
  own interleaved rounds inside), and ``apply_delayed_many`` tasks per second.

With ``--percall`` a round is instead ``benchmarks.percall``'s timing of
one call of each kind users make (plain, ``queue=``, ``key=``, ``tags=``;
``--n`` calls per path, 3 interleaved rounds inside), no profiling: each
path's p50 and each ``apply_delayed`` / ``apply_async`` ratio, so the P5
per-call cost of two commits is compared in one run (about 10 s a round).

It prints, per figure, the median of each side with its spread and the
median of the per-round ratios (after / before), and writes the rounds to
``benchmarks/results/<stamp>-before-after.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from datetime import datetime, timezone
from io import BytesIO
from pathlib import Path
from typing import Any

from .common import FULL, spread
from .infra import ROOT

RESULTS = ROOT / "benchmarks" / "results"

#: Between --quick and the full run: a round of the three takes about a minute.
SIZES = dataclasses.replace(
    FULL,
    release_n=50_000,
    release_repeat=1,
    lateness_seconds=10.0,
    call_n=1_000,
    call_rounds=5,
    bulk_n=20_000,
)

#: One round, run in a fresh process: the three benchmarks, their figures as JSON.
_ROUND = """
import dataclasses, json, sys
import celery_zdelay
from benchmarks.common import Sizes
from benchmarks.lateness import run_lateness
from benchmarks.producer import run_producer
from benchmarks.release import run_release
sizes = Sizes(**json.loads(sys.argv[1]))
release = run_release(sizes, ("handoff",))["handoff"]
lateness = run_lateness(sizes)["observed_ms"]
producer = run_producer(sizes)
print(json.dumps({
    "package": celery_zdelay.__file__,
    "P1 handoff /s": release["rate"],
    "P3 p50 ms": lateness["p50"],
    "P3 p99 ms": lateness["p99"],
    "P5 apply_delayed / apply_async": producer["ratio"],
    "P5 apply_delayed_many /s": producer["bulk_rate"],
}))
"""

#: One ``--percall`` round: the per-call timing of benchmarks/percall.py.
_PERCALL_ROUND = """
import json, sys
import celery_zdelay
from benchmarks.percall import profile
out = profile(int(sys.argv[1]), 3, timing_only=True)
figures = {"package": celery_zdelay.__file__}
for name, path in out["paths"].items():
    figures[name + " p50 us"] = path["wall_p50_us"]["median"]
for name, ratio in out["ratios"].items():
    figures[name] = ratio["median"]
print(json.dumps(figures))
"""

#: Whether a higher figure is better, by figure name.
HIGHER_IS_BETTER = {
    "P1 handoff /s": True,
    "P3 p50 ms": False,
    "P3 p99 ms": False,
    "P5 apply_delayed / apply_async": False,
    "P5 apply_delayed_many /s": True,
}


def _package_at(commit: str, into: Path) -> Path:
    """Write ``celery_zdelay/`` as it was at *commit* under *into*; return *into*."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", commit, "celery_zdelay"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def _round(package_root: Path, percall_n: int | None = None) -> dict[str, Any]:
    # PYTHONSAFEPATH: no process puts its working directory (this checkout,
    # with its own package) in front of PYTHONPATH, workers and companions
    # included (they inherit both).
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(package_root), str(ROOT)]),
        "PYTHONSAFEPATH": "1",
    }
    argv = (
        ["-c", _ROUND, json.dumps(SIZES.as_dict())]
        if percall_n is None
        else ["-c", _PERCALL_ROUND, str(percall_n)]
    )
    done = subprocess.run(
        [sys.executable, *argv],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=900,
    )
    figures: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    expected = package_root / "celery_zdelay" / "__init__.py"
    if Path(figures.pop("package")).resolve() != expected.resolve():
        raise RuntimeError(f"the round imported another package than {expected}")
    return figures


def compare(base: str, rounds: int, percall_n: int | None = None) -> dict[str, Any]:
    """Run *rounds* interleaved rounds of each side; return the rounds and their summary.

    With *percall_n*, each round is the per-call timing (``--percall``).
    """
    with tempfile.TemporaryDirectory(prefix="zdelay-before-") as tmp:
        sides = {"before": _package_at(base, Path(tmp)), "after": ROOT}
        measured: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
        for number in range(rounds):
            # ABBA: neither side always runs first, on a warmer or cooler machine.
            order = ("before", "after") if number % 2 == 0 else ("after", "before")
            for side in order:
                measured[side].append(_round(sides[side], percall_n))
                print(f"round {number + 1}/{rounds} {side}: {measured[side][-1]}", flush=True)
    summary = {}
    for name in measured["after"][0]:
        before = [r[name] for r in measured["before"]]
        after = [r[name] for r in measured["after"]]
        summary[name] = {
            "before": spread(before),
            "after": spread(after),
            "after / before": spread([a / b for a, b in zip(after, before, strict=True)]),
        }
    return {
        "base": base,
        "rounds": rounds,
        "sizes": SIZES.as_dict() if percall_n is None else {"percall_n": percall_n},
        "measured": measured,
        "summary": summary,
    }


def render(out: dict[str, Any]) -> str:
    lines = [
        f"before = celery_zdelay at {out['base']}, after = this checkout; "
        f"{out['rounds']} interleaved rounds; median [min-max]",
        "",
        f"{'figure':<44} {'before':>22} {'after':>22} {'after/before':>20}",
    ]
    for name, row in out["summary"].items():
        cells = [
            f"{row[side]['median']:g} [{row[side]['min']:g}-{row[side]['max']:g}]"
            for side in ("before", "after", "after / before")
        ]
        # Per-call times and their ratios: lower is better.
        better = "higher" if HIGHER_IS_BETTER.get(name, False) else "lower"
        lines.append(
            f"{name:<44} {cells[0]:>22} {cells[1]:>22} {cells[2]:>20}  ({better} is better)"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="commit whose package is 'before'")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per side (default 5)")
    parser.add_argument(
        "--percall",
        action="store_true",
        help="compare the per-call cost of each kind of call (benchmarks.percall), nothing else",
    )
    parser.add_argument("--n", type=int, default=500, help="with --percall: calls per path")
    options = parser.parse_args()
    out = compare(options.base, options.rounds, options.n if options.percall else None)
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = RESULTS / f"{stamp}-before-after.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(render(out))
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
