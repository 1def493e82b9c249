"""Running one test command against one mutant, bounded in time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .tree import test_env

__all__ = ["Outcome", "pytest_command", "run_tests"]

#: pytest processes per mutant (the machine has 2 cores, shared).
JOBS = int(os.environ.get("MUTANTS_JOBS", "2"))


@dataclass(frozen=True)
class Outcome:
    """How the tests went: *passed* means the mutant survived them."""

    passed: bool
    timed_out: bool
    seconds: float
    tail: str


def pytest_command(tests: tuple[str, ...]) -> list[str]:
    """The command that runs *tests*, stopping at the first failure."""
    parallel = ["-n", str(JOBS)] if JOBS > 1 else ["-p", "no:xdist"]
    return [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *parallel, *tests]


def run_tests(command: list[str], *, cwd: Path, timeout_s: float) -> Outcome:
    """Run *command* in *cwd*; a run past *timeout_s* is stopped and counts as failed.

    The command runs in its own process group so that the workers and
    companions the tests start are stopped with it.
    """
    started = time.monotonic()
    with subprocess.Popen(
        command,
        cwd=cwd,
        env=test_env(cwd),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    ) as process:
        try:
            output, _ = process.communicate(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            timed_out = True
    tail = "\n".join(output.decode(errors="replace").strip().splitlines()[-15:])
    passed = process.returncode == 0 and not timed_out
    return Outcome(passed, timed_out, time.monotonic() - started, tail)
