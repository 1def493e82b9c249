"""What every benchmark needs: private servers, Celery subprocesses, /proc readings.

Everything a benchmark starts is registered with a :class:`Resources` stack,
so it is stopped when the benchmark ends, fails, or is interrupted (Ctrl-C,
SIGTERM): no stray ``redis-server``, worker or companion survives a run.
"""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import redis
from celery import Celery

from celery_zdelay.testing import RedisServer

from .proj import app_env, make_app

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"

#: RabbitMQ of the machine; ZBENCH_RABBITMQ overrides it.
RABBITMQ_URL = os.environ.get("ZBENCH_RABBITMQ", "amqp://guest:guest@127.0.0.1:5672//")

_CLK_TCK = os.sysconf("SC_CLK_TCK")
T = TypeVar("T")


class BenchmarkError(RuntimeError):
    """Raised when a benchmark cannot produce a valid figure (the reason says why)."""


def wait_for(
    condition: Callable[[], T],
    *,
    timeout: float,
    interval: float = 0.01,
    what: str | Callable[[], str] = "condition",
) -> T:
    """Poll *condition* until it returns a true value; raise after *timeout* seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            text = what() if callable(what) else what
            raise BenchmarkError(f"timed out after {timeout:g}s waiting for {text}")
        time.sleep(interval)


# -- processes ----------------------------------------------------------------


class CeleryProcess:
    """``celery -A benchmarks.proj <args>`` as a subprocess logging to a file.

    *python* and *module* run another interpreter (a competitor's virtualenv)
    or app module (``benchmarks.peers_app``, configured by *env* alone when
    *app* is None).
    """

    def __init__(
        self,
        app: Celery | None,
        args: list[str],
        env: dict[str, str] | None = None,
        *,
        python: str | None = None,
        module: str = "benchmarks.proj",
    ) -> None:
        self.args = args
        self.python = python or sys.executable
        self.module = module
        fd, name = tempfile.mkstemp(prefix="zbench-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
            "C_FORCE_ROOT": "1",
            **(app_env(app) if app is not None else {}),
            **(env or {}),
        }
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> CeleryProcess:
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [self.python, "-m", "celery", "-A", self.module, *self.args],
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text: str, *, timeout: float = 60.0) -> None:
        def seen() -> bool:
            if self.process is not None and self.process.poll() is not None:
                raise BenchmarkError(f"{self.args[0]} exited early:\n{self.log()[-3000:]}")
            return text in self.log()

        wait_for(seen, timeout=timeout, interval=0.02, what=f"{text!r} in the log")

    def stop(self, *, timeout: float = 20.0, kill: bool = False) -> None:
        """SIGTERM (or SIGKILL) and wait; SIGKILL if it does not exit in time."""
        process = self.process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        self.log_path.unlink(missing_ok=True)


@dataclass
class Resources:
    """Servers and processes of one benchmark, stopped in reverse order at exit."""

    stack: ExitStack = field(default_factory=ExitStack)

    def __enter__(self) -> Resources:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def redis(self, **config: str) -> RedisServer:
        """Start a private redis-server (no persistence) on a free port."""
        server = RedisServer(**config)
        self.stack.callback(server.stop)
        return server.start()

    def redis_cluster(self, masters: int = 3) -> str:
        """Start a Redis Cluster of *masters* private nodes, no replicas; return a node's URL."""
        # The test suite's cluster (tests/servers.py): benchmarks run from a checkout.
        from tests.servers import LocalCluster

        return self.stack.enter_context(LocalCluster(masters)).url

    def redis_app(self) -> tuple[str, Celery, redis.Redis]:
        """A private Redis as broker and store: its URL, the benchmark app on it, a client."""
        server = self.redis()
        url = f"{server.url}/0"
        app = make_app(broker=url, store=url)
        self.stack.callback(app.close)
        client = server.client()
        self.stack.callback(client.close)
        return url, app, client

    def worker(
        self,
        app: Celery | None,
        *,
        pool: str = "solo",
        concurrency: int = 1,
        env: dict[str, str] | None = None,
        python: str | None = None,
        module: str = "benchmarks.proj",
    ) -> CeleryProcess:
        """Start a worker of *app* (solo by default) and wait until it is ready.

        *env*, *python* and *module* are :class:`CeleryProcess`'s.
        """
        args = [
            "worker",
            "-P",
            pool,
            "-c",
            str(concurrency),
            "-l",
            "WARNING",
            "-n",
            f"zbench-{uuid.uuid4().hex[:8]}@%h",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
        # -l WARNING keeps per-task log lines out of the measurement, so
        # readiness comes from the worker_ready signal (see proj.py).
        fd, ready = tempfile.mkstemp(prefix="zbench-ready-")
        os.close(fd)
        os.unlink(ready)
        process = CeleryProcess(
            app, args, env={**(env or {}), "ZBENCH_READY_FILE": ready}, python=python, module=module
        )
        self.stack.callback(process.stop)
        self.stack.callback(Path(ready).unlink, True)
        process.start()

        def ready_or_dead() -> bool:
            if process.process is not None and process.process.poll() is not None:
                raise BenchmarkError(f"worker exited early:\n{process.log()[-3000:]}")
            return os.path.exists(ready)

        wait_for(ready_or_dead, timeout=60, interval=0.02, what="the worker to be ready")
        return process

    def companion(
        self,
        app: Celery | None,
        env: dict[str, str] | None = None,
        *,
        module: str = "benchmarks.proj",
    ) -> CeleryProcess:
        """Start ``celery zdelay`` for *app* and wait for its start-up line."""
        process = CeleryProcess(app, ["zdelay", "-l", "INFO"], env=env, module=module)
        self.stack.callback(process.stop)
        process.start()
        process.wait_for_log(" started: ")
        return process

    def callback(self, fn: Callable[..., Any], *args: Any) -> None:
        self.stack.callback(fn, *args)


@contextlib.contextmanager
def interrupts_as_keyboard_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt, so cleanup runs on ``kill`` as on Ctrl-C."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- /proc readings -------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    """Return VmRSS of *pid* from /proc/<pid>/status, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise BenchmarkError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """Return utime + stime of *pid* (all its threads) in seconds."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    # Fields after the command name, which is in parentheses and may hold spaces.
    fields = stat[stat.rindex(")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / _CLK_TCK


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def _cpu_times() -> tuple[float, float]:
    """Return (busy, total) jiffies of the whole machine from /proc/stat."""
    values = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    total = sum(values[:8])
    return total - idle, total


class MachineLoad:
    """Share of all cores busy (any process) between :meth:`start` and :meth:`stop`."""

    def __init__(self) -> None:
        self._start = _cpu_times()
        self._loadavg_start = loadavg()

    def stop(self) -> dict[str, Any]:
        busy, total = _cpu_times()
        d_busy, d_total = busy - self._start[0], total - self._start[1]
        return {
            "cpu_busy_pct": round(100 * d_busy / d_total, 1) if d_total else None,
            "loadavg_start": self._loadavg_start,
            "loadavg_end": loadavg(),
        }


class LoadSampler:
    """Samples /proc/loadavg every few seconds in a thread, for the run's record."""

    def __init__(self, every: float = 5.0) -> None:
        self.every = every
        self.samples: list[tuple[float, list[float]]] = []
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="zbench-load", daemon=True)

    def start(self) -> LoadSampler:
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, list[float]]]:
        self._stop.set()
        self._thread.join(timeout=2)
        return self.samples

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((round(time.monotonic() - self._t0, 1), loadavg()))
            self._stop.wait(self.every)


