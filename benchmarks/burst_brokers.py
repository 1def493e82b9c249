"""A burst due at one instant, a backlog behind it, into a Redis broker and into RabbitMQ.

``python -m benchmarks --only burst_brokers``, or
``python -m benchmarks.burst_brokers [--quick] [--sizes ...] [--rounds 3] [--burst N]``.

One private Redis holds the store and its backlog (0, 100,000, 1,000,000
parked 30 to 180 days ahead; quick: 0 and 10,000). At each size, rounds
alternate (ABBA) two releases of a burst (100,000; quick 10,000) due at one
instant by a real companion (``celery zdelay``, started before the burst is
parked, stopped after):

- **Redis broker**: the broker is the store's Redis (the atomic handoff);
  seconds from the due time until the last message is in the broker's list
  (P4, as ``scale`` measures it);
- **RabbitMQ**: ``127.0.0.1:5672`` (``ZBENCH_RABBITMQ``), a queue of the
  run's own, the companion's default confirming publisher; seconds from the
  due time until the queue's ``message_count`` (a passive declare, polled
  every 10 ms on one channel) holds them all.

Figures: the median of the rounds with min-max, against P4 (3 s for 100,000).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kombu import Connection

from .backlog import (
    SIZES_FULL,
    SIZES_QUICK,
    LoadRecord,
    calibrate,
    cell,
    park_due_at_once,
    parse_sizes,
    summary,
)
from .common import now_ms, wait_for_list
from .infra import RABBITMQ_URL, BenchmarkError, MachineLoad, Resources, rabbitmq_version, unique
from .proj import make_app
from .scale import P4_SECONDS, _Filler

ROUNDS_FULL, ROUNDS_QUICK = 3, 1
BURST_FULL, BURST_QUICK = 100_000, 10_000
BROKERS = ("redis", "rabbitmq")
#: The RabbitMQ app's copies take ids from here on, apart from the backlog's.
RABBIT_FIRST_SEQ = 10**15


def run_burst_brokers(
    sizes: tuple[int, ...] = SIZES_FULL,
    *,
    quick: bool = False,
    burst: int | None = None,
    rounds: int | None = None,
) -> dict[str, Any]:
    rounds = rounds or (ROUNDS_QUICK if quick else ROUNDS_FULL)
    n = burst or (BURST_QUICK if quick else BURST_FULL)
    rabbit_version = rabbitmq_version()
    brokers = BROKERS if rabbit_version else ("redis",)
    started = time.monotonic()
    load = LoadRecord()
    result: dict[str, Any] = {
        "sizes": list(sizes),
        "rounds": rounds,
        "burst_n": n,
        "p4_seconds": P4_SECONDS,
        "rabbitmq": rabbit_version or "not reachable: not measured",
        "points": [],
    }
    with Resources() as res:
        server = res.redis()
        url = f"{server.url}/0"
        client = server.client()
        res.callback(client.close)
        result["redis_version"] = str(client.info("server")["redis_version"])
        apps = {"redis": make_app(broker=url, store=url)}
        if "rabbitmq" in brokers:
            queue = unique("zbench")
            apps["rabbitmq"] = make_app(broker=RABBITMQ_URL, store=url, queue=queue)
            rabbit = Connection(RABBITMQ_URL)
            res.callback(rabbit.release)
            bound = apps["rabbitmq"].amqp.queues[queue].bind(rabbit.default_channel)
            bound.declare()
            res.callback(bound.delete)
        for app in apps.values():
            res.callback(app.close)
        fillers = {
            name: _Filler(app, first_seq=RABBIT_FIRST_SEQ if name == "rabbitmq" else 0)
            for name, app in apps.items()
        }
        for name, filler in fillers.items():
            calibrate(filler, apps[name])

        def in_broker(name: str) -> int:
            if name == "rabbitmq":
                return int(bound.queue_declare(passive=True).message_count)
            return int(client.llen(str(apps[name].conf.task_default_queue)))

        def empty(name: str) -> None:
            if name == "rabbitmq":
                bound.purge()
            else:
                client.delete(str(apps[name].conf.task_default_queue))

        parked = 0
        for size in sizes:
            print(f"burst_brokers: filling to {size:,} ...", file=sys.stderr, flush=True)
            fillers["redis"].grow(client, size - parked)
            parked = size
            point_load = LoadRecord()
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in brokers}
            for round_no in range(rounds):
                order = brokers if round_no % 2 == 0 else tuple(reversed(brokers))
                for name in order:
                    empty(name)
                    companion = res.companion(apps[name])
                    try:
                        runs[name].append(
                            _release(client, apps[name], fillers[name], n, name, in_broker)
                        )
                    finally:
                        companion.stop()
                    empty(name)
            point: dict[str, Any] = {"parked": size, "runs": runs}
            for name in brokers:
                valid = [r["seconds"] for r in runs[name] if r["valid"]]
                point[name] = summary(valid) if valid else None
            point["machine"] = point_load.stop()
            result["points"].append(point)
            print(_line(point, brokers), file=sys.stderr, flush=True)
    result["machine"] = load.stop()
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


def _release(
    client: Any, app: Any, filler: _Filler, n: int, name: str, in_broker: Any
) -> dict[str, Any]:
    """Park *n* due at one instant; seconds from the due time until the broker holds them."""
    burst = park_due_at_once(filler, n)
    due = burst["due"]
    time.sleep(max(0.0, (due - now_ms()) / 1000 - 0.05))
    load = MachineLoad()
    deadline = time.monotonic() + 60 + n / 500
    if name == "redis":
        _, stamp = wait_for_list(
            client, str(app.conf.task_default_queue), n, deadline, "burst_brokers"
        )
    else:
        while (count := in_broker(name)) < n:
            if time.monotonic() > deadline:
                raise BenchmarkError(f"burst_brokers: {count:,} of {n:,} in RabbitMQ in time")
            time.sleep(0.01)
        stamp = now_ms()
    seconds = (stamp - due) / 1000
    return {
        "n": n,
        "seconds": round(seconds, 3),
        "rate": round(n / max(seconds, 1e-3)),
        "park_s": round(burst["park_s"], 2),
        # A park that ended past the due time: released all the same, not counted.
        "valid": burst["valid"],
        "machine": load.stop(),
    }


def table(result: dict[str, Any]) -> str:
    points = result["points"]
    brokers = [name for name in BROKERS if name in points[0]] if points else []
    width = 24
    lines = [
        f"Release of {result['burst_n']:,} due at one instant with the backlog behind: "
        f"seconds from due to all in the broker, median [min-max] of {result['rounds']} rounds "
        f"(P4: {result['p4_seconds']} s for 100,000)",
        f"{'parked':<30}" + "".join(f"{p['parked']:>{width},}" for p in points),
    ]
    for name in brokers:
        label = "Redis broker (handoff)" if name == "redis" else "RabbitMQ (confirms)"
        lines.append(f"{label:<30}" + "".join(f"{cell(p[name]):>{width}}" for p in points))
        lines.append(
            f"{'  rate (/s, median)':<30}"
            + "".join(
                f"{result['burst_n'] / p[name]['median'] if p[name] else 0:>{width},.0f}"
                for p in points
            )
        )
    lines.append(
        f"{'load average (1 min)':<30}"
        + "".join(
            f"{p['machine']['loadavg_start'][0]:.1f} -> {p['machine']['loadavg_end'][0]:.1f}".rjust(
                width
            )
            for p in points
        )
    )
    machine = result["machine"]
    lines.append(
        f"RabbitMQ {result['rabbitmq']}; load average {machine['loadavg_start']} -> "
        f"{machine['loadavg_end']}; {machine['note']}; took {result['seconds']} s"
    )
    return "\n".join(lines)


def _line(point: dict[str, Any], brokers: tuple[str, ...]) -> str:
    cells = ", ".join(f"{name} {cell(point[name])} s" for name in brokers)
    return f"burst_brokers: {point['parked']:,} parked: {cells}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.burst_brokers", description=__doc__)
    parser.add_argument("--quick", action="store_true", help=f"sizes {SIZES_QUICK}, one round")
    parser.add_argument("--sizes", type=parse_sizes, help="comma-separated, ascending")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--burst", type=int, help="tasks due at one instant")
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    args = parser.parse_args(argv)
    sizes = args.sizes or (SIZES_QUICK if args.quick else SIZES_FULL)
    result = run_burst_brokers(sizes, quick=args.quick, burst=args.burst, rounds=args.rounds)
    print(table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
