"""What a released task's ETA costs a worker, measured two ways (issue 20, item 9).

A released message could keep Celery's ``eta`` (now in the past) or carry it
in the ``zdelay_eta`` header that ``celery_zdelay.worker.restore_eta`` puts
back into ``request.eta`` (what celery-zdelay does). This drains N messages
of a 20 ms task through one prefork worker (concurrency 1, prefetch
multiplier 1, Redis broker) for each of three shapes:

- ``no-eta``: Celery's message without ETA (the baseline);
- ``past-eta``: the ``eta`` header kept, already past when the worker gets it;
- ``zdelay_eta``: ``eta`` None, the ETA in the ``zdelay_eta`` header;
- ``eta-behind``: the ``eta`` header kept, as a worker whose clock is 10 s
  behind the Redis clock sees it (the companion releases by the Redis clock).

and reports the most messages the worker held at once (kombu's Redis
``unacked`` hash, sampled every 5 ms: reserved, prefetched or in the ETA
timer, not yet started) and the drain time. Then it times the
``task_prerun`` receiver alone, per call, with and without the header.

Run: ``.venv/bin/python -m benchmarks.request_eta [N]`` from the checkout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import timeit
from datetime import datetime, timedelta, timezone

from celery import Celery

import celery_zdelay  # noqa: F401  (the worker restores request.eta)
from celery_zdelay.testing import RedisServer

app = Celery("request_eta", broker=os.environ.get("BENCH_BROKER", "redis://127.0.0.1:1/0"))
app.conf.worker_prefetch_multiplier = 1
app.conf.task_acks_late = False


@app.task(name="bench.sleep")
def sleep(seconds: float) -> None:
    time.sleep(seconds)


def drain(server: RedisServer, shape: str, n: int) -> tuple[int, float]:
    client = server.client(0)
    client.flushdb()
    past = datetime.now(timezone.utc) - timedelta(seconds=1)
    ahead = datetime.now(timezone.utc) + timedelta(seconds=10)
    for _ in range(n):
        if shape == "past-eta":
            app.send_task("bench.sleep", (0.02,), eta=past)
        elif shape == "eta-behind":
            app.send_task("bench.sleep", (0.02,), eta=ahead)
        elif shape == "zdelay_eta":
            app.send_task("bench.sleep", (0.02,), headers={"zdelay_eta": past.isoformat()})
        else:
            app.send_task("bench.sleep", (0.02,))
    env = {**os.environ, "BENCH_BROKER": app.conf.broker_url}
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "benchmarks.request_eta",
            "worker",
            "-P",
            "prefork",
            "-c",
            "1",
            "-l",
            "WARNING",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    held, started = 0, None
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            queued, unacked = client.llen("celery"), client.hlen("unacked")
            if started is None and queued < n:
                started = time.monotonic()
            held = max(held, unacked)
            if queued == 0 and unacked == 0 and started is not None:
                break
            time.sleep(0.005)
        else:
            raise RuntimeError(f"{shape}: not drained in 120 s")
    finally:
        worker.terminate()
        worker.wait(30)
    assert started is not None
    return held, time.monotonic() - started


def receiver_cost() -> dict[str, float]:
    from types import SimpleNamespace

    from celery import signals

    from celery_zdelay.worker import restore_eta

    def task(headers: dict[str, str] | None) -> SimpleNamespace:
        return SimpleNamespace(request=SimpleNamespace(headers=headers, eta=None))

    plain = task(None)
    number = 200_000
    cost = {"no header": timeit.timeit(lambda: restore_eta(task=plain), number=number)}
    with_header = [task({"zdelay_eta": "2026-12-03T00:00:00+00:00"}) for _ in range(number)]
    items = iter(with_header)
    cost["zdelay_eta"] = timeit.timeit(lambda: restore_eta(task=next(items)), number=number)
    # What Celery's tracer pays per task once task_prerun has a receiver (it
    # skips the send when the signal has none).
    send = signals.task_prerun.send
    cost["task_prerun.send, no header"] = timeit.timeit(
        lambda: send(sender=None, task_id="x", task=plain, args=(), kwargs={}), number=number
    )
    return {k: v / number * 1e9 for k, v in cost.items()}


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    with RedisServer() as server:
        app.conf.broker_url = f"{server.url}/0"
        print(f"{n} messages of a 20 ms task, one prefork worker, -c 1, prefetch multiplier 1")
        for shape in ("no-eta", "past-eta", "zdelay_eta", "eta-behind"):
            held, seconds = drain(server, shape, n)
            print(f"  {shape:<12} held at most {held:>4} messages, drained in {seconds:5.2f} s")
    for label, ns in receiver_cost().items():
        print(f"restore_eta per task, {label}: {ns:.0f} ns")


if __name__ == "__main__":
    main()
