"""Park and release rates on a Redis Cluster of 1, 2 and 3 masters, with a backlog.

``python -m benchmarks --only cluster_scale``, or
``python -m benchmarks.cluster_scale [--quick] [--sizes ...] [--masters 1,2,3] [--rounds 3]``.

Three clusters run side by side on this machine (1, 2 and 3 masters, no
replicas, slots split evenly; ``redis-cli --cluster create`` wants three
masters at least, so the slots are assigned here), each the store of its own
app with ``zdelay_shards`` = :data:`SHARDS` (the same shards for every count,
spread by their hash tags over the masters), a private Redis as its broker
(the generic path: the handoff needs broker and store on one server) and one
companion per master. Their backlogs grow together through the sizes (0,
100,000, 1,000,000 parked 30 to 180 days ahead; quick: 0 and 10,000). At
each size, rounds visit the clusters in turn (the order rotating):

- **park**: a burst of 100,000 (quick 10,000) parked from this process by
  the store's bulk park (``Store.park`` of 5,000 a call, split per shard):
  tasks per second, this process's CPU per task, and each master's Redis CPU
  per task (``INFO cpu``);
- **release**: that burst, due at one instant, released by the cluster's
  companions into the broker: seconds from due until the last is in the
  broker's list, tasks per second, the companions' CPU per task, each
  master's and the broker's Redis CPU per task.

What a second core cannot give: every process here (producer, masters,
companions, brokers) shares two cores, so a rate stops growing with masters
once the cores are busy; the CPU per task of each part is what the capacity
model in docs/performance.rst builds on.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import redis

from celery_zdelay.testing import RedisServer

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
from .infra import BenchmarkError, MachineLoad, Resources, cpu_seconds
from .proj import make_app
from .scale import _Filler

MASTERS = (1, 2, 3)
#: Shards of every cluster's store: as many for each count, so only the masters change.
SHARDS = 12
ROUNDS_FULL, ROUNDS_QUICK = 3, 1
BURST_FULL, BURST_QUICK = 100_000, 10_000
_SLOTS = 16384


class Cluster:
    """*masters* private Redis nodes, the 16,384 slots split evenly, no replicas."""

    def __init__(self, masters: int) -> None:
        # A node also listens on its port + 10,000: tests/servers.py picks one below 55,536.
        from tests.servers import _cluster_port

        self.nodes = [
            RedisServer(
                port=_cluster_port(),
                cluster_enabled="yes",
                cluster_config_file="nodes.conf",
                cluster_node_timeout="5000",
            )
            for _ in range(masters)
        ]
        self.clients: list[redis.Redis] = []

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> Cluster:
        try:
            for node in self.nodes:
                node.start()
            self.clients = [node.client() for node in self.nodes]
            count = len(self.nodes)
            for i, client in enumerate(self.clients):
                first, last = i * _SLOTS // count, (i + 1) * _SLOTS // count - 1
                # ADDSLOTS, not ADDSLOTSRANGE: the latter is Redis 7.0 and up.
                client.execute_command("CLUSTER", "ADDSLOTS", *range(first, last + 1))
            for node in self.nodes[1:]:
                self.clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
            deadline = time.monotonic() + 60
            for client in self.clients:
                while (
                    client.execute_command("CLUSTER INFO").get("cluster_state") != "ok"
                    or int(client.execute_command("CLUSTER INFO")["cluster_known_nodes"]) < count
                ):
                    if time.monotonic() > deadline:
                        raise BenchmarkError("cluster_scale: the cluster did not converge")
                    time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def cpu(self) -> list[float]:
        """Each master's CPU seconds (user + system) so far."""
        return [_redis_cpu(client) for client in self.clients]

    def memory(self) -> list[int]:
        return [int(client.info("memory")["used_memory"]) for client in self.clients]

    def keys(self) -> list[int]:
        return [int(client.dbsize()) for client in self.clients]


def _redis_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


