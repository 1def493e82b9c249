"""The mutation run's targets: the figures docs/mutation.rst gives are reproducible.

``make mutants-kills`` (``python -m mutation --kills``) runs each target
against its kill tests only; those figures are only the ones the docs give
while every kill-test file is mapped to a target and every target's kill
tests are files that exist. A kill-test file is named for the promise it
pins, beside the other tests of its module; what makes it one is its place
in ``KILL_TESTS`` and its docstring, which cites docs/mutation.rst.
"""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from mutation.targets import KILL_TESTS, LUA, PYTHON, kill_tests
from mutation.tree import ROOT

pytestmark = pytest.mark.timeout(60)


def test_every_kill_test_file_is_run_by_a_target_and_exists() -> None:
    mapped = {t.split("::")[0] for target in (*PYTHON, *LUA) for t in kill_tests(target)}
    assert mapped == KILL_TESTS
    assert {p for p in KILL_TESTS if not (ROOT / p).is_file()} == set()
    # A test file written against surviving mutants says so: it is a kill test.
    citing = {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "tests").rglob("test_*.py")
        if path.parent != ROOT / "tests" / "mutation"
        and "docs/mutation.rst" in (ast.get_docstring(ast.parse(path.read_text())) or "")
    }
    assert citing == KILL_TESTS


def test_kills_lists_each_target_with_its_kill_tests_only() -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "mutation", "--kills", "--list"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=50,
    ).stdout.splitlines()
    rows = {
        line.split()[0]: [w for w in line.split() if w.startswith("tests/")]
        for line in listed
        if not line.endswith("left out")
    }
    guard = next(t for t in LUA if t.name == "_guard.lua")
    # Its other tests (store refusals, hardening) are in its whole list, not here.
    assert set(guard.tests) - set(rows["_guard.lua"]) != set()
    for tests in rows.values():
        assert tests
        assert all(t.split("::")[0] in KILL_TESTS for t in tests)


def _quick_list(*names: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mutation", "--quick", "--list", *names],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=50,
    )


def test_quick_runs_the_named_targets_of_the_ci_subset_only() -> None:
    # The whole subset without names; the one named, with its quick tests, with one
    whole = [line.split()[0] for line in _quick_list().stdout.splitlines()]
    assert "ack.lua" in whole
    assert len(whole) > 1
    (row,) = _quick_list("ack.lua").stdout.splitlines()
    ack = next(t for t in LUA if t.name == "ack.lua")
    assert row.split()[0] == "ack.lua"
    assert [w for w in row.split() if w.startswith("tests/")] == list(ack.quick)
    # A target outside the subset is refused, saying so
    refused = _quick_list("claim.lua")
    assert refused.returncode == 2
    assert "not in the CI subset" in refused.stderr
