"""``python -m mutation``: mutate the guard modules and Lua scripts; write the report.

python -m mutation                 every target (make mutants)
python -m mutation --quick         the CI subset (make mutants-quick)
python -m mutation --quick ack.lua the named targets of the CI subset, against their quick tests
python -m mutation --kills         every target against its kill tests only (make mutants-kills)
python -m mutation entry ack.lua   the named targets only
python -m mutation --list          each target, its mutants and its tests
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from .lua_mutants import mutants
from .lua_run import run_script
from .python_mutants import run_module
from .report import write
from .run import pytest_command, run_tests
from .targets import LUA, PYTHON, QUICK, Target, by_name, kill_tests
from .tree import ROOT, copy_tree

#: Where the scratch tree and the report go by default (outside the work tree).
SCRATCH = Path(os.environ.get("MUTANTS_DIR", "/tmp/celery-zdelay-mutation"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mutation", description=__doc__.split("\n")[0])
    parser.add_argument("targets", nargs="*", help="target names (default: all)")
    parser.add_argument("--quick", action="store_true", help="the small CI subset")
    parser.add_argument(
        "--kills",
        action="store_true",
        help="each target against its kill tests only (KILL_TESTS in mutation/targets.py)",
    )
    parser.add_argument("--list", action="store_true", help="list the targets and stop")
    parser.add_argument("--out", type=Path, default=SCRATCH / "report", help="report folder")
    parser.add_argument(
        "--tree", type=Path, default=SCRATCH / "tree", help="scratch copy (emptied first)"
    )
    parser.add_argument(
        "--skip-tests",
        action="append",
        default=[],
        metavar="PATH",
        help="run without this test file (to measure before a new test): repeatable",
    )
    parser.add_argument(
        "--fail-under", type=float, default=None, help="exit 1 when a target kills less (%%)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        # The CI subset, or the named targets of it (each against its quick tests).
        names = args.targets or QUICK
        for name in names:
            if not by_name(name).quick:
                parser.error(f"{name} has no quick tests: it is not in the CI subset")
        targets = [replace(t, tests=t.quick) for t in map(by_name, names)]
    elif args.targets:
        targets = [by_name(n) for n in args.targets]
    else:
        targets = [*PYTHON, *LUA]
    if args.kills:
        # The figures docs/mutation.rst gives: no worker or companion starts,
        # so a killed mutant costs one pytest start.
        targets = [replace(t, tests=kill_tests(t)) for t in targets]
        for target in [t for t in targets if not t.tests]:
            print(f"{target.name}: no kill tests, left out", flush=True)
        targets = [t for t in targets if t.tests]
    if args.skip_tests:
        targets = [
            replace(t, tests=tuple(p for p in t.tests if p not in args.skip_tests)) for t in targets
        ]
    if args.list:
        for target in targets:
            count = (
                f"{len(mutants(target.name, (ROOT / target.path).read_text()))} mutants"
                if target.is_lua
                else "cosmic-ray"
            )
            print(f"{target.name:<22} {count:<12} {' '.join(target.tests)}")
        return 0
    tree = copy_tree(args.tree)
    records, seconds = [], {}
    for target in targets:
        started = time.monotonic()
        timeout_s = _timeout(target, tree)
        run = run_script if target.is_lua else run_module
        found = run(target, tree, timeout_s=timeout_s)
        records.extend(found)
        seconds[target.name] = round(time.monotonic() - started, 1)
        counted = [r for r in found if r["killed"] is not None]
        killed = sum(1 for r in counted if r["killed"])
        # Written after each target, so a run cut short still leaves a report.
        write(args.out, records, seconds)
        print(
            f"{target.name}: {killed}/{len(counted)} killed in {seconds[target.name]:.0f}s",
            flush=True,
        )
    print(write(args.out, records, seconds))
    print(f"report: {args.out / 'mutants.txt'} and {args.out / 'mutants.json'}")
    if args.fail_under is not None:
        for target in targets:
            found = [r for r in records if r["target"] == target.name and r["killed"] is not None]
            if found and 100 * sum(r["killed"] for r in found) / len(found) < args.fail_under:
                return 1
    return 0


def _timeout(target: Target, tree: Path) -> float:
    """Three times the unmutated run, plus a minute: a slower run is a hung mutant."""
    baseline = run_tests(pytest_command(target.tests), cwd=tree, timeout_s=900)
    if not baseline.passed:
        sys.exit(f"The tests of {target.name} fail without any mutant:\n{baseline.tail}")
    return 3 * baseline.seconds + 60


if __name__ == "__main__":
    sys.exit(main())