# -- Redis helpers ------------------------------------------------------------------


def used_memory(client: redis.Redis) -> int:
    """Return INFO memory used_memory, after letting lazy frees finish."""
    # lazyfree work (UNLINK, FLUSHALL ASYNC) completes in a background thread;
    # a short pause keeps it out of the delta.
    time.sleep(0.2)
    return int(client.info("memory")["used_memory"])


def memory_usage(client: redis.Redis, key: str) -> int:
    """Return MEMORY USAGE of *key* counting every element (SAMPLES 0), or 0."""
    value = client.memory_usage(key, samples=0)
    return int(value or 0)


def reset_stats(client: redis.Redis) -> None:
    client.config_resetstat()


def script_stats(client: redis.Redis) -> dict[str, float]:
    """Return calls and server microseconds of EVALSHA/EVAL since the last reset."""
    stats = client.info("commandstats")
    calls = usec = 0
    for name in ("cmdstat_evalsha", "cmdstat_eval"):
        entry = stats.get(name)
        if entry:
            calls += int(entry["calls"])
            usec += int(entry["usec"])
    return {
        "calls": calls,
        "server_ms": round(usec / 1000, 2),
        "ms_per_call": round(usec / 1000 / calls, 3) if calls else 0.0,
    }


def commands_per_task(client: redis.Redis, n: int) -> dict[str, dict[str, float]]:
    """Return each command's calls and server µs per task since the last reset.

    Commands a Lua script runs are counted under their own names (ZADD,
    HSET...), so this shows what a script does per entry; the script calls
    themselves are under EVALSHA, their time including their commands'.
    """
    stats = client.info("commandstats")
    profile = {}
    for name, entry in sorted(stats.items()):
        command = name.removeprefix("cmdstat_")
        if command.split("|")[0] in ("config", "info", "slowlog"):
            continue
        profile[command] = {
            "per_task": round(int(entry["calls"]) / n, 3),
            "us_per_task": round(int(entry["usec"]) / n, 3),
        }
    return profile


