"""A companion's start, its recovery after SIGKILL, a Redis restart from AOF, with a backlog.

``python -m benchmarks --only recovery``, or
``python -m benchmarks.recovery [--quick] [--sizes 0,100000,1000000] [--rounds 3] [--burst N]``.

One private Redis, broker and store (the atomic handoff), run as the docs
tell users to run it: ``appendonly yes``, ``appendfsync everysec``. Its
backlog grows through the sizes (0, 100,000, 1,000,000 parked 30 to 180 days
ahead; quick: 0 and 10,000). At each size, rounds of three measurements one
after the other, so a burst of load from other work lands on all alike:

- **start**: the companion stopped, one task parked already due; seconds from
  ``celery zdelay``'s process start until its start-up line, and until that
  task is in the broker's list (its first release).
- **SIGKILL mid-burst**: a burst (100,000; quick 20,000) due at one instant;
  once a quarter of it is in the broker the companion is SIGKILLed and a new
  one started at once. Seconds from the kill until releases resume (the list
  grows again) and until the whole burst is in the list; then every message's
  task id is counted against the burst's: none missing, and no duplicate (a
  Redis broker on the store's server is exactly once: docs/guarantees.rst).
- **Redis restart from AOF**: a task parked due 0.1 s after the planned kill;
  one second later (``everysec``: its park is on disk) Redis is SIGKILLed and
  started again on the same port. Seconds until it answers ``PING`` (it has
  loaded the AOF), and from then until the running companion has released
  that task; the entries parked before and after the restart.

Each figure is the median of the rounds with min-max.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from celery_zdelay.testing import redis_server

from .backlog import (
    SIZES_FULL,
    SIZES_QUICK,
    LoadRecord,
    calibrate,
    cell,
    count_ids,
    ids_in_list,
    park_burst,
    park_due_at_once,
    parse_sizes,
    summary,
)
from .common import now_ms, wait_for_list
from .infra import BenchmarkError, CeleryProcess, Resources, loadavg
from .proj import make_app
from .scale import _Filler

ROUNDS_FULL, ROUNDS_QUICK = 3, 1
BURST_FULL, BURST_QUICK = 100_000, 20_000
#: The companion is killed once this share of the burst is in the broker.
KILL_AT = 0.25
#: Loading a large AOF takes longer than RedisServer's start-up allowance.
LOAD_TIMEOUT_S = 900.0


def run_recovery(
    sizes: tuple[int, ...] = SIZES_FULL,
    *,
    quick: bool = False,
    burst: int | None = None,
    rounds: int | None = None,
) -> dict[str, Any]:
    rounds = rounds or (ROUNDS_QUICK if quick else ROUNDS_FULL)
    burst_n = burst or (BURST_QUICK if quick else BURST_FULL)
    started = time.monotonic()
    load = LoadRecord()
    result: dict[str, Any] = {
        "sizes": list(sizes),
        "rounds": rounds,
        "burst_n": burst_n,
        "redis": "one private Redis, broker and store; appendonly yes, appendfsync everysec",
        "points": [],
    }
    with Resources() as res:
        server = res.redis(appendonly="yes", appendfsync="everysec")
        url = f"{server.url}/0"
        app = make_app(broker=url, store=url)
        res.callback(app.close)
        client = server.client()
        res.callback(client.close)
        filler = _Filler(app)
        result["redis_version"] = str(client.info("server")["redis_version"])
        result["calibration_park_rate"] = round(calibrate(filler, app))
        bench = _Bench(app, res, server, client, filler)
        bench.companion = bench.spawn()
        bench.companion.wait_for_log(" started: ")
        parked = 0
        for size in sizes:
            print(f"recovery: filling to {size:,} ...", file=sys.stderr, flush=True)
            filler.grow(client, size - parked)
            parked = size
            point_load = LoadRecord()
            runs: dict[str, list[dict[str, Any]]] = {"start": [], "kill": [], "restart": []}
            for round_no in range(rounds):
                print(f"recovery: {size:,} parked, round {round_no + 1}", file=sys.stderr)
                runs["start"].append(bench.start())
                runs["kill"].append(bench.kill(burst_n))
                runs["restart"].append(bench.restart())
            point = {"parked": size, "runs": runs, **_summarise(runs)}
            point["redis_used_memory_bytes"] = int(client.info("memory")["used_memory"])
            point["aof_bytes"] = int(client.info("persistence").get("aof_current_size", 0))
            point["machine"] = point_load.stop()
            result["points"].append(point)
            print(_line(point), file=sys.stderr, flush=True)
    result["machine"] = load.stop()
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


class _Bench:
    """The three measurements on one Redis, one backlog, one running companion."""

    def __init__(
        self, app: Celery, res: Resources, server: Any, client: redis.Redis, filler: _Filler
    ) -> None:
        self.app, self.res, self.server, self.client, self.filler = app, res, server, client, filler
        self.queue = str(app.conf.task_default_queue)
        self.companion: CeleryProcess | None = None

    def spawn(self) -> CeleryProcess:
        process = CeleryProcess(self.app, ["zdelay", "-l", "INFO"])
        self.res.callback(process.stop)
        return process.start()

    def start(self) -> dict[str, Any]:
        """Stopped companion, one task due: process start -> start-up line, first release."""
        assert self.companion is not None
        self.companion.stop()
        self.client.delete(self.queue)
        park_burst(self.filler, 1, now_ms() - 1000)
        began = time.monotonic()
        self.companion = process = self.spawn()
        logged = released = None
        deadline = began + 120
        while logged is None or released is None:
            now = time.monotonic()
            if now > deadline or (process.process and process.process.poll() is not None):
                raise BenchmarkError(f"recovery: companion did not start:\n{process.log()[-2000:]}")
            if logged is None and " started: " in process.log():
                logged = now - began
            if released is None and self.client.llen(self.queue):
                released = now - began
            time.sleep(0.005)
        return {"started_line_s": round(logged, 3), "first_release_s": round(released, 3)}

    def kill(self, n: int) -> dict[str, Any]:
        """SIGKILL the companion a quarter into a burst, start another: resume, all, ids."""
        assert self.companion is not None
        self.client.delete(self.queue)
        burst = park_due_at_once(self.filler, n)
        ids, due = burst["ids"], burst["due"]
        threshold = max(1, int(n * KILL_AT))
        deadline = time.monotonic() + 60 + n / 1000
        while int(self.client.llen(self.queue)) < threshold:
            if time.monotonic() > deadline:
                raise BenchmarkError("recovery: the burst did not start within the deadline")
            time.sleep(0.001)
        self.companion.stop(kill=True)
        killed = time.monotonic()
        kill_ms = now_ms()
        at_kill = int(self.client.llen(self.queue))
        self.companion = self.spawn()
        resumed = None
        if at_kill < n:
            while int(self.client.llen(self.queue)) <= at_kill:
                if time.monotonic() > deadline:
                    raise BenchmarkError("recovery: no release after the kill within the deadline")
                time.sleep(0.002)
            resumed = time.monotonic() - killed
        _, all_ms = wait_for_list(self.client, self.queue, n, deadline, "recovery")
        counted = count_ids(ids, ids_in_list(self.client, self.queue))
        self.client.delete(self.queue)
        return {
            "n": n,
            "park_s": round(burst["park_s"], 2),
            "parked_before_due": burst["valid"],
            "in_broker_at_kill": at_kill,
            "mid_burst": at_kill < n,
            "resume_after_kill_s": None if resumed is None else round(resumed, 3),
            "all_after_kill_s": round((all_ms - kill_ms) / 1000, 3),
            "all_after_due_s": round((all_ms - due) / 1000, 3),
            "ids": counted,
        }

    def restart(self) -> dict[str, Any]:
        """SIGKILL Redis, start it on the same port: seconds to PING, then to a release."""
        assert self.companion is not None
        self.client.delete(self.queue)
        before = self._parked()
        kill_ms = now_ms() + 1_100
        park_burst(self.filler, 1, kill_ms + 100)
        # appendfsync everysec: a write is on disk within a second of its reply.
        time.sleep(max(0.0, (kill_ms - now_ms()) / 1000))
        aof = int(self.client.info("persistence").get("aof_current_size", 0))
        self.server.kill()
        began = time.monotonic()
        saved = redis_server.START_TIMEOUT
        redis_server.START_TIMEOUT = LOAD_TIMEOUT_S
        try:
            self.server.start()  # returns once PING answers (past LOADING)
        finally:
            redis_server.START_TIMEOUT = saved
        ready_s = time.monotonic() - began
        ready_ms = now_ms()
        for client in (self.client, self.filler.store.client):
            _reconnect(client)
        first_ms, _ = wait_for_list(
            self.client, self.queue, 1, time.monotonic() + 120, "recovery: release after restart"
        )
        assert first_ms is not None
        after = self._parked()
        self.client.delete(self.queue)
        return {
            "aof_bytes": aof,
            "ready_s": round(ready_s, 3),
            "release_after_ready_s": round((first_ms - ready_ms) / 1000, 3),
            "release_after_kill_s": round((first_ms - kill_ms) / 1000, 3),
            "parked_before": before,
            "parked_after": after,
            # The probe was parked after *before* was read and released before *after*.
            "lost": before - after,
        }

    def _parked(self) -> int:
        store = self.filler.store
        return sum(int(self.client.zcard(store.keys(s).due)) for s in store.shards)


def _reconnect(client: Any) -> None:
    """A pooled connection to the killed server fails once; the pool then opens a new one."""
    for _ in range(3):
        try:
            client.ping()
            return
        except redis.ConnectionError:
            continue
    client.ping()


def _summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    def of(kind: str, field: str) -> dict[str, Any] | None:
        values = [r[field] for r in runs[kind] if r.get(field) is not None]
        return summary(values) if values else None

    ids = [r["ids"] for r in runs["kill"]]
    return {
        "start_line_s": of("start", "started_line_s"),
        "start_first_release_s": of("start", "first_release_s"),
        "kill_resume_s": of("kill", "resume_after_kill_s"),
        "kill_all_s": of("kill", "all_after_kill_s"),
        "kill_ids": {
            key: sum(c[key] for c in ids)
            for key in ("expected", "delivered", "missing", "duplicates", "unexpected")
        },
        "kill_mid_burst": sum(1 for r in runs["kill"] if r["mid_burst"]),
        "restart_ready_s": of("restart", "ready_s"),
        "restart_release_after_ready_s": of("restart", "release_after_ready_s"),
        "restart_lost": sum(r["lost"] for r in runs["restart"]),
    }


def table(result: dict[str, Any]) -> str:
    points = result["points"]
    width = 24
    rows = [
        ("start: process -> started line (s)", "start_line_s"),
        ("start: process -> 1st release (s)", "start_first_release_s"),
        ("SIGKILL: kill -> releases resume (s)", "kill_resume_s"),
        (f"SIGKILL: kill -> all {result['burst_n']:,} (s)", "kill_all_s"),
        ("AOF restart: -> PING answers (s)", "restart_ready_s"),
        ("AOF restart: PING -> release (s)", "restart_release_after_ready_s"),
    ]
    lines = [
        f"Recovery with a backlog: median [min-max] of {result['rounds']} rounds; "
        + result["redis"],
        f"{'parked':<40}" + "".join(f"{p['parked']:>{width},}" for p in points),
    ]
    for label, key in rows:
        lines.append(f"{label:<40}" + "".join(f"{cell(p[key]):>{width}}" for p in points))
    lines.append(
        f"{'SIGKILL ids: missing/dup (of)':<40}"
        + "".join(
            f"{'{missing}/{duplicates} ({expected:,})'.format(**p['kill_ids']):>{width}}"
            for p in points
        )
    )
    lines.append(
        f"{'AOF restart: parked lost':<40}"
        + "".join(f"{p['restart_lost']:>{width}}" for p in points)
    )
    lines.append(
        f"{'AOF size (MB)':<40}" + "".join(f"{p['aof_bytes'] / 1e6:>{width},.0f}" for p in points)
    )
    lines.append(
        f"{'load average (1 min) start -> end':<40}"
        + "".join(f"{_loads(p):>{width}}" for p in points)
    )
    machine = result["machine"]
    lines.append(
        f"load average {machine['loadavg_start']} -> {machine['loadavg_end']}; "
        f"Redis {result['redis_version']}; {machine['note']}; took {result['seconds']} s"
    )
    return "\n".join(lines)


def _loads(point: dict[str, Any]) -> str:
    machine = point["machine"]
    return f"{machine['loadavg_start'][0]:.1f} -> {machine['loadavg_end'][0]:.1f}"


def _line(point: dict[str, Any]) -> str:
    return (
        f"recovery: {point['parked']:,} parked: start {cell(point['start_first_release_s'])} s, "
        f"kill -> all {cell(point['kill_all_s'])} s, AOF ready {cell(point['restart_ready_s'])} s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.recovery", description=__doc__)
    parser.add_argument("--quick", action="store_true", help=f"sizes {SIZES_QUICK}, one round")
    parser.add_argument("--sizes", type=parse_sizes, help="comma-separated, ascending")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--burst", type=int, help="tasks due at once in the SIGKILL measurement")
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    args = parser.parse_args(argv)
    sizes = args.sizes or (SIZES_QUICK if args.quick else SIZES_FULL)
    result = run_recovery(sizes, quick=args.quick, burst=args.burst, rounds=args.rounds)
    result["loadavg_end"] = loadavg()
    print(table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
