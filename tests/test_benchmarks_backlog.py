"""The benchmarks of a large store run in their quick modes, so their code cannot rot.

``benchmarks/recovery.py``, ``burst_brokers.py`` and ``cluster_scale.py``
(issue 34) each run as a user runs them (``python -m benchmarks.NAME
--quick --out FILE``, real servers, real companions), and what they count is
checked: a companion SIGKILLed mid-burst loses and doubles nothing, a Redis
restart from AOF loses nothing parked, every rate was measured.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.system, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parent.parent


def _run_quick(name: str, tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    # In a process group of its own, so that a run cut short takes the
    # servers it started with it (killed alone, it left a cluster's
    # redis-servers running for the rest of the suite)
    bench = subprocess.Popen(
        [sys.executable, "-m", f"benchmarks.{name}", "--quick", "--out", str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = bench.communicate(timeout=240)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(bench.pid, signal.SIGKILL)
        bench.wait()
    assert bench.returncode == 0, stderr[-3000:]
    assert "load average" in stdout  # the table, with the machine's load beside it
    result: dict[str, Any] = json.loads(out.read_text())
    assert [p["parked"] for p in result["points"]] == [0, 10_000]
    return result


def test_recovery_quick_counts_every_id(tmp_path: Path) -> None:
    result = _run_quick("recovery", tmp_path)
    for point in result["points"]:
        (kill,) = point["runs"]["kill"]
        assert kill["mid_burst"], kill  # killed while releasing, not after
        assert kill["ids"]["missing"] == 0, kill
        # A Redis broker on the store's server is exactly once (docs/guarantees.rst).
        assert kill["ids"]["duplicates"] == 0, kill
        assert kill["ids"]["unexpected"] == 0, kill
        assert kill["ids"]["delivered"] == result["burst_n"], kill
        (restart,) = point["runs"]["restart"]
        assert restart["lost"] == 0, restart
        assert restart["parked_after"] >= point["parked"], restart
        assert point["start_first_release_s"]["median"] > 0


def test_burst_brokers_quick_measures_both_brokers(tmp_path: Path, rabbitmq: Any) -> None:
    result = _run_quick("burst_brokers", tmp_path)
    for point in result["points"]:
        for broker in ("redis", "rabbitmq"):
            (run,) = point["runs"][broker]
            assert run["n"] == result["burst_n"]
            assert run["seconds"] > 0


def test_cluster_scale_quick_measures_each_master_count(tmp_path: Path) -> None:
    result = _run_quick("cluster_scale", tmp_path)
    for point in result["points"]:
        assert set(point["per_masters"]) == {"1", "2", "3"}
        for masters, figures in point["per_masters"].items():
            (run,) = figures["runs"]
            assert run["park_rate"] > 0
            assert run["release_rate"] > 0
            assert len(run["release_redis_cpu_us_per_task"]) == int(masters)
