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
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import redis

from celery_zdelay.testing import RedisServer, free_port

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
from .peers_app import QUEUE, RUNS_KEY, SYSTEMS, task_id
from .rabbitmq_node import RabbitMQNode

MIB = 1024 * 1024
DOCS_PLOT = ROOT / "docs" / "_static" / "peers.png"

#: Competitors installed into the benchmark's own Python 3.13 virtualenv,
#: pinned: a figure names the version it measured.
#: Flower (the version of the project's constraints/dev.txt) comes too: the
#: Flower check runs it with the system's own app and transport.
COMPETITORS = {
    "redis-plus": "celery-redis-plus[redis]==0.4.1 flower==2.2.0",
    # packaging: celery.backends.redis, which it imports, needs kombu's Redis
    # extra; of that extra only packaging is not already in the venv.
    "longterm": "celery-longterm-scheduler==1.3.1 packaging flower==2.2.0",
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
    #: Restarts and Flower: ``wait_n`` tasks due from ``wait_lead_s`` over
    #: ``wait_window_s`` seconds, one component restarted ``restart_at_s``
    #: after scheduling began; runs counted until ``wait_cap_s`` after the last due.
    wait_n: int = 400
    wait_lead_s: float = 20.0
    wait_window_s: float = 40.0
    restart_at_s: float = 10.0
    wait_cap_s: float = 30.0

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
    wait_n=60,
    wait_lead_s=15.0,
    wait_window_s=6.0,
    restart_at_s=6.0,
    wait_cap_s=10.0,
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

#: celery-redis-plus hands a task to the worker's ETA timer when it is due
#: within 60 s (its sweep interval): its restart and Flower tasks are due that
#: much later, so they wait in its sorted set as its design intends.
REDIS_PLUS_HANDOVER_S = 60.0
#: celery-longterm-scheduler's release command in the restart runs, which
#: count tasks rather than time them: every 5 s, not every 5 minutes.
RESTART_CRON_S = 5.0
#: What each system has to restart: the broker, the worker, and its own process.
COMPONENTS = {
    "native-redis": ("broker", "worker"),
    "rabbitmq-delayed": ("broker", "worker"),
    "redis-plus": ("broker", "worker"),
    # Its release is a cron job, a new process each time: nothing stays up to restart.
    "longterm": ("broker", "worker"),
    "zdelay-redis": ("broker", "worker", "companion"),
    # Here the store is a Redis of its own, beside the RabbitMQ broker.
    "zdelay-rabbitmq": ("broker", "store", "worker", "companion"),
    "zdelay-redis-ahead": ("broker", "worker", "companion"),
    "zdelay-rabbitmq-ahead": ("broker", "store", "worker", "companion"),
}


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
        "redis-plus": "celery_redis_plus, flower",
        "longterm": "celery_longterm_scheduler.backend, kombu.transport.redis, flower",
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


def rabbitmq_queues(vhost: str, node: RabbitMQNode | None = None) -> dict[str, tuple[int, int]]:
    """Return each queue of *vhost* (of *node*, or the machine's): (messages, memory bytes)."""
    args = ("list_queues", "-p", vhost, "--no-table-headers", "name", "messages", "memory")
    if node is None:
        out = _rabbitmqctl(*args)
    else:
        listed = node.ctl(*args)
        if listed.returncode:
            raise BenchmarkError(f"rabbitmqctl list_queues: {listed.stderr.strip()[-300:]}")
        out = listed.stdout
    queues = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1].isdigit():
            queues[parts[0]] = (int(parts[1]), int(parts[2]))
    return queues


# -- one system on its own servers ----------------------------------------------------------


def is_rabbitmq(name: str) -> bool:
    return "rabbitmq" in name


