"""Periodic tasks: the companion (``--beat``) against ``celery beat``, side by side.

Each scenario runs on its own private Redis (broker, store and record) with
its own solo worker, all at the same time, serving the same schedule: the
task ``bench.tick`` every second with ``relative=True``, so the nominal time
of every tick is a whole second on both sides (Celery's own rounding). The
worker records when each tick started, on the Redis clock.

* **Lateness**: start time minus the whole second the tick belongs to, for one
  companion and for one ``celery beat`` (both with the default settings).
* **Failover**: ticks lost and duplicated while one process is SIGKILLed half
  way through: two companions (one killed), two ``celery beat`` processes
  (one killed; until then they both send every tick), and one ``celery beat``
  killed and restarted at once, as a supervisor would. Every whole second of
  the window between the first tick and the end is a slot: no tick in it is
  a lost tick, each tick beyond one is a duplicate.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from .common import QUICK, Sizes, quantiles
from .infra import CeleryProcess, MachineLoad, Resources
from .proj import TICKS_KEY, make_app

#: The schedule both sides serve.
SCHEDULE = {"tick": {"task": "bench.tick", "schedule": 1.0, "relative": True}}
#: Seconds at the start (processes settling) left out of the failover window.
WARMUP_SECONDS = 3.0


def run_beat(sizes: Sizes) -> dict[str, Any]:
    seconds = 20.0 if sizes == QUICK else 60.0
    load = MachineLoad()
    with Resources() as res:
        scenarios = {
            "companion": _Scenario(res, "companion", count=1),
            "celery beat": _Scenario(res, "beat", count=1),
            "companion x2, one killed": _Scenario(res, "companion", count=2, kill=True),
            "celery beat x2, one killed": _Scenario(res, "beat", count=2, kill=True),
            "celery beat, killed and restarted": _Scenario(res, "beat", count=1, kill=True),
        }
        started = time.monotonic()
        half_done = False
        while time.monotonic() - started < seconds:
            time.sleep(0.2)
            if not half_done and time.monotonic() - started >= seconds / 2:
                half_done = True
                for scenario in scenarios.values():
                    scenario.fail_over()
        results = {name: scenario.collect() for name, scenario in scenarios.items()}
    result: dict[str, Any] = {
        "seconds": seconds,
        "machine": load.stop(),
        "scenarios": results,
    }
    companion = results["companion"]["lateness_ms"]
    beat = results["celery beat"]["lateness_ms"]
    if companion and beat:
        # Both floors of 1 ms: a ratio, not a division by a zero lateness.
        result["beat_p50_over_companion_p50"] = round(
            max(beat["p50"], 1.0) / max(companion["p50"], 1.0), 1
        )
    return result


class _Scenario:
    """One side: a Redis, a worker, and the processes that serve the schedule."""

    def __init__(self, res: Resources, kind: str, *, count: int, kill: bool = False) -> None:
        self.res = res
        self.kind = kind
        self.kill = kill
        server = res.redis()
        url = f"{server.url}/0"
        self.record = server.client(1)
        conf = {"beat_schedule": SCHEDULE, "zdelay_beat": kind == "companion"}
        self.app = make_app(broker=url, store=url, record=f"{server.url}/1", conf=conf)
        res.callback(self.app.close)
        res.worker(self.app)
        self.processes = [self._start() for _ in range(count)]
        self.restart_at: float | None = None

    def _start(self) -> CeleryProcess:
        if self.kind == "companion":
            return self.res.companion(self.app)
        # Each beat has its own schedule file, as on separate hosts.
        folder = tempfile.mkdtemp(prefix="zbench-beat-")
        process = CeleryProcess(
            self.app,
            ["beat", "-l", "INFO", "-s", str(Path(folder) / "schedule"), "--pidfile="],
        )
        self.res.callback(process.stop)
        process.start()
        process.wait_for_log("beat: Starting...")
        return process

    def fail_over(self) -> None:
        if not self.kill:
            return
        self.processes[0].stop(kill=True)  # SIGKILL: no goodbye
        if len(self.processes) == 1:
            self.processes[0] = self._start()

    def collect(self) -> dict[str, Any]:
        ticks = [json.loads(raw) for raw in self.record.lrange(TICKS_KEY, 0, -1)]
        starts = sorted(ms for _, ms in ticks)
        lateness = [ms % 1000 for ms in starts]
        result: dict[str, Any] = {
            "ticks": len(starts),
            "lateness_ms": quantiles([float(ms) for ms in lateness]),
        }
        if self.kill and starts:
            first = starts[0] // 1000 + int(WARMUP_SECONDS)
            last = starts[-1] // 1000 - 1
            per_slot = Counter(ms // 1000 for ms in starts if first <= ms // 1000 <= last)
            slots = range(first, last + 1)
            result["window_ticks_expected"] = len(slots)
            result["lost"] = sum(1 for s in slots if per_slot[s] == 0)
            result["duplicated"] = sum(max(0, per_slot[s] - 1) for s in slots)
        return result


def console_lines(entry: dict[str, Any]) -> list[str]:
    """The benchmark's lines under the suite's table."""
    lines = ["", f"Periodic tasks, a 1-second schedule for {entry['seconds']:g} s, side by side:"]
    for name, s in entry["scenarios"].items():
        late = s["lateness_ms"]
        line = f"  {name:36} {s['ticks']:4d} ticks"
        if late:
            line += f", lateness p50 {late['p50']:.0f} ms, p99 {late['p99']:.0f} ms"
        if "lost" in s:
            line += (
                f"; across the failover {s['lost']} lost, {s['duplicated']} duplicated "
                f"of {s['window_ticks_expected']}"
            )
        lines.append(line)
    if "beat_p50_over_companion_p50" in entry:
        lines.append(
            f"  celery beat's median lateness is {entry['beat_p50_over_companion_p50']:g}x "
            "the companion's (lateness: tick start on the worker minus its whole second)"
        )
    return lines
