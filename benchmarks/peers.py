"""celery-zdelay beside what users would pick instead, measured in one run.

``python -m benchmarks.peers [--quick]`` (or ``python -m benchmarks --only
peers``) runs the same workloads on each system of
:data:`benchmarks.peers_app.SYSTEMS`, one after the other, each on fresh
private servers, with the same worker (``celery worker -P threads -c 8``):

timeline (lateness, burst, what a user can do)
    ``lateness_n`` tasks due over ``window_s`` seconds starting ``lead_s``
    seconds after scheduling begins, then ``burst_n`` tasks due at one instant
    ``gap_s`` later. Each run of the task appends its start time (the
    machine's clock, which the Redis and RabbitMQ servers here share) to a
    Redis of the benchmark's own. Lateness = start - due; early = starts
    before the due time; runs per task counted by sequence number. Burst:
    due -> the last burst task started. Right after scheduling, the producer
    tries the system's own way to list what is scheduled (is one waiting
    task's id there?), cancel one task (it must then not run) and move one
    to a later due time (it must run then, once). Runs are counted until all
    expected ones started or ``cap_s`` after the burst's due time.
waiting memory
    ``memory_n`` tasks due a day later: worker RSS added (VmRSS of the
    threads-pool worker, before and after) and broker or store memory per
    task (Redis ``used_memory`` delta; RabbitMQ: its queues' ``memory``
    from ``rabbitmqctl list_queues``), and where they wait, counted from the
    system's own keys or queues (which proves each system delays the way its
    docs say: RabbitMQ's delay queues, celery-redis-plus's sorted set).

celery-redis-plus needs Python 3.13: the benchmark makes a virtualenv with
it and celery-longterm-scheduler under ``~/.cache/celery-zdelay-bench/``
(``ZBENCH_CACHE`` overrides it) on first use, and runs their workers and
producers there. A system that cannot be set up says so in its row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import redis

from .common import now_ms, quantiles
from .infra import (
    RABBITMQ_URL,
    RESULTS_DIR,
    ROOT,
    BenchmarkError,
    CeleryProcess,
    MachineLoad,
    Resources,
    interrupts_as_keyboard_interrupt,
    loadavg,
    machine_info,
    rabbitmq_version,
    redis_version,
    rss_bytes,
    unique,
    used_memory,
    wait_for,
)
from .peers_app import QUEUE, RUNS_KEY, SYSTEMS

MIB = 1024 * 1024
DOCS_PLOT = ROOT / "docs" / "_static" / "peers.png"

#: Competitors installed into the benchmark's own Python 3.13 virtualenv,
#: pinned: a figure names the version it measured.
COMPETITORS = {
    "redis-plus": "celery-redis-plus[redis]==0.4.1",
    # packaging: celery.backends.redis, which it imports, needs kombu's Redis
    # extra; of that extra only packaging is not already in the venv.
    "longterm": "celery-longterm-scheduler==1.3.1 packaging",
}
#: The interpreter celery-redis-plus needs (Requires-Python >= 3.13).
PYTHON_313 = os.environ.get("ZBENCH_PYTHON313", "/root/.pyenv/versions/3.13.0/bin/python3.13")
#: celery-longterm-scheduler's README: "a cronjob ... (e.g. every 5 minutes)".
LONGTERM_CRON_SECONDS = 300
#: The same worker for every system.
WORKER_POOL, WORKER_CONCURRENCY = "threads", 8


@dataclass(frozen=True)
class PeerSizes:
    lateness_n: int
    #: Seconds from the start of scheduling to the first due time; above 60 s
    #: so celery-redis-plus keeps tasks in its sorted set (shorter delays go
    #: straight to the worker's ETA timer, by its design).
    lead_s: float
    window_s: float
    burst_n: int
    gap_s: float
    #: Seconds after the burst's due time that runs are still waited for.
    cap_s: float
    memory_n: int
    settle_s: float
    #: Cron interval of celery-longterm-scheduler's release command.
    cron_s: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


QUICK = PeerSizes(
    lateness_n=300,
    lead_s=8.0,
    window_s=3.0,
    burst_n=500,
    gap_s=2.0,
    cap_s=8.0,
    memory_n=1_000,
    settle_s=1.0,
    cron_s=5.0,
)
FULL = PeerSizes(
    lateness_n=4_000,
    lead_s=100.0,
    window_s=20.0,
    burst_n=6_000,
    gap_s=5.0,
    cap_s=60.0,
    memory_n=10_000,
    settle_s=3.0,
    cron_s=LONGTERM_CRON_SECONDS,
)


# -- the competitors' virtualenv ------------------------------------------------------


def cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "celery-zdelay-bench"
    return Path(os.environ.get("ZBENCH_CACHE", default))


def competitor_python(system: str) -> tuple[str | None, str]:
    """Return (the venv's python, "") or (None, why it could not be set up)."""
    venv = cache_dir() / "peers-py3.13"
    python = venv / "bin" / "python"
    if not python.exists():
        if not Path(PYTHON_313).exists():
            return None, f"Python 3.13 not found at {PYTHON_313} (set ZBENCH_PYTHON313)"
        made = subprocess.run(
            [PYTHON_313, "-m", "venv", str(venv)], capture_output=True, text=True, check=False
        )
        if made.returncode:
            return None, f"python3.13 -m venv failed: {made.stderr.strip()[-300:]}"
    module = {
        "redis-plus": "celery_redis_plus",
        "longterm": "celery_longterm_scheduler.backend, kombu.transport.redis",
    }[system]
    check = [str(python), "-c", f"import {module}"]
    if subprocess.run(check, capture_output=True, check=False).returncode:
        installed = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", *COMPETITORS[system].split()],
            capture_output=True,
            text=True,
            check=False,
        )
        if installed.returncode:
            lines = [x for x in installed.stderr.splitlines() if not x.startswith("WARNING")]
            return None, f"pip install {COMPETITORS[system]} failed: {' '.join(lines)[-300:]}"
    return str(python), ""