# -- the machine ---------------------------------------------------------------------


def machine_info(redis_version: str | None, rabbitmq_version: str | None) -> dict[str, Any]:
    """Describe the machine and software versions, read from the system itself."""
    import amqp
    import celery
    import kombu

    import celery_zdelay

    cpu_model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    mem_kb = 0
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
    return {
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "ram_gib": round(mem_kb / 1024 / 1024, 1),
        "kernel": platform.release(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "redis_server": redis_version,
        "rabbitmq": rabbitmq_version,
        "celery": celery.__version__,
        "kombu": kombu.__version__,
        "redis_py": redis.__version__,
        "amqp": amqp.__version__,
        "celery_zdelay": celery_zdelay.__version__,
        "git": git_describe(),
    }


def git_describe() -> dict[str, Any]:
    def git(*args: str) -> str:
        result = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=False
        )
        return result.stdout.strip()

    return {
        "commit": git("rev-parse", "HEAD") or None,
        # Uncommitted changes under celery_zdelay/ mean the figures are for code not in the commit.
        "src_dirty": bool(git("status", "--porcelain", "--", "celery_zdelay")),
    }


def redis_version(server: RedisServer) -> str:
    client = server.client()
    try:
        return str(client.info("server")["redis_version"])
    finally:
        client.close()


def rabbitmq_version() -> str | None:
    """Return the RabbitMQ server version, or None when it is unreachable."""
    from kombu import Connection

    try:
        with Connection(RABBITMQ_URL, connect_timeout=3) as connection:
            connection.ensure_connection(max_retries=1)
            properties = connection.connection.server_properties
            version = properties.get("version")
            return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:
        return None


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


class ScriptTimer:
    """Redis-side duration of every Lua script call, from SLOWLOG at threshold 0.

    SLOWLOG records the server's own execution time of each command, so this
    is the time a script held Redis (blocking every other client), not a
    round trip. Script SHAs are mapped to their ``.lua`` file names.
    """

    def __init__(self, client: redis.Redis, max_len: int = 1_000_000) -> None:
        self.client = client
        self._saved = client.config_get("slowlog-*")
        client.config_set("slowlog-max-len", max_len)
        client.config_set("slowlog-log-slower-than", 0)
        client.slowlog_reset()

    def summary(self) -> dict[str, dict[str, float]]:
        """Return per script: calls and server ms (total, mean, p50, p99, max)."""
        names = _script_names()
        entries = self.client.execute_command("SLOWLOG", "GET", -1)
        per_script: dict[str, list[int]] = {}
        for entry in entries:
            duration_us, args = int(entry[2]), entry[3]
            if not args or args[0].upper() not in (b"EVALSHA", b"EVALSHA_RO"):
                continue
            sha = args[1].decode() if isinstance(args[1], bytes) else str(args[1])
            per_script.setdefault(names.get(sha, sha[:12]), []).append(duration_us)
        for key, value in self._saved.items():
            self.client.config_set(key, value)
        result = {}
        for name, durations in sorted(per_script.items()):
            durations.sort()
            result[name] = {
                "calls": len(durations),
                "total_ms": round(sum(durations) / 1000, 2),
                "mean_ms": round(sum(durations) / len(durations) / 1000, 3),
                "p50_ms": round(durations[len(durations) // 2] / 1000, 3),
                "p99_ms": round(
                    durations[min(len(durations) - 1, len(durations) * 99 // 100)] / 1000, 3
                ),
                "max_ms": round(durations[-1] / 1000, 3),
            }
        return result


def _script_names() -> dict[str, str]:
    """Map the SHA1 of each of celery-zdelay's Lua scripts to its name.

    Scripts are loaded as ``celery_zdelay.store.scripts.script_source`` builds
    them (with their includes); the bare ``.lua`` files are mapped too.
    """
    import hashlib
    from importlib import resources

    names = {}
    for entry in resources.files("celery_zdelay.store").joinpath("lua").iterdir():
        if entry.name.endswith(".lua"):
            sha = hashlib.sha1(entry.read_text().encode()).hexdigest()
            names[sha] = entry.name.removesuffix(".lua")
    try:
        import celery_zdelay.periodic.store  # noqa: F401  (registers the periodic scripts)
        from celery_zdelay.store.scripts import registered_scripts, script_source
    except ImportError:  # pragma: no cover - a later layout of the package
        return names
    for spec in registered_scripts():
        with contextlib.suppress(Exception):
            names[hashlib.sha1(script_source(spec.name).encode()).hexdigest()] = spec.name
    return names
