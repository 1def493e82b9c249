"""``make latest``: the suite on the newest release of every dependency.

``make test`` runs on the lock (constraints/dev.txt) so that it gives the same
answer every day. This is the other half: a scratch virtualenv resolves the
package's ``dev`` extra with nothing pinned, exactly as a new user's would
today, then runs the gate's fast half (lint, types, and every test but the
``system`` layer). When a step fails, each package whose newest version differs
from the lock is put back to its locked version, one at a time, and the failed
step run again: the package whose rollback makes it pass is named.

Exit status: 0 when the newest releases pass, 1 when they break (the package
named when one is found). CI runs it as a canary that reports and does not
block (.ci/run): the lock is the gate, the canary says when to move it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "constraints" / "dev.txt"
VENV = ROOT / ".venv-latest"
BIN = VENV / "bin"

#: Tried first when naming a culprit: the package's own runtime dependencies.
RUNTIME = ("redis", "celery", "kombu", "amqp", "billiard", "vine", "click", "django")


def _name(spec: str) -> str:
    return re.sub(r"[-_.]+", "-", spec.split("==", 1)[0].strip().lower())


def pins(text: str) -> dict[str, str]:
    """``name -> version`` of a freeze or a lock file."""
    found = {}
    for line in text.splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            found[_name(name)] = version.strip()
    return found


def run(*command: str | Path, quiet: bool = False) -> bool:
    shown = " ".join(str(part) for part in command)
    print(f"-- {shown}", flush=True)
    output = subprocess.DEVNULL if quiet else None
    completed = subprocess.run(
        [str(part) for part in command], check=False, cwd=ROOT, stdout=output
    )
    return completed.returncode == 0


def install() -> dict[str, str]:
    shutil.rmtree(VENV, ignore_errors=True)
    python = os.environ.get("PYTHON", "python3")
    pip = (BIN / "python", "-m", "pip", "--quiet", "--disable-pip-version-check")
    if not (
        run(python, "-m", "venv", VENV)
        and run(*pip, "install", "--upgrade", "pip")
        and run(*pip, "install", "-e", ".[dev]")
    ):
        raise SystemExit("make latest: the newest releases do not install (pip said why above)")
    frozen = subprocess.run(
        [BIN / "python", "-m", "pip", "freeze", "--all", "--exclude-editable"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return pins(frozen)


STEPS = {
    "lint": (
        (BIN / "ruff", "check", "celery_zdelay", "tests"),
        (BIN / "ruff", "format", "--check", "celery_zdelay", "tests"),
    ),
    "types": ((BIN / "mypy",),),
    "tests": ((BIN / "python", "-m", "pytest", "-n", "2", "-q", "-m", "not system"),),
}
#: Re-running a failed step for a rollback: only the tests that failed.
RERUN = {**STEPS, "tests": ((*STEPS["tests"][0], "--last-failed"),)}


def passes(step: str, commands: dict[str, tuple[tuple[str | Path, ...], ...]]) -> bool:
    return all(run(*command) for command in commands[step])


#: How long the search for a culprit may take: CI's run has a time limit, and
#: a canary that ran out of it would fail the run it must not fail.
SEARCH_SECONDS = 600.0


def culprit(step: str, newest: dict[str, str], locked: dict[str, str]) -> str | None:
    """Roll each changed package back alone; the one that fixes *step*."""
    changed = [name for name in newest if name in locked and newest[name] != locked[name]]
    changed.sort(key=lambda name: (name not in RUNTIME, name))
    pip = (BIN / "python", "-m", "pip", "--quiet", "--disable-pip-version-check", "install")
    deadline = time.monotonic() + SEARCH_SECONDS
    for name in changed:
        if time.monotonic() > deadline:
            print(f"== gave up naming a culprit after {SEARCH_SECONDS:.0f} s", flush=True)
            break
        print(f"== rolling back {name} {newest[name]} -> {locked[name]}", flush=True)
        if not run(*pip, "--no-deps", f"{name}=={locked[name]}", quiet=True):
            continue
        fixed = passes(step, RERUN)
        run(*pip, "--no-deps", f"{name}=={newest[name]}", quiet=True)
        if fixed:
            return name
    return None


def main() -> int:
    started = time.monotonic()
    locked = pins(LOCK.read_text())
    newest = install()
    changed = {name: version for name, version in newest.items() if locked.get(name) != version}
    print("== newest releases that differ from the lock (name: lock -> newest)")
    for name in sorted(changed, key=lambda name: (name not in RUNTIME, name)):
        print(f"   {name}: {locked.get(name, '(not locked)')} -> {changed[name]}")
    print("== runtime dependencies resolved:")
    print("   " + ", ".join(f"{name} {newest[name]}" for name in RUNTIME if name in newest))
    for step in STEPS:
        if passes(step, STEPS):
            continue
        name = culprit(step, newest, locked)
        took = time.monotonic() - started
        if name is None:
            print(f"== NEWEST RELEASES BREAK '{step}'; no single package's rollback fixes it")
        else:
            print(
                f"== NEWEST RELEASES BREAK '{step}': {name} {newest[name]} "
                f"(passes with the locked {name} {locked[name]})"
            )
        print(f"== make latest took {took:.0f} s")
        return 1
    print(f"== the newest releases pass lint, types and the fast tests ({len(changed)} differ)")
    print(f"== make latest took {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