def competitor_version(python: str, system: str) -> str:
    dist = COMPETITORS[system].split("[")[0].split("=")[0]
    code = f"from importlib.metadata import version; print(version({dist!r}))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    return out.stdout.strip()


# -- RabbitMQ: a vhost of its own --------------------------------------------------------


def _rabbitmqctl(*args: str) -> str:
    result = subprocess.run(
        ["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode:
        raise BenchmarkError(f"rabbitmqctl {' '.join(args)}: {result.stderr.strip()[-300:]}")
    return result.stdout


@contextlib.contextmanager
def rabbitmq_vhost() -> Iterator[tuple[str, str]]:
    """A vhost of the benchmark's own for guest, deleted at the end: (name, URL)."""
    name = unique("zbench-peers")
    user = RABBITMQ_URL.split("//", 1)[1].split(":", 1)[0]
    _rabbitmqctl("add_vhost", name)
    try:
        _rabbitmqctl("set_permissions", "-p", name, user, ".*", ".*", ".*")
        scheme, rest = RABBITMQ_URL.split("://", 1)
        yield name, f"{scheme}://{rest.split('/', 1)[0]}/{name}"
    finally:
        with contextlib.suppress(Exception):
            _rabbitmqctl("delete_vhost", name)


def rabbitmq_queues(vhost: str) -> dict[str, tuple[int, int]]:
    """Return each queue of *vhost*: (messages, memory bytes)."""
    out = _rabbitmqctl(
        "list_queues", "-p", vhost, "--no-table-headers", "name", "messages", "memory"
    )
    queues = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1].isdigit():
            queues[parts[0]] = (int(parts[1]), int(parts[2]))
    return queues


# -- one system on its own servers ----------------------------------------------------------


class System:
    """One system's servers, worker, companion and producer, on fresh private servers."""

    def __init__(self, res: Resources, name: str, python: str, sizes: PeerSizes) -> None:
        self.res, self.name, self.python, self.sizes = res, name, python, sizes
        record = res.redis()
        self.record = record.client()
        res.callback(self.record.close)
        self.redis: list[redis.Redis] = []
        self.vhost = ""
        if name.endswith("rabbitmq") or name == "rabbitmq-delayed":
            self.vhost, broker = res.stack.enter_context(rabbitmq_vhost())
            store = ""
            if name.startswith("zdelay"):
                store_server = res.redis()
                store = f"{store_server.url}/0"
                self.redis.append(store_server.client())
        else:
            server = res.redis()
            broker = f"{server.url}/0"
            self.redis.append(server.client())
            # celery-longterm-scheduler's README: another db of the same Redis.
            store = f"{server.url}/1" if name == "longterm" else broker
        for client in self.redis:
            res.callback(client.close)
        self.env = {
            "ZPEERS_SYSTEM": name,
            "ZPEERS_BROKER": broker,
            "ZPEERS_STORE": store,
            "ZPEERS_RECORD": f"{record.url}/0",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        self.worker: CeleryProcess | None = None

    def start(self) -> None:
        self.worker = self.res.worker(
            None,
            pool=WORKER_POOL,
            concurrency=WORKER_CONCURRENCY,
            env=self.env,
            python=self.python,
            module="benchmarks.peers_app",
        )
        # A warm stop would hand held ETA tasks back to the broker: not measured.
        worker = self.worker
        self.res.callback(lambda: worker.stop(timeout=5, kill=True))
        if self.name.startswith("zdelay"):
            self.res.companion(None, env=self.env, module="benchmarks.peers_app")
        elif self.name == "longterm":
            cron = _Cron(self.python, self.env, self.sizes.cron_s)
            self.res.callback(cron.stop)
            cron.start()

    def client(self, command: str, request: dict[str, Any]) -> dict[str, Any]:
        result = subprocess.run(
            [self.python, "-m", "benchmarks.peers_app", command],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, **self.env},
            timeout=900,
            check=False,
        )
        if result.returncode:
            raise BenchmarkError(f"{self.name} {command}: {result.stderr.strip()[-2000:]}")
        answer: dict[str, Any] = json.loads(result.stdout)
        return answer

    def memory_bytes(self) -> int:
        """Memory of where the tasks wait: Redis used_memory (+ RabbitMQ queues)."""
        total = sum(used_memory(client) for client in self.redis)
        if self.vhost:
            total += sum(memory for _, memory in rabbitmq_queues(self.vhost).values())
        return total

    def waiting(self) -> dict[str, int]:
        """Where the scheduled tasks are, from the system's own keys and queues."""
        if self.vhost:
            queues = rabbitmq_queues(self.vhost)
            found = {
                "rabbitmq_delay_queues": sum(
                    m for q, (m, _) in queues.items() if q.startswith("celery_delayed_")
                ),
                "rabbitmq_task_queue": queues.get(QUEUE, (0, 0))[0],
            }
            if self.name.startswith("zdelay"):
                found["zdelay_store"] = _zdelay_parked(self.redis[0])
            return found
        client = self.redis[0]
        if self.name == "native-redis":
            return {
                "kombu_queue_list": client.llen(QUEUE),
                "worker_unacked": client.hlen("unacked"),
            }
        if self.name == "redis-plus":
            return {
                "redis_plus_messages_index": client.zcard(f"messages_index:{QUEUE}"),
                "redis_plus_queue": client.zcard(f"queue:{QUEUE}"),
            }
        if self.name == "longterm":
            store = redis.Redis.from_url(self.env["ZPEERS_STORE"])
            try:
                return {"longterm_sorted_set": store.zcard("scheduled_task_id_by_time")}
            finally:
                store.close()
        return {"zdelay_store": _zdelay_parked(client), "kombu_queue_list": client.llen(QUEUE)}

    def runs(self) -> list[tuple[int, int]]:
        """Every recorded run: (seq, started µs)."""
        return [
            (int(seq), int(started))
            for seq, started in (item.split() for item in self.record.lrange(RUNS_KEY, 0, -1))
        ]


def _zdelay_parked(client: redis.Redis) -> int:
    # The status counts of `celery zdelay status`, read from the store's due sets.
    total = 0
    for key in client.scan_iter(match="*:due", count=1000):
        total += int(client.zcard(key))
    return total


class _Cron(threading.Thread):
    """``celery longterm_scheduler`` every *interval* seconds, on wall-clock multiples (cron)."""

    def __init__(self, python: str, env: dict[str, str], interval: float) -> None:
        super().__init__(name="zbench-cron", daemon=True)
        self.python, self.env, self.interval = python, env, interval
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            now = time.time()
            if self._halt.wait(self.interval - now % self.interval):
                return
            subprocess.run(
                [self.python, "-m", "celery", "-A", "benchmarks.peers_app", "longterm_scheduler"],
                cwd=ROOT,
                env={**os.environ, **self.env},
                capture_output=True,
                check=False,
            )

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=120)


