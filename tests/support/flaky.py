"""``make flake-hunt``: the timing-sensitive tests, round after round, under load.

A test that failed once without a code change has a root cause. This repeats
the tests marked ``timing`` (they race a clock, a pause, a file another
process writes) ``--rounds`` times while a process burns a whole core beside
them, as a loaded CI machine would, and prints how often each test failed.
Exit status 1 when any failed at all.

    python -m tests.support.flaky --rounds 5 -- -n 2 -m timing
"""

from __future__ import annotations

import argparse
import collections
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

BURN = "import itertools\nfor _ in itertools.count(): pass"


def failures(report: Path) -> list[str]:
    """The ids of the tests a JUnit XML report records as failed or errored."""
    failed = []
    for case in ET.parse(report).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-burn", action="store_true", help="run without the CPU burner")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments")
    args = parser.parse_args(argv)
    # Stopped with SIGTERM, the burner must go too: finally runs on SystemExit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    counts: collections.Counter[str] = collections.Counter()
    burner = None if args.no_burn else subprocess.Popen([sys.executable, "-c", BURN])
    try:
        with tempfile.TemporaryDirectory(prefix="zdelay-flake-") as scratch:
            for round_ in range(1, args.rounds + 1):
                report = Path(scratch) / f"round-{round_}.xml"
                started = time.monotonic()
                command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
                subprocess.run([*command, f"--junitxml={report}", *args.pytest_args], check=False)
                failed = failures(report) if report.exists() else ["(no report: pytest died)"]
                counts.update(failed)
                took = time.monotonic() - started
                print(f"== round {round_}/{args.rounds}: {len(failed)} failed in {took:.0f} s")
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()
    print(f"== failures over {args.rounds} rounds" + (":" if counts else ": none"))
    for test, count in counts.most_common():
        print(f"   {count}/{args.rounds}  {test}")
    return 1 if counts else 0


if __name__ == "__main__":
    sys.exit(main())