class _Setup:
    """One cluster, its broker, app, filler and companions."""

    def __init__(self, res: Resources, masters: int) -> None:
        self.masters = masters
        self.cluster = Cluster(masters)
        res.callback(self.cluster.stop)
        self.cluster.start()
        broker = res.redis()
        self.broker = broker.client()
        res.callback(self.broker.close)
        self.app = make_app(
            broker=f"{broker.url}/0", store=self.cluster.url, conf={"zdelay_shards": SHARDS}
        )
        res.callback(self.app.close)
        self.filler = _Filler(self.app)
        calibrate(self.filler, self.app)
        self.companions = [res.companion(self.app) for _ in range(masters)]
        self.queue = str(self.app.conf.task_default_queue)

    def round(self, n: int) -> dict[str, Any]:
        """Park a burst of *n* due at one instant, then time its release."""
        self.broker.delete(self.queue)
        cpu0, own0 = self.cluster.cpu(), time.process_time()
        burst = park_due_at_once(self.filler, n)
        cpu1, own1 = self.cluster.cpu(), time.process_time()
        due, park_s = burst["due"], burst["park_s"]
        time.sleep(max(0.0, (due - now_ms()) / 1000 - 0.05))
        load = MachineLoad()
        comp0 = [cpu_seconds(c.pid) for c in self.companions]
        broker0 = _redis_cpu(self.broker)
        cpu2 = self.cluster.cpu()
        deadline = time.monotonic() + 60 + n / 500
        _, stamp = wait_for_list(self.broker, self.queue, n, deadline, "cluster_scale")
        seconds = (stamp - due) / 1000
        comp1 = [cpu_seconds(c.pid) for c in self.companions]
        cpu3 = self.cluster.cpu()
        broker1 = _redis_cpu(self.broker)
        self.broker.delete(self.queue)
        return {
            "n": n,
            "park_seconds": round(park_s, 3),
            "park_rate": round(n / park_s),
            "park_producer_cpu_us_per_task": round((own1 - own0) / n * 1e6, 1),
            "park_redis_cpu_us_per_task": [
                round((b - a) / n * 1e6, 2) for a, b in zip(cpu0, cpu1, strict=True)
            ],
            # A park that ended past the due time: released all the same, not counted.
            "valid": burst["valid"],
            "release_seconds": round(seconds, 3),
            "release_rate": round(n / max(seconds, 1e-3)),
            "release_companion_cpu_us_per_task": [
                round((b - a) / n * 1e6, 1) for a, b in zip(comp0, comp1, strict=True)
            ],
            "release_redis_cpu_us_per_task": [
                round((b - a) / n * 1e6, 2) for a, b in zip(cpu2, cpu3, strict=True)
            ],
            "release_broker_cpu_us_per_task": round((broker1 - broker0) / n * 1e6, 2),
            "machine": load.stop(),
        }


def run_cluster_scale(
    sizes: tuple[int, ...] = SIZES_FULL,
    *,
    quick: bool = False,
    masters: tuple[int, ...] = MASTERS,
    burst: int | None = None,
    rounds: int | None = None,
) -> dict[str, Any]:
    rounds = rounds or (ROUNDS_QUICK if quick else ROUNDS_FULL)
    n = burst or (BURST_QUICK if quick else BURST_FULL)
    started = time.monotonic()
    load = LoadRecord()
    result: dict[str, Any] = {
        "sizes": list(sizes),
        "masters": list(masters),
        "shards": SHARDS,
        "rounds": rounds,
        "burst_n": n,
        "points": [],
    }
    with Resources() as res:
        setups = {m: _Setup(res, m) for m in masters}
        first = next(iter(setups.values()))
        result["redis_version"] = str(first.broker.info("server")["redis_version"])
        parked = 0
        for size in sizes:
            print(f"cluster_scale: filling each to {size:,} ...", file=sys.stderr, flush=True)
            fills = {}
            for m, setup in setups.items():
                added = size - parked
                began = time.perf_counter()
                for chunk in setup.filler.requests(added, marked=False, due_ms=_ahead()):
                    setup.filler.store.park(chunk)
                seconds = time.perf_counter() - began
                if added:
                    setup.filler.rate = added / seconds
                fills[str(m)] = {"added": added, "seconds": round(seconds, 1)}
            parked = size
            point_load = LoadRecord()
            runs: dict[int, list[dict[str, Any]]] = {m: [] for m in masters}
            for round_no in range(rounds):
                order = masters[round_no % len(masters) :] + masters[: round_no % len(masters)]
                for m in order:
                    print(f"cluster_scale: {size:,} parked, {m} masters", file=sys.stderr)
                    runs[m].append(setups[m].round(n))
            point: dict[str, Any] = {
                "parked": size,
                "fill": fills,
                "per_masters": {
                    str(m): {
                        "park_rate": summary([r["park_rate"] for r in runs[m]]),
                        "release_rate": _valid(runs[m], "release_rate"),
                        "release_seconds": _valid(runs[m], "release_seconds"),
                        "keys_per_master": setups[m].cluster.keys(),
                        "used_memory_per_master": setups[m].cluster.memory(),
                        "runs": runs[m],
                    }
                    for m in masters
                },
                "machine": point_load.stop(),
            }
            result["points"].append(point)
            print(_line(point), file=sys.stderr, flush=True)
    result["machine"] = load.stop()
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


