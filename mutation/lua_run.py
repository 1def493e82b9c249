"""Running a Lua script's tests against each of its mutants."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from .lua_mutants import mutants
from .run import pytest_command, run_tests
from .targets import Target

__all__ = ["run_script"]


def run_script(target: Target, tree: Path, *, timeout_s: float) -> list[dict[str, Any]]:
    """Mutate *target* in *tree* one mutant at a time; one record per mutant."""
    path = tree / target.path
    original = path.read_text()
    command = pytest_command(target.tests)
    records = []
    try:
        for mutant in mutants(target.name, original):
            path.write_text(mutant.source)
            outcome = run_tests(command, cwd=tree, timeout_s=timeout_s)
            diff = "".join(
                difflib.unified_diff(
                    original.splitlines(keepends=True),
                    mutant.source.splitlines(keepends=True),
                    fromfile=target.path,
                    tofile=target.path,
                    n=1,
                )
            )
            print(
                f"  {mutant.ident}: {'survived' if outcome.passed else 'killed'}"
                f" ({outcome.seconds:.0f}s)",
                flush=True,
            )
            records.append(
                {
                    "target": target.name,
                    "path": target.path,
                    "line": mutant.line,
                    "kind": mutant.kind,
                    "description": mutant.description,
                    "killed": not outcome.passed,
                    "outcome": "timeout"
                    if outcome.timed_out
                    else ("survived" if outcome.passed else "killed"),
                    "diff": diff,
                }
            )
    finally:
        path.write_text(original)
    return records