class System:
    """One system's servers, worker, companion and producer, on fresh private servers.

    *durable*: its Redis servers keep an append-only file (``appendfsync
    everysec``, Redis's own advice for durability) and its RabbitMQ broker is
    a private node (:class:`RabbitMQNode`), so :meth:`restart` can restart
    them as a production server restarts. *events*: Celery's task events on.
    """

    def __init__(
        self,
        res: Resources,
        name: str,
        python: str,
        sizes: PeerSizes,
        *,
        durable: bool = False,
        events: bool = False,
        cron_s: float | None = None,
    ) -> None:
        self.res, self.name, self.python, self.sizes = res, name, python, sizes
        self.cron_s = sizes.cron_s if cron_s is None else cron_s
        record = res.redis()
        self.record = record.client()
        res.callback(self.record.close)
        self.redis: list[redis.Redis] = []
        self.vhost = ""
        self.node: RabbitMQNode | None = None
        # The servers restart() restarts, by component.
        self.servers: dict[str, RedisServer | RabbitMQNode] = {}
        config = {"appendonly": "yes", "appendfsync": "everysec"} if durable else {}
        if is_rabbitmq(name):
            if durable:
                self.node = RabbitMQNode()
                res.callback(self.node.stop)
                self.node.start()
                self.vhost, broker = "/", self.node.url
                self.servers["broker"] = self.node
            else:
                self.vhost, broker = res.stack.enter_context(rabbitmq_vhost())
            store = ""
            if name.startswith("zdelay"):
                store_server = res.redis(**config)
                store = f"{store_server.url}/0"
                self.redis.append(store_server.client())
                self.servers["store"] = store_server
        else:
            server = res.redis(**config)
            broker = f"{server.url}/0"
            self.redis.append(server.client())
            self.servers["broker"] = server
            # celery-longterm-scheduler's README: another db of the same Redis.
            store = f"{server.url}/1" if name == "longterm" else broker
        for client in self.redis:
            res.callback(client.close)
        self.env = {
            "ZPEERS_SYSTEM": name,
            "ZPEERS_BROKER": broker,
            "ZPEERS_STORE": store,
            "ZPEERS_RECORD": f"{record.url}/0",
            "ZPEERS_EVENTS": "1" if events else "0",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        self.worker: CeleryProcess | None = None
        self.companion: CeleryProcess | None = None

    def start(self) -> None:
        self.start_worker()
        if self.name.startswith("zdelay"):
            self.companion = self.res.companion(None, env=self.env, module="benchmarks.peers_app")
        elif self.name == "longterm":
            cron = _Cron(self.python, self.env, self.cron_s)
            self.res.callback(cron.stop)
            cron.start()

    def start_worker(self) -> None:
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

    def restart(self, component: str) -> None:
        """Restart *component* as an operator would: a clean stop, then a start.

        The worker gets Celery's warm shutdown (SIGTERM: it finishes what runs
        and hands the ETA tasks it holds back to the broker), the companion
        its SIGTERM, Redis ``SHUTDOWN`` (SIGTERM, the append-only file
        flushed), RabbitMQ ``rabbitmqctl stop``.
        """
        if component == "worker":
            assert self.worker is not None
            self.worker.stop(timeout=60)
            self.start_worker()
        elif component == "companion":
            assert self.companion is not None
            self.companion.stop(timeout=60)
            self.companion = self.res.companion(None, env=self.env, module="benchmarks.peers_app")
        else:
            self.servers[component].restart()

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
            total += sum(memory for _, memory in rabbitmq_queues(self.vhost, self.node).values())
        return total

    def waiting(self) -> dict[str, int]:
        """Where the scheduled tasks are, from the system's own keys and queues."""
        if self.vhost:
            queues = rabbitmq_queues(self.vhost, self.node)
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


class _Flower:
    """``celery flower`` with the system's own app (its interpreter, its transport).

    Read through its HTTP API; Flower lists what it learned from task events.
    """

    def __init__(self, system: System) -> None:
        self.system = system
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = CeleryProcess(
            None,
            ["flower", "--address=127.0.0.1", f"--port={self.port}"],
            # Flower 2's API answers without authentication only when told to.
            env={**system.env, "FLOWER_UNAUTHENTICATED_API": "true"},
            python=system.python,
            module="benchmarks.peers_app",
        )
        system.res.callback(self.process.stop)
        self.process.start()
        wait_for(lambda: self.tasks() is not None, timeout=90, interval=0.5, what="Flower up")
        # Flower sees events only once subscribed: send a marker until it shows.
        marker = unique("zpeers-marker")

        def marker_seen() -> bool:
            system.client("mark", {"marker": marker})
            return marker in (self.tasks() or {})

        wait_for(marker_seen, timeout=90, interval=1.0, what="Flower to receive events")

    def tasks(self) -> dict[str, dict[str, Any]] | None:
        """Flower's ``/api/tasks``: task id -> what it knows; None while not answering."""
        try:
            with urllib.request.urlopen(f"{self.url}/api/tasks?limit=100000", timeout=10) as r:
                found: dict[str, dict[str, Any]] = json.loads(r.read())
                return found
        except (OSError, ValueError):
            return None


def _seen_in_flower(found: dict[str, dict[str, Any]] | None, seqs: list[int]) -> dict[str, Any]:
    """How many of *seqs* Flower lists, in which states, how many with an ETA."""
    found = found or {}
    infos = [found[task_id(seq)] for seq in seqs if task_id(seq) in found]
    return {
        "of": len(seqs),
        "listed": len(infos),
        "with_eta": sum(1 for info in infos if info.get("eta")),
        "states": dict(Counter(str(info.get("state")) for info in infos)),
    }


def run_waiting(system: System, sizes: PeerSizes, component: str | None) -> dict[str, Any]:
    """Tasks waiting 20-60 s while *component* restarts; every id counted.

    With *component* None nothing restarts (the control), Celery's events are
    on and Flower watches: is each task listed there while it waits, with its
    ETA, and after it ran?
    """
    system.start()
    flower = _Flower(system) if component is None else None
    lead = sizes.wait_lead_s + (REDIS_PLUS_HANDOVER_S if system.name == "redis-plus" else 0.0)
    begin = now_ms()
    first_due = begin + int(lead * 1000)
    window_ms = int(sizes.wait_window_s * 1000)
    n = sizes.wait_n
    due = {seq: first_due + seq * window_ms // max(n - 1, 1) for seq in range(n)}
    system.client("schedule", {"tasks": [[seq, due[seq]] for seq in range(n)]})
    # At restart_at_s, or as soon as scheduling is done on a slow machine,
    # but while every task still waits.
    restart_ms = begin + int(sizes.restart_at_s * 1000)
    time.sleep(max(restart_ms - now_ms(), 0) / 1000)
    if now_ms() > first_due:
        raise BenchmarkError(f"{system.name}: scheduling took past the first due time")
    entry: dict[str, Any] = {"component": component or "none", "n": n, "lead_s": lead}
    entry["restarted_at_s"] = round((now_ms() - begin) / 1000, 1)
    entry["waiting_before"] = system.waiting()
    if flower is not None:
        # Flower takes in events one by one: look until just before the first
        # task is due, and keep the look that saw the most.
        looks: list[dict[str, Any]] = []
        while not looks or now_ms() < first_due - 2000:
            looks.append(_seen_in_flower(flower.tasks(), list(range(n))))
            if looks[-1]["with_eta"] == n:
                break
            time.sleep(1.0)
        entry["flower_before"] = max(looks, key=lambda seen: seen["with_eta"])
        entry["flower_looks"] = len(looks)
    if component is not None:
        started = time.monotonic()
        system.restart(component)
        entry["restart_seconds"] = round(time.monotonic() - started, 1)
        if now_ms() > first_due:
            entry["restart_ended_after_first_due"] = True
    last_due = max(due.values())
    deadline = last_due + int(sizes.wait_cap_s * 1000)
    if system.name == "longterm":
        deadline += int(system.cron_s * 1000)
    while now_ms() < deadline:
        if system.record.llen(RUNS_KEY) >= n and now_ms() > last_due + 1000:
            break
        time.sleep(0.25)
    time.sleep(2.0)  # a late duplicate of the last ones
    counts = Counter(seq for seq, _ in system.runs())
    # Where the ones not run are then (native ETA's unacked hash comes back
    # only after visibility_timeout, an hour by default: not waited for).
    entry["waiting_after"] = system.waiting()
    entry["lost"] = sum(1 for seq in range(n) if counts[seq] == 0)
    entry["doubled"] = sum(1 for seq in range(n) if counts[seq] > 1)
    entry["early"] = sum(1 for seq, started_us in system.runs() if started_us / 1000 < due[seq])
    if flower is not None:
        after = flower.tasks()
        entry["flower_after"] = _seen_in_flower(after, list(range(n)))
        entry["flower_example"] = (after or {}).get(task_id(0))
    return entry


def run_restarts(name: str, python: str, sizes: PeerSizes) -> dict[str, Any]:
    """The control (with Flower) and one restart per component, side by side.

    Each runs on its own servers and worker, all at once (they count tasks,
    not milliseconds), so a system's restarts take one wait, not four.
    """
    found: dict[str, Any] = {}

    def one(component: str | None) -> None:
        key = component or "none"
        try:
            with Resources() as res:
                system = System(
                    res,
                    name,
                    python,
                    sizes,
                    durable=True,
                    events=component is None,
                    cron_s=RESTART_CRON_S,
                )
                found[key] = run_waiting(system, sizes, component)
        except (BenchmarkError, RuntimeError, OSError) as exc:
            found[key] = {"component": key, "error": str(exc)}

    threads = [
        threading.Thread(target=one, args=(c,), name=f"zbench-{name}-{c}")
        for c in (None, *COMPONENTS[name])
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return found


#: Sizes a run may override from the command line (--lateness-n 2000 ...).
OVERRIDABLE = (
    "lateness_n",
    "burst_n",
    "memory_n",
    "wait_n",
    "lead_s",
    "window_s",
    "cap_s",
)
#: The workloads, in the order a run does them.
WORKLOADS = ("timeline", "memory", "restarts")


def _prepare(name: str) -> tuple[dict[str, Any], str | None]:
    """The system's entry and interpreter, or the entry with why it cannot run."""
    entry: dict[str, Any] = {"label": SYSTEMS[name]}
    python = sys.executable
    if name in COMPETITORS:
        found, why = competitor_python(name)
        if found is None:
            return {**entry, "error": why}, None
        python = found
        entry["version"] = competitor_version(python, name)
        entry["python"] = "3.13"
    if is_rabbitmq(name) and not rabbitmq_version():
        return {**entry, "error": f"RabbitMQ not reachable at {RABBITMQ_URL}"}, None
    return entry, python


def _one(name: str, python: str, sizes: PeerSizes, workload: str) -> dict[str, Any]:
    """One workload of one system on fresh servers, with the machine's load meanwhile."""
    load, started = MachineLoad(), time.monotonic()
    try:
        if workload == "restarts":
            result = run_restarts(name, python, sizes)
        else:
            fn = run_timeline if workload == "timeline" else run_waiting_memory
            with Resources() as res:
                result = fn(System(res, name, python, sizes), sizes)
    except BenchmarkError as exc:
        result = {"error": str(exc)}
    result["seconds"] = round(time.monotonic() - started, 1)
    result["machine"] = load.stop()
    return result


def rotated(names: list[str], round_no: int) -> list[str]:
    """Round *round_no*'s order: each round starts one system further on."""
    k = round_no % len(names) if names else 0
    return names[k:] + names[:k]


def spread(values: list[float]) -> dict[str, float] | None:
    """Median and [min, max] of one figure over the rounds."""
    if not values:
        return None
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "n": len(values),
    }


def summarise_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Lateness quantiles and burst of every round: each a median with its spread."""
    ok = [r for r in rounds if "error" not in r and r.get("lateness_ms")]
    whole_bursts = [r for r in ok if r["burst_started"] == r["burst_n"]]
    return {
        "rounds": len(rounds),
        "measured": len(ok),
        **{
            f"lateness_{q}_ms": spread([r["lateness_ms"][q] for r in ok])
            for q in ("p50", "p99", "max")
        },
        "burst_last_s": spread([r["burst_last_s"] for r in whole_bursts]),
        "burst_whole_rounds": len(whole_bursts),
        "early": sum(r["early"] for r in ok),
        "not_run": [r["not_run"] for r in ok],
        "doubled": [r["doubled"] for r in ok],
    }


def run_peers(
    sizes: PeerSizes,
    systems: list[str] | None = None,
    *,
    rounds: int = 3,
    once: frozenset[str] = frozenset(),
    workloads: tuple[str, ...] = WORKLOADS,
    checkpoint: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every workload of every system; the timeline in *rounds* interleaved rounds.

    Round r runs the systems in :func:`rotated` order, so no system always
    runs first or last on a machine whose load drifts. Systems in *once* run
    their timeline in the first round only. Memory and restarts run once.
    """
    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    names = systems or list(SYSTEMS)
    started = datetime.now(timezone.utc)
    result: dict[str, Any] = {
        "started": started.isoformat(timespec="seconds"),
        "sizes": sizes.as_dict(),
        "rounds": rounds,
        "once": sorted(once),
        "workloads": list(workloads),
        "worker": f"celery worker -P {WORKER_POOL} -c {WORKER_CONCURRENCY}",
        "uptime_before": _uptime(),
        "systems": {},
    }
    pythons: dict[str, str] = {}
    for name in names:
        entry, python = _prepare(name)
        result["systems"][name] = entry
        if python is not None:
            pythons[name] = python
    if "timeline" in workloads:
        for round_no in range(rounds):
            for name in rotated(names, round_no):
                if name not in pythons or (round_no and name in once):
                    continue
                print(f"  peers: round {round_no + 1}, {name} ...", file=sys.stderr, flush=True)
                entry = result["systems"][name]
                entry.setdefault("rounds", []).append(_one(name, pythons[name], sizes, "timeline"))
                # The first round that measured: its actions, counts and samples.
                entry["timeline"] = next(
                    (r for r in entry["rounds"] if "error" not in r), entry["rounds"][0]
                )
                entry["summary"] = summarise_rounds(entry["rounds"])
                if checkpoint is not None:
                    checkpoint(result)
    for workload in ("memory", "restarts"):
        if workload not in workloads:
            continue
        for name in names:
            if name in pythons:
                print(f"  peers: {workload}, {name} ...", file=sys.stderr, flush=True)
                result["systems"][name][workload] = _one(name, pythons[name], sizes, workload)
                if checkpoint is not None:
                    checkpoint(result)
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


def _spread(figure: dict[str, float] | None, fmt: str = "{:.1f}") -> str:
    if not figure:
        return "—"
    if figure["n"] == 1:
        return fmt.format(figure["median"]) + " (1 round)"
    lo, hi = fmt.format(figure["min"]), fmt.format(figure["max"])
    return f"{fmt.format(figure['median'])} [{lo}-{hi}]"


def _flower(restarts: dict[str, Any]) -> str:
    """Flower's column: listed while waiting (with ETA) / listed as run."""
    control = restarts.get("none") or {}
    if "error" in control or "flower_before" not in control:
        why = _last_line(control.get("error", "")) if control else ""
        return f"not tried: {why}" if why else "—"
    before, after = control["flower_before"], control["flower_after"]

    def said(seen: dict[str, Any], ok: int) -> str:
        return "yes" if ok == seen["of"] else ("no" if not ok else f"{ok} of {seen['of']}")

    done = after["states"].get("SUCCESS", 0)
    return f"{said(before, min(before['listed'], before['with_eta']))} / {said(after, done)}"


def rows(result: dict[str, Any]) -> list[list[str]]:
    """The comparison table: one row per system."""
    n_rounds = result.get("rounds", 1)
    header = [
        "system",
        "scheduled per s",
        f"lateness p50 (ms), median of {n_rounds} [min-max]",
        "p99 (ms)",
        "max (ms)",
        "early",
        "not run / doubled",
        "burst: due -> last started (s)",
        "worker RSS added",
        "broker/store per task",
        "list / cancel / reschedule",
    ]
    table = [header]
    blank = [""] * (len(header) - 2)
    for entry in result["systems"].values():
        label = entry["label"] + (f" {entry['version']}" if entry.get("version") else "")
        if "error" in entry:
            table.append([label, f"not measured: {_last_line(entry['error'])}", *blank])
            continue
        line = entry.get("timeline") or {}
        summary = entry.get("summary") or {}
        memory = entry.get("memory") or {}
        if not line:
            cells = ["—"] * 8
        elif "error" in line:
            cells = [f"not measured: {_last_line(line['error'])}"] + [""] * 6 + ["—"]
        else:
            not_run = line["lateness_not_run"]
            p50 = _spread(summary.get("lateness_p50_ms"))
            if not_run:
                p50 += f" ({not_run:,} not run by the cap in its first round)"
            if summary.get("measured", 1) < summary.get("rounds", 1):
                p50 += f" ({summary['measured']} of {summary['rounds']} rounds measured)"
            whole = summary.get("burst_whole_rounds", 0)
            burst = _spread(summary.get("burst_last_s"), "{:.2f}")
            if whole < summary.get("measured", 0):
                burst = (
                    f"first round: {line['burst_started']:,} of {line['burst_n']:,} in "
                    f"{line['cap_s']:g} s"
                    if line["burst_started"] < line["burst_n"]
                    else burst
                ) + f" (all started in {whole} of {summary['measured']} rounds)"
            runs = ", ".join(
                f"{a:,} / {b:,}"
                for a, b in zip(summary["not_run"], summary["doubled"], strict=True)
            )
            can = line["can"]
            cells = [
                f"{line['schedule_rate']:,}",
                p50,
                _spread(summary.get("lateness_p99_ms")),
                _spread(summary.get("lateness_max_ms")),
                f"{summary['early']:,}",
                runs,
                burst,
                " / ".join(
                    [
                        _yes(can["list"], "listed"),
                        _cancelled(can["cancel"]),
                        _yes(can["reschedule"], "worked"),
                    ]
                ),
            ]
        if not memory:
            mem = ["—", "—"]
        elif "error" in memory:
            mem = [f"not measured: {_last_line(memory['error'])}", ""]
        else:
            mem = [
                f"{memory['worker_rss_added_mib']:,.1f} MiB",
                f"{memory['store_bytes_per_task']:,} B",
            ]
        table.append([label, *cells[:7], *mem, cells[7]])
    return table


def restart_rows(result: dict[str, Any]) -> list[list[str]]:
    """Restarts: tasks lost / doubled, per system and per component restarted."""
    parts = ("none", "broker", "store", "worker", "companion")
    header = [
        "system",
        "where they waited",
        *(f"{p if p != 'none' else 'no restart'}: not run / doubled" for p in parts),
        "in Flower (no restart): waiting, with ETA / run",
    ]
    table = [header]
    for entry in result["systems"].values():
        label = entry["label"] + (f" {entry['version']}" if entry.get("version") else "")
        restarts = entry.get("restarts")
        if "error" in entry or not restarts:
            why = _last_line(entry.get("error", "")) or "not run"
            table.append([label, f"not measured: {why}", *[""] * (len(parts) + 1)])
            continue
        cells = []
        for part in parts:
            one = restarts.get(part)
            if one is None:
                cells.append("—")
            elif "error" in one:
                cells.append(f"not measured: {_last_line(one['error'])}")
            else:
                cell = f"{one['lost']:,} / {one['doubled']:,} of {one['n']:,}"
                if one.get("early"):
                    cell += f" ({one['early']:,} early)"
                cells.append(cell)
        control = restarts.get("none") or {}
        where = control.get("waiting_before") or {}
        waited = ", ".join(f"{k} {v:,}" for k, v in where.items() if v) or "—"
        table.append([label, waited, *cells, _flower(restarts)])
    return table


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1][:160] if text.strip() else text


def _text_table(cells: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        for row in cells
    ]


def table(result: dict[str, Any]) -> str:
    sizes = result["sizes"]
    once = result.get("once") or []
    lines = [
        f"Peers, {result['started']}: {sizes['lateness_n']:,} tasks due over "
        f"{sizes['window_s']:g} s from {sizes['lead_s']:g} s out, "
        f"{sizes['burst_n']:,} due at one instant; {result.get('rounds', 1)} interleaved rounds"
        + (f" ({', '.join(once)}: first round only)" if once else "")
        + f"; {sizes['memory_n']:,} a day out; {result['worker']}",
        f"load: before: {result['uptime_before']}; "
        f"after: {result.get('uptime_after', '(the run was stopped)')}",
    ]
    if "timeline" in result.get("workloads", WORKLOADS) or "memory" in result.get(
        "workloads", WORKLOADS
    ):
        lines += _text_table(rows(result))
    if "restarts" in result.get("workloads", WORKLOADS):
        lines += [
            "",
            f"Restarts: {sizes['wait_n']:,} tasks due {sizes['wait_lead_s']:g}-"
            f"{sizes['wait_lead_s'] + sizes['wait_window_s']:g} s out (celery-redis-plus: "
            f"{REDIS_PLUS_HANDOVER_S:g} s later), one component restarted "
            f"{sizes['restart_at_s']:g} s in; each on its own servers",
            *_text_table(restart_rows(result)),
        ]
    return "\n".join(lines)


def _rst(cells: list[list[str]]) -> list[str]:
    out = [".. list-table::", "   :header-rows: 1", ""]
    for row in cells:
        for i, cell in enumerate(row):
            out.append(f"   {'* -' if i == 0 else '  -'} {cell or '—'}")
    return out


def rst_table(result: dict[str, Any]) -> str:
    """The tables as RST list-tables, for docs/comparison.rst."""
    out = _rst(rows(result))
    if "restarts" in result.get("workloads", WORKLOADS):
        out += ["", *_rst(restart_rows(result))]
    return "\n".join(out)


def plot(result: dict[str, Any], path: Path) -> Path | None:
    """Lateness percentiles, burst and worker memory of each system, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def bar(figure: dict[str, float] | None, floor: float) -> tuple[float, float, float]:
        """(median, down to min, up to max) for a bar with its spread."""
        if not figure:
            return 0.0, 0.0, 0.0
        median = max(figure["median"], floor)
        return median, median - max(figure["min"], floor), max(figure["max"], floor) - median

    names, p50, p99, burst, rss = [], [], [], [], []
    for name, entry in result["systems"].items():
        summary = entry.get("summary") or {}
        memory = entry.get("memory") or {}
        if not summary.get("lateness_p50_ms"):
            continue
        names.append(name)
        p50.append(bar(summary["lateness_p50_ms"], 0.01))
        p99.append(bar(summary["lateness_p99_ms"], 0.01))
        burst.append(bar(summary.get("burst_last_s"), 0.0))
        rss.append(max(memory.get("worker_rss_added_mib", 0.0), 0.0))
    if not names:
        return None

    def errors(bars: list[tuple[float, float, float]]) -> list[list[float]]:
        return [[b[1] for b in bars], [b[2] for b in bars]]

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(13, 4.2), dpi=110)
    ys = range(len(names))
    ax1.barh(
        [y - 0.2 for y in ys],
        [b[0] for b in p50],
        xerr=errors(p50),
        height=0.4,
        label="p50",
        color="#3b75af",
    )
    ax1.barh(
        [y + 0.2 for y in ys],
        [b[0] for b in p99],
        xerr=errors(p99),
        height=0.4,
        label="p99",
        color="#d62728",
    )
    ax1.set_xscale("log")
    ax1.set_xlabel("lateness: started - due (ms, log)")
    ax1.legend()
    ax2.barh(list(ys), [b[0] for b in burst], xerr=errors(burst), color="#2ca02c")
    ax2.set_xlabel(f"burst of {result['sizes']['burst_n']:,}: due -> last started (s)")
    for y, (value, _, _) in zip(ys, burst, strict=True):
        if not value:
            ax2.text(0, y, " not all within the cap", va="center", fontsize=8)
    ax3.barh(list(ys), rss, color="#9467bd")
    ax3.set_xlabel(f"worker RSS added, {result['sizes']['memory_n']:,} waiting (MiB)")
    for ax in (ax1, ax2, ax3):
        ax.set_yticks(list(ys))
        ax.set_yticklabels(names if ax is ax1 else [])
        ax.invert_yaxis()
    rounds = result.get("rounds", 1)
    fig.suptitle(
        f"celery-zdelay and its peers ({result['started']}): lateness and burst the median of "
        f"{rounds} interleaved round{'s' if rounds > 1 else ''}, bars from min to max",
        fontsize=10,
    )
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
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleaved rounds of the timeline (lateness, burst): medians with [min-max]",
    )
    parser.add_argument(
        "--once", default="", help="systems whose timeline runs in the first round only"
    )
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"of: {', '.join(WORKLOADS)}"
    )
    for field_name in OVERRIDABLE:
        parser.add_argument(
            f"--{field_name.replace('_', '-')}",
            type=float if field_name.endswith("_s") else int,
            help="override the mode's size",
        )
    args = parser.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",")] if args.systems else None
    workloads = tuple(w.strip() for w in args.workloads.split(",") if w.strip())
    unknown = [w for w in workloads if w not in WORKLOADS] + [
        s for s in (systems or []) if s not in SYSTEMS
    ]
    if unknown or args.rounds < 1:
        parser.error(f"unknown: {', '.join(unknown)}" if unknown else "--rounds must be >= 1")
    sizes = QUICK if args.quick else FULL
    overrides = {f: getattr(args, f) for f in OVERRIDABLE if getattr(args, f) is not None}
    sizes = dataclasses.replace(sizes, **overrides)
    once = frozenset(s.strip() for s in args.once.split(",") if s.strip())
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = RESULTS_DIR / f"{stamp}-peers.json"

    def checkpoint(partial: dict[str, Any]) -> None:
        # A long run keeps what it measured so far, should it be stopped.
        out.write_text(json.dumps({**partial, "partial": True}, indent=1) + "\n")

    with interrupts_as_keyboard_interrupt():
        try:
            result = run_peers(
                sizes,
                systems,
                rounds=args.rounds,
                once=once,
                workloads=workloads,
                checkpoint=checkpoint,
            )
        except KeyboardInterrupt:
            print("\ninterrupted: every server and process started was stopped", file=sys.stderr)
            return 130
    result["mode"] = "quick" if args.quick else "full"
    result["machine"] = _machine()
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
