"""The periodic planner's cost per pass as schedules grow: ``python -m benchmarks.planner``.

``python -m benchmarks.planner [--sizes 100,1000,10000,100000] [--rounds 5]
[--passes 20] [--out FILE]``: the schedule probe of issue 34 ("Cost as the
work grows", docs/performance.rst). For each size N, on a private Redis
(persistence off) flushed between sizes, in this process:

- N entries of ``beat_schedule``, each daily (``86,400 s``) with its own
  arguments: stored by :meth:`PeriodicServer.reconcile` (``define.lua``),
  then the first pass (each one's occurrence, a day ahead, is further than
  the planner parks: written down, parked within the hour before it);
- ``--rounds`` rounds of ``--passes`` passes (``PeriodicServer._tend``)
  with nothing due: the wall time of a pass (median of the round; the
  figure is the median of the rounds, with their spread), and, from
  ``INFO``, the commands, bytes sent by Redis and Redis's own time per pass;
- ``schedules_in`` (what ``periodic list``, ``status`` and a Prometheus
  scrape read: every schedule, one line or gauge each);
- an edit of one entry (its arguments) as a deploy's ``beat_schedule`` or a
  django-celery-beat row reaches the companions: ``reconcile`` (the whole
  configuration compared, ``define.lua`` in "config" mode), then the next
  pass, which looks at the edited entry (and writes its occurrence down);
  and the same edit through ``periodic.add`` (one entry, "put" mode).

The load average is read before and after each size. The code measured is
whatever ``celery_zdelay`` imports: run it from a checkout of an older
commit (``PYTHONPATH=<checkout>``) for the "before" figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import redis

from celery_zdelay import periodic
from celery_zdelay.parking import store_for
from celery_zdelay.periodic.api import schedules_in
from celery_zdelay.periodic.server import PeriodicServer

from .infra import Resources, loadavg
from .proj import make_app

SIZES = (100, 1_000, 10_000)
ROUNDS, PASSES = 5, 20


def run_planner(
    sizes: tuple[int, ...] = SIZES, *, rounds: int = ROUNDS, passes: int = PASSES
) -> dict[str, Any]:
    """Measure a pass with nothing due, and an edit, at each size of *sizes*."""
    result: dict[str, Any] = {"rounds": rounds, "passes": passes, "sizes": {}}
    with Resources() as res:
        server = res.redis()
        client = server.client(0)
        for size in sizes:
            client.flushall()
            result["sizes"][str(size)] = _measure(server.url, client, size, rounds, passes)
            print(json.dumps({size: result["sizes"][str(size)]}), flush=True)
    return result


def _measure(url: str, client: redis.Redis, size: int, rounds: int, passes: int) -> dict[str, Any]:
    load_before = loadavg()
    app = make_app(broker=f"{url}/0", store=f"{url}/0")
    app.conf.beat_schedule = {
        f"daily-{i}": {"task": "bench.noop", "schedule": 86_400.0, "args": (i, 0)}
        for i in range(size)
    }
    planner = PeriodicServer(app, store_for(app), companion_id="bench")
    started = time.perf_counter()
    planner.reconcile()
    stored_s = time.perf_counter() - started
    started = time.perf_counter()
    first = planner._tend()
    first_pass_s = time.perf_counter() - started
    # Each one's occurrence is a day ahead, further than the planner parks
    # (PARK_LEAD_MS): the first pass writes it down and parks none.
    assert first == 0, (first, size)

    round_ms: list[float] = []
    commands: list[int] = []
    sent: list[int] = []
    redis_us: list[float] = []
    for _ in range(rounds):
        times = []
        for _ in range(passes):
            planner._last_check = time.monotonic()  # no reconcile check inside
            # What two INFOs in a row count of themselves (a call and a reply).
            first_info = _info(client)
            own = [b - a for a, b in zip(first_info, _info(client), strict=True)]
            before = _info(client)
            started = time.perf_counter()
            assert planner._tend() == 0
            times.append((time.perf_counter() - started) * 1000)
            cost = [b - a - o for a, b, o in zip(before, _info(client), own, strict=True)]
            commands.append(int(cost[0]))
            sent.append(int(cost[1]))
            redis_us.append(cost[2])
        round_ms.append(statistics.median(times))

    # An edit of one entry, as a deploy (or a django-celery-beat row) brings it.
    app.conf.beat_schedule["daily-7"] = {
        "task": "bench.noop",
        "schedule": 86_400.0,
        "args": (7, 1),
    }
    started = time.perf_counter()
    status = planner.reconcile()
    reconcile_s = time.perf_counter() - started
    planner._last_check = time.monotonic()
    started = time.perf_counter()
    parked_after_edit = planner._tend()
    edit_pass_s = time.perf_counter() - started
    # The same edit through periodic.add: one entry ("put").
    started = time.perf_counter()
    periodic.add("daily-8", app=app, task="bench.noop", schedule=86_400.0, args=(8, 1))
    put_s = time.perf_counter() - started
    planner._last_check = time.monotonic()
    started = time.perf_counter()
    parked_after_put = planner._tend()
    put_pass_s = time.perf_counter() - started
    # What periodic list, status and a scrape read: every schedule.
    started = time.perf_counter()
    _, listed = schedules_in(planner.periodic)
    list_s = time.perf_counter() - started
    assert len(listed) == size
    app.close()
    return {
        "list_all_ms": round(list_s * 1000, 1),
        "store_s": round(stored_s, 3),
        "first_pass_s": round(first_pass_s, 3),
        "pass_ms": {
            "median": round(statistics.median(round_ms), 2),
            "min": round(min(round_ms), 2),
            "max": round(max(round_ms), 2),
        },
        "pass_commands": statistics.median(commands),
        "pass_bytes_sent": statistics.median(sent),
        "pass_redis_us": statistics.median(redis_us),
        "edit_config": {
            "status": status,
            "reconcile_ms": round(reconcile_s * 1000, 1),
            "next_pass_ms": round(edit_pass_s * 1000, 1),
            "parked": parked_after_edit,
        },
        "edit_put": {
            "put_ms": round(put_s * 1000, 1),
            "next_pass_ms": round(put_pass_s * 1000, 1),
            "parked": parked_after_put,
        },
        "load_before": load_before,
        "load_after": loadavg(),
    }


def _info(client: redis.Redis) -> tuple[float, float, float]:
    """(commands, bytes sent to clients, Redis usec) so far, from one INFO."""
    info: dict[str, Any] = client.info("all")
    stats = {k: v for k, v in info.items() if k.startswith("cmdstat_")}
    calls = sum(float(v["calls"]) for v in stats.values())
    # Not INFO's own time: it varies with what INFO lists.
    usec = sum(float(v["usec"]) for k, v in stats.items() if k != "cmdstat_info")
    return calls, float(info["total_net_output_bytes"]), usec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.planner", description=__doc__)
    parser.add_argument(
        "--sizes",
        type=lambda text: tuple(int(x) for x in text.split(",")),
        default=SIZES,
        help="comma-separated numbers of schedules",
    )
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--passes", type=int, default=PASSES)
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    args = parser.parse_args(argv)
    result = run_planner(args.sizes, rounds=args.rounds, passes=args.passes)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
