"""The end-to-end demo: ``python -m example_project.demo``.

Starts a Celery worker and the celery-zdelay companion, parks a few hundred
tasks with countdowns of one to five seconds, waits until they ran and prints
how late each ran. Uses ``REDIS_URL`` when set, else a private Redis it
starts (and stops) itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASKS = 300


@contextlib.contextmanager
def redis_url() -> Iterator[str]:
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    from celery_zdelay.testing import RedisServer

    with RedisServer() as server:
        print(f"Started a private Redis at {server.url} (set REDIS_URL to use yours)")
        yield f"{server.url}/0"


def start(role: str, *args: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "celery", "-A", "example_project.tasks", *args]
    print(f"Starting the {role}: celery -A example_project.tasks {' '.join(args)}")
    return subprocess.Popen(command, cwd=ROOT, env=env)


def main() -> int:
    with redis_url() as url:
        os.environ["REDIS_URL"] = url
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        from example_project.tasks import _runs, app, remind

        _runs.delete("demo:runs")
        processes = [
            start("worker", "worker", "-P", "solo", "-l", "WARNING", env=env),
            start("companion", "zdelay", "-l", "INFO", env=env),
        ]
        try:
            return run_demo(app, remind, _runs)
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait(timeout=30)


def wait_until_ready(app, runs) -> None:  # type: ignore[no-untyped-def]
    """Wait (at most 60 s) for the worker to answer a ping and the companion's heartbeat."""
    deadline = time.monotonic() + 60
    while not app.control.ping(timeout=0.5):
        if time.monotonic() > deadline:
            raise SystemExit("The worker did not start within 60 s")
    while not runs.hlen("zdelay:companions"):
        if time.monotonic() > deadline:
            raise SystemExit("The companion did not start within 60 s")
        time.sleep(0.1)


def run_demo(app, remind, runs) -> int:  # type: ignore[no-untyped-def]
    wait_until_ready(app, runs)
    now = datetime.now(timezone.utc)
    started = time.monotonic()
    for i in range(TASKS):
        eta = now + timedelta(seconds=1 + random.random() * 4)
        due_ms = -(-int(eta.timestamp() * 1_000_000) // 1000)  # ceil, as the store does
        remind.apply_delayed((f"customer-{i}", due_ms), eta=eta)
    print(f"Parked {TASKS} reminders due in 1-5 s ({time.monotonic() - started:.2f} s to park)")

    deadline = time.monotonic() + 60
    while runs.llen("demo:runs") < TASKS and time.monotonic() < deadline:
        time.sleep(0.2)
    done = [json.loads(raw) for raw in runs.lrange("demo:runs", 0, -1)]
    late = sorted(run["late_ms"] for run in done)
    ids = [run["id"] for run in done]
    print()
    print(f"{'tasks parked':<28}{TASKS:>8}")
    print(f"{'tasks run':<28}{len(done):>8}")
    print(f"{'ran twice':<28}{len(ids) - len(set(ids)):>8}")
    if late:
        print(f"{'ran early (ms before due)':<28}{sum(1 for ms in late if ms < 0):>8}")
        for label, q in (("p50", 0.5), ("p99", 0.99)):
            print(f"{'lateness ' + label + ' (ms)':<28}{late[int(q * (len(late) - 1))]:>8}")
        print(f"{'lateness max (ms)':<28}{late[-1]:>8}")
    print("(lateness: the worker's start of the task minus its due time, on the Redis clock)")
    return 0 if len(done) == TASKS and len(set(ids)) == TASKS else 1


if __name__ == "__main__":
    sys.exit(main())