# -- workloads ---------------------------------------------------------------------------


def run_timeline(system: System, sizes: PeerSizes) -> dict[str, Any]:
    """Lateness, burst and a user's actions, on one timeline of one worker."""
    n, b = sizes.lateness_n, sizes.burst_n
    system.start()
    begin = now_ms()
    first_due = begin + int(sizes.lead_s * 1000)
    window_ms = int(sizes.window_s * 1000)
    burst_due = first_due + window_ms + int(sizes.gap_s * 1000)
    due = {seq: first_due + seq * window_ms // n for seq in range(n)}
    due.update(dict.fromkeys(range(n, n + b), burst_due))
    cancel_seq, move_seq, list_seq = n // 2, n // 4, n * 3 // 4
    moved_due = first_due + window_ms + int(sizes.gap_s * 500)
    sent = system.client("schedule", {"tasks": [[seq, due[seq]] for seq in sorted(due)]})
    if now_ms() > first_due:
        raise BenchmarkError(f"{system.name}: scheduling took past the first due time")
    actions = system.client(
        "act",
        {
            "list": list_seq,
            "list_due_ms": due[list_seq],
            "cancel": cancel_seq,
            "reschedule": {"seq": move_seq, "due_ms": moved_due},
        },
    )
    waiting = system.waiting()
    if actions["reschedule"]["accepted"]:
        due[move_seq] = moved_due
    expected = n + b - (1 if actions["cancel"]["accepted"] else 0)
    cap_s = sizes.cap_s
    if system.name == "longterm":
        # Its release runs from cron: give it one whole interval more.
        cap_s += sizes.cron_s
    deadline_ms = burst_due + int(cap_s * 1000)
    while now_ms() < deadline_ms:
        if system.record.llen(RUNS_KEY) >= expected and now_ms() > max(due.values()) + 1000:
            break
        time.sleep(0.25)
    time.sleep(1.0)  # a late duplicate of the last ones
    runs = system.runs()
    first: dict[int, int] = {}
    counts: Counter[int] = Counter()
    for seq, started_us in runs:
        counts[seq] += 1
        first[seq] = min(first.get(seq, started_us), started_us)
    steady = [s for s in range(n) if s not in (cancel_seq, move_seq)]
    lateness = [first[s] / 1000 - due[s] for s in steady if s in first]
    burst = [first[s] / 1000 - burst_due for s in range(n, n + b) if s in first]
    every = [s for s in due if s != cancel_seq or not actions["cancel"]["accepted"]]
    moved_ok = (
        actions["reschedule"]["accepted"]
        and counts[move_seq] == 1
        and first.get(move_seq, 0) / 1000 >= moved_due
    )
    return {
        "scheduled": n + b,
        "schedule_seconds": sent["seconds"],
        "schedule_rate": round((n + b) / max(sent["seconds"], 1e-3)),
        "waiting_after_schedule": waiting,
        "lateness_ms": quantiles(lateness),
        "early": sum(1 for x in lateness if x < 0),
        "lateness_not_run": sum(1 for s in steady if s not in first),
        "burst_n": b,
        "burst_started": len(burst),
        "burst_last_s": round(max(burst) / 1000, 3) if burst else None,
        "burst_p50_s": round(quantiles(burst)["p50"] / 1000, 3) if burst else None,
        "not_run": sum(1 for s in every if counts[s] == 0),
        "doubled": sum(1 for s in every if counts[s] > 1),
        "max_runs": max(counts.values()) if counts else 0,
        "cap_s": cap_s,
        "can": {
            "list": actions["list"],
            "cancel": {
                **actions["cancel"],
                "worked": counts[cancel_seq] == 0,
                # Tried before the task was due, or the figure says nothing.
                "in_time": actions["cancel"]["at_ms"] < due[cancel_seq],
            },
            "reschedule": {**actions["reschedule"], "worked": bool(moved_ok)},
        },
        # Kept for the plot, rounded to 0.1 ms.
        "samples_ms": [round(x, 1) for x in lateness],
    }


def run_waiting_memory(system: System, sizes: PeerSizes) -> dict[str, Any]:
    """N tasks a day out: worker RSS added and broker/store memory per task."""
    n = sizes.memory_n
    system.start()
    assert system.worker is not None
    time.sleep(sizes.settle_s)
    rss_idle = rss_bytes(system.worker.pid)
    before = system.memory_bytes()
    day_ms = now_ms() + 86_400_000
    sent = system.client("schedule", {"tasks": [[seq, day_ms + seq] for seq in range(n)]})

    def all_waiting() -> dict[str, int] | None:
        found = system.waiting()
        counted = max(v for k, v in found.items() if k not in ("kombu_queue_list",))
        queued = found.get("kombu_queue_list", 0)
        return found if counted >= n and not queued else None

    where = wait_for(
        all_waiting,
        timeout=120 + n / 200,
        interval=1.0,
        what=lambda: f"{system.name}: all {n} tasks waiting ({system.waiting()})",
    )
    time.sleep(sizes.settle_s)
    rss = rss_bytes(system.worker.pid)
    after = system.memory_bytes()
    return {
        "n": n,
        "schedule_seconds": sent["seconds"],
        "waiting": where,
        "worker_rss_idle_mib": round(rss_idle / MIB, 1),
        "worker_rss_added_mib": round((rss - rss_idle) / MIB, 1),
        "store_bytes_per_task": round((after - before) / n),
    }


def run_system(name: str, sizes: PeerSizes) -> dict[str, Any]:
    """Both workloads of one system, each on fresh servers; or why it could not run."""
    entry: dict[str, Any] = {"label": SYSTEMS[name]}
    python = sys.executable
    if name in COMPETITORS:
        found, why = competitor_python(name)
        if found is None:
            return {**entry, "error": why}
        python = found
        entry["version"] = competitor_version(python, name)
        entry["python"] = "3.13"
    if (name.endswith("rabbitmq") or name == "rabbitmq-delayed") and not rabbitmq_version():
        return {**entry, "error": f"RabbitMQ not reachable at {RABBITMQ_URL}"}
    load = MachineLoad()
    for workload, fn in (("timeline", run_timeline), ("memory", run_waiting_memory)):
        started = time.monotonic()
        try:
            with Resources() as res:
                entry[workload] = fn(System(res, name, python, sizes), sizes)
        except BenchmarkError as exc:
            entry[workload] = {"error": str(exc)}
        entry.setdefault("seconds", {})[workload] = round(time.monotonic() - started, 1)
    entry["machine"] = load.stop()
    return entry


def run_peers(sizes: PeerSizes, systems: list[str] | None = None) -> dict[str, Any]:
    started = datetime.now(timezone.utc)
    result: dict[str, Any] = {
        "started": started.isoformat(timespec="seconds"),
        "sizes": sizes.as_dict(),
        "worker": f"celery worker -P {WORKER_POOL} -c {WORKER_CONCURRENCY}",
        "uptime_before": _uptime(),
        "systems": {},
    }
    for name in systems or list(SYSTEMS):
        print(f"  peers: {name} ...", file=sys.stderr, flush=True)
        result["systems"][name] = run_system(name, sizes)
    result["uptime_after"] = _uptime()
    result["loadavg_after"] = loadavg()
    return result


def _uptime() -> str:
    out = subprocess.run(["uptime"], capture_output=True, text=True, check=False)
    return out.stdout.strip()


# -- output ---------------------------------------------------------------------------------


def _cancelled(check: dict[str, Any]) -> str:
    if check.get("accepted") and not check.get("in_time", True):
        return "not tried in time"
    return "yes" if check.get("accepted") and check.get("worked") else "no"


def _yes(check: dict[str, Any], key: str) -> str:
    return "yes" if check.get(key) else "no"


def rows(result: dict[str, Any]) -> list[list[str]]:
    """The comparison table: one row per system."""
    header = [
        "system",
        "scheduled per s",
        "lateness p50 / p99 / max (ms)",
        "early",
        "not run / doubled",
        "burst: due -> last started",
        "worker RSS added",
        "broker/store per task",
        "list / cancel / reschedule",
    ]
    table = [header]
    for entry in result["systems"].values():
        label = entry["label"] + (f" {entry['version']}" if entry.get("version") else "")
        if "error" in entry:
            table.append([label, f"not measured: {_last_line(entry['error'])}"] + [""] * 7)
            continue
        line = entry.get("timeline", {})
        memory = entry.get("memory", {})
        if "error" in line:
            cells = ["", f"not measured: {_last_line(line['error'])}", "", "", ""]
        else:
            q = line["lateness_ms"]
            not_run = line["lateness_not_run"]
            lat = f"{q['p50']:.1f} / {q['p99']:.1f} / {q['max']:.1f}" if q else "none ran"
            if not_run:
                lat += f" ({not_run:,} not run by the cap)"
            burst = (
                f"{line['burst_last_s']:.2f} s"
                if line["burst_started"] == line["burst_n"]
                else f"{line['burst_started']:,} of {line['burst_n']:,} in {line['cap_s']:g} s"
            )
            can = line["can"]
            cells = [
                f"{line['schedule_rate']:,}",
                lat,
                f"{line['early']:,}",
                f"{line['not_run']:,} / {line['doubled']:,}",
                burst,
                " / ".join(
                    [
                        _yes(can["list"], "listed"),
                        _cancelled(can["cancel"]),
                        _yes(can["reschedule"], "worked"),
                    ]
                ),
            ]
        if "error" in memory:
            mem = [f"not measured: {_last_line(memory['error'])}", ""]
        else:
            mem = [
                f"{memory['worker_rss_added_mib']:,.1f} MiB",
                f"{memory['store_bytes_per_task']:,} B",
            ]
        table.append([label, *cells[:5], *mem, cells[5] if len(cells) > 5 else ""])
    return table


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1][:160] if text.strip() else text


