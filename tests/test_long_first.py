"""Under xdist the long tests start first, spread over the workers (tests/support/long_first.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.support.long_first import blocks

pytestmark = pytest.mark.timeout(120)


def test_the_blocks_are_cut_as_worksteal_cuts_them() -> None:
    # worksteal sends node i len(pending) // nodes_remaining of what is left
    assert blocks(10, 4) == [2, 2, 3, 3]
    assert blocks(8, 4) == [2, 2, 2, 2]
    assert sum(blocks(2055, 6)) == 2055


#: 40 tests, of which the ones named long_* declare long timeouts: each
#: writes its worker and when it started.
_TESTS = """
import json, os, time
import pytest

def record(name):
    with open(os.environ["ZDELAY_ORDER_LOG"], "a") as log:
        log.write(json.dumps([name, os.environ["PYTEST_XDIST_WORKER"], time.monotonic()]) + "\\n")

@pytest.mark.parametrize("n", range(34))
def test_short(n):
    record(f"short_{n}")

@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", range(3))
def test_long_a(n):
    record(f"long_a_{n}")

@pytest.mark.timeout(420)
@pytest.mark.parametrize("n", range(3))
def test_long_b(n):
    record(f"long_b_{n}")
"""


def test_each_worker_starts_with_its_share_of_the_long_tests(tmp_path: Path) -> None:
    # Given 6 long tests at the end of the collection and 3 workers
    folder = tmp_path / "tests_order"
    folder.mkdir()
    (folder / "test_order.py").write_text(textwrap.dedent(_TESTS))
    log = tmp_path / "order.jsonl"
    # When they run under xdist's worksteal
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"),
            *("-p", "tests.support.long_first", "-n", "3", "--dist", "worksteal", str(folder)),
        ],
        cwd=ROOT,
        env={**os.environ, "ZDELAY_ORDER_LOG": str(log), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    by_worker: dict[str, list[str]] = {}
    for name, worker, _ in sorted(runs, key=lambda run: run[2]):
        by_worker.setdefault(worker, []).append(name)
    # Then every worker ran two long tests first, the 420 s ones before the 300 s ones
    assert len(by_worker) == 3
    for names in by_worker.values():
        assert [n.rsplit("_", 1)[0] for n in names[:2]] == ["long_b", "long_a"], names
        assert all(n.startswith("short_") for n in names[2:]), names