def _valid(runs: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    values = [r[key] for r in runs if r["valid"]]
    return summary(values) if values else None


def _ahead() -> Any:
    from .scale import AHEAD_DAYS, SPAN_DAYS

    day = 86_400_000
    base = now_ms() + AHEAD_DAYS * day
    return lambda seq: base + (seq * 2_654_435_761) % (SPAN_DAYS * day)


def table(result: dict[str, Any]) -> str:
    width = 25
    lines = [
        f"Redis Cluster, {result['shards']} shards, one companion per master, burst of "
        f"{result['burst_n']:,}: median [min-max] of {result['rounds']} rounds",
        f"{'parked / masters':<34}"
        + "".join(
            f"{p['parked']:>{width - 8},} / {m}".rjust(width)
            for p in result["points"]
            for m in result["masters"]
        ),
    ]
    rows = (
        ("park (tasks/s)", "park_rate", ",.0f"),
        ("release (tasks/s)", "release_rate", ",.0f"),
        ("release: due -> all (s)", "release_seconds", ".2f"),
    )
    for label, key, fmt in rows:
        lines.append(
            f"{label:<34}"
            + "".join(
                cell(p["per_masters"][str(m)][key], fmt).rjust(width)
                for p in result["points"]
                for m in result["masters"]
            )
        )
    for label, key in (
        ("park: Redis CPU µs/task per master", "park_redis_cpu_us_per_task"),
        ("release: Redis CPU µs/task", "release_redis_cpu_us_per_task"),
        ("release: companion CPU µs/task", "release_companion_cpu_us_per_task"),
    ):
        lines.append(
            f"{label:<34}"
            + "".join(
                "+".join(
                    f"{v:.0f}" for v in _median_run(p["per_masters"][str(m)]["runs"])[key]
                ).rjust(width)
                for p in result["points"]
                for m in result["masters"]
            )
        )
    lines.append(
        f"{'park: producer CPU µs/task':<34}"
        + "".join(
            f"{_median_run(p['per_masters'][str(m)]['runs'])['park_producer_cpu_us_per_task']:.0f}".rjust(
                width
            )
            for p in result["points"]
            for m in result["masters"]
        )
    )
    lines.append(
        f"{'release: broker CPU µs/task':<34}"
        + "".join(
            f"{_median_run(p['per_masters'][str(m)]['runs'])['release_broker_cpu_us_per_task']:.0f}".rjust(
                width
            )
            for p in result["points"]
            for m in result["masters"]
        )
    )
    machine = result["machine"]
    lines.append(
        f"load average {machine['loadavg_start']} -> {machine['loadavg_end']}; "
        f"{machine['note']}; took {result['seconds']} s"
    )
    return "\n".join(lines)


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The round whose release rate is the median: its CPU figures go in the table."""
    ordered = sorted(runs, key=lambda run: (run["valid"], run["release_rate"]))
    return ordered[(len(ordered) - 1) // 2]


def _line(point: dict[str, Any]) -> str:
    cells = "; ".join(
        f"{m} masters park {cell(v['park_rate'], ',.0f')}/s "
        f"release {cell(v['release_rate'], ',.0f')}/s"
        for m, v in point["per_masters"].items()
    )
    return f"cluster_scale: {point['parked']:,} parked: {cells}"


def _parse_masters(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cluster_scale", description=__doc__)
    parser.add_argument("--quick", action="store_true", help=f"sizes {SIZES_QUICK}, one round")
    parser.add_argument("--sizes", type=parse_sizes, help="comma-separated, ascending")
    parser.add_argument("--masters", type=_parse_masters, default=MASTERS)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--burst", type=int, help="tasks parked and due at one instant per round")
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    args = parser.parse_args(argv)
    sizes = args.sizes or (SIZES_QUICK if args.quick else SIZES_FULL)
    result = run_cluster_scale(
        sizes, quick=args.quick, masters=args.masters, burst=args.burst, rounds=args.rounds
    )
    print(table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