def table(result: dict[str, Any]) -> str:
    sizes = result["sizes"]
    lines = [
        f"Peers, {result['started']}: {sizes['lateness_n']:,} tasks due over "
        f"{sizes['window_s']:g} s from {sizes['lead_s']:g} s out, "
        f"{sizes['burst_n']:,} due at one instant; "
        f"{sizes['memory_n']:,} a day out; {result['worker']}",
        f"load: before: {result['uptime_before']}; after: {result['uptime_after']}",
    ]
    cells = rows(result)
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    for row in cells:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    return "\n".join(lines)


def rst_table(result: dict[str, Any]) -> str:
    """The same table as an RST list-table, for docs/comparison.rst."""
    out = [".. list-table::", "   :header-rows: 1", ""]
    for row in rows(result):
        for i, cell in enumerate(row):
            out.append(f"   {'* -' if i == 0 else '  -'} {cell or '—'}")
    return "\n".join(out)


def plot(result: dict[str, Any], path: Path) -> Path | None:
    """Lateness percentiles, burst and worker memory of each system, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, p50, p99, burst, rss = [], [], [], [], []
    for name, entry in result["systems"].items():
        line = entry.get("timeline") or {}
        q = line.get("lateness_ms") or {}
        memory = entry.get("memory") or {}
        if not q:
            continue
        names.append(name)
        p50.append(max(q["p50"], 0.01))
        p99.append(max(q["p99"], 0.01))
        burst.append(line["burst_last_s"] if line["burst_started"] == line["burst_n"] else 0.0)
        rss.append(max(memory.get("worker_rss_added_mib", 0.0), 0.0))
    if not names:
        return None
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(13, 4.2), dpi=110)
    ys = range(len(names))
    ax1.barh([y - 0.2 for y in ys], p50, height=0.4, label="p50", color="#3b75af")
    ax1.barh([y + 0.2 for y in ys], p99, height=0.4, label="p99", color="#d62728")
    ax1.set_xscale("log")
    ax1.set_xlabel("lateness: started - due (ms, log)")
    ax1.legend()
    ax2.barh(list(ys), burst, color="#2ca02c")
    ax2.set_xlabel(f"burst of {result['sizes']['burst_n']:,}: due -> last started (s)")
    for y, value in zip(ys, burst, strict=True):
        if not value:
            ax2.text(0, y, " not all within the cap", va="center", fontsize=8)
    ax3.barh(list(ys), rss, color="#9467bd")
    ax3.set_xlabel(f"worker RSS added, {result['sizes']['memory_n']:,} waiting (MiB)")
    for ax in (ax1, ax2, ax3):
        ax.set_yticks(list(ys))
        ax.set_yticklabels(names if ax is ax1 else [])
        ax.invert_yaxis()
    fig.suptitle(f"celery-zdelay and its peers, one run ({result['started']})", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.peers", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes (about 4 minutes on 2 busy cores)"
    )
    parser.add_argument("--systems", help=f"comma-separated, of: {', '.join(SYSTEMS)}")
    parser.add_argument(
        "--update-docs", action="store_true", help=f"also write the plot to {DOCS_PLOT}"
    )
    parser.add_argument("--rst", action="store_true", help="also print the table as RST")
    args = parser.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",")] if args.systems else None
    with interrupts_as_keyboard_interrupt():
        try:
            result = run_peers(QUICK if args.quick else FULL, systems)
        except KeyboardInterrupt:
            print("\ninterrupted: every server and process started was stopped", file=sys.stderr)
            return 130
    result["mode"] = "quick" if args.quick else "full"
    result["machine"] = _machine()
    stamp = result["started"].replace("-", "").replace(":", "").replace("+0000", "Z")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / f"{stamp}-peers.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    png = plot(result, out.with_suffix(".png"))
    if args.update_docs and png is not None:
        DOCS_PLOT.write_bytes(png.read_bytes())
    print(table(result))
    if args.rst:
        print()
        print(rst_table(result))
    print(f"\nresults: {out}" + (f", plot: {png}" if png else ""))
    failed = [n for n, e in result["systems"].items() if "error" in e]
    return 1 if failed and not all(n in COMPETITORS for n in failed) else 0


def _machine() -> dict[str, Any]:
    from celery_zdelay.testing import RedisServer

    with RedisServer() as probe:
        return machine_info(redis_version(probe), rabbitmq_version())


if __name__ == "__main__":
    sys.exit(main())
