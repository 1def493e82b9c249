"""Cost as the work grows: ``python -m benchmarks --only scale``.

Also ``python -m benchmarks.scale [--quick] [--sizes 0,100000,1000000,10000000]``.

One private Redis (persistence off) holds a backlog that grows from one size
to the next (0, 100,000, 1,000,000, 10,000,000 parked; 0 and 10,000 with
``--quick``), every entry due 30 to 180 days ahead at its own millisecond. At
each size the same costs are measured, so a cost that grows with the store
shows up as a row that climbs:

- Redis memory per parked task: the ``used_memory`` added by the plain
  entries of the step, and by its marked ones (one key and two tags each:
  :data:`MARKED_SHARE` of the backlog, so the key and tag index grows with
  it: 1,000,000 distinct keys and tags at 10,000,000 parked);
- per call, in this process: ``apply_delayed``, ``apply_delayed_many`` of
  :data:`MANY_BATCH` calls, ``lookup``, ``reschedule`` and ``cancel`` by id
  (p50/p99), each with the Redis time per call from ``INFO commandstats``;
- ``cancel_matching(tag=)`` and ``reschedule_matching(tag=)`` of
  :data:`MATCH_N` tasks parked with a tag of their own;
- the dashboard's pages through its WSGI interface (benchmarks/web.py's
  :func:`~benchmarks.web.request_page`): the overview, the week's timeline,
  the listing's first page and a page after a cursor half-way through the
  set, and a tag filter;
- ``zdelay list`` and ``zdelay status --check`` run in this process (Click's
  runner: the command without the interpreter's start-up), and one scrape of
  a companion's Prometheus registry;
- release: :data:`BURST_FULL` tasks (``--quick``: :data:`BURST_QUICK`) due
  at one instant, handed off by a real companion (``celery zdelay``) into
  the Redis broker with the backlog behind them; seconds from the due time
  until the last is in the broker's list (P4).

Each size runs :data:`ROUNDS_FULL` rounds (quick: :data:`ROUNDS_QUICK`) of
every measurement one after the other (apply, lookup, reschedule, cancel,
matching, pages, CLI, scrape), so a burst of load from another process
lands on all of them alike; a cost is reported as the median over the
rounds of each round's p50 (and p99), with the spread (min-max) beside it.

Filling: the first entry of each kind is parked by ``apply_delayed_many``;
the rest are :meth:`celery_zdelay.store.Store.park` calls of
:data:`FILL_CHUNK` copies of its park request (the store's own bulk park,
``park.lua`` / ``park_keyed.lua``: every entry, index and template as the
product writes them) under new ids, each with its own due time. That parks
about 40,000 a second on two loaded cores, where ``apply_delayed_many``
(Celery building each message) does about 10,000.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import redis
from celery import Celery

import celery_zdelay
from celery_zdelay.parking import store_for
from celery_zdelay.schedule import Due
from celery_zdelay.steering import cancel_ids
from celery_zdelay.store import Store
from celery_zdelay.store.store import ParkRequest

from .common import eta_for, now_ms, quantiles, wait_for_list
from .infra import BenchmarkError, MachineLoad, Resources, loadavg, used_memory
from .web import redis_usec, request_page

FULL_SIZES = (0, 100_000, 1_000_000, 10_000_000)
QUICK_SIZES = (0, 10_000)
#: One parked task in this many carries a key and two tags.
MARKED_SHARE = 10
#: Entries per ``Store.park`` call while filling.
FILL_CHUNK = 5_000
#: Due times of the backlog: this many days ahead, and this many more.
AHEAD_DAYS = 30
SPAN_DAYS = 150
#: Rounds per size, and calls of each kind per round.
ROUNDS_FULL, ROUNDS_QUICK = 5, 3
CALLS_FULL, CALLS_QUICK = 200, 50
#: ``apply_delayed_many``: calls per park.
MANY_BATCH = 100
#: Tasks per ``cancel_matching`` / ``reschedule_matching``.
MATCH_N = 1_000
#: Requests of each page (and CLI command, and scrape) per round.
PAGE_REPEAT = 5
#: Tasks due at one instant in the release measurement.
BURST_FULL, BURST_QUICK = 100_000, 10_000
#: P4 (DESIGN.md): the burst released within this many seconds.
P4_SECONDS = 3.0
#: Rule of issue 34: per-call cost at the largest size within this factor of
#: its cost at 100,000 (or the smallest size above 0), pages under GOAL_MS.
RATIO_GOAL = 1.5
GOAL_MS = 200.0
#: The plot, next to the docs that show it.
PLOT = Path(__file__).resolve().parent.parent / "docs" / "_static" / "scale.png"

_DAY_MS = 86_400_000
_PER_CALL = ("apply_delayed", "apply_delayed_many", "lookup", "reschedule", "cancel")
_MATCHING = ("cancel_matching", "reschedule_matching")
_PAGES = {
    "overview": "/",
    "timeline (week)": "/overview.part?span=week",
    "list (first page)": "/parked",
    "list (deep cursor)": None,  # filled in per size: half-way through the set
    "list (tag=tenant:7)": "/parked?tag=tenant%3A7",
}
_COMMANDS = {
    "zdelay list": ("list",),
    "zdelay status --check": ("status", "--check"),
}


def run_scale(
    sizes: tuple[int, ...] = FULL_SIZES, *, quick: bool = False, plot: Path | None = PLOT
) -> dict[str, Any]:
    """Measure every cost at each size of *sizes* (ascending) on one growing store."""
    if list(sizes) != sorted(set(sizes)):
        raise BenchmarkError(f"scale: sizes must be distinct and ascending, not {sizes}")
    rounds = ROUNDS_QUICK if quick else ROUNDS_FULL
    calls = CALLS_QUICK if quick else CALLS_FULL
    burst_n = BURST_QUICK if quick else BURST_FULL
    started = time.monotonic()
    result: dict[str, Any] = {
        "sizes": list(sizes),
        "rounds": rounds,
        "calls_per_round": calls,
        "many_batch": MANY_BATCH,
        "match_n": MATCH_N,
        "page_repeat": PAGE_REPEAT,
        "burst_n": burst_n,
        "marked_share": 1 / MARKED_SHARE,
        "machine": _machine(),
        "points": [],
    }
    with Resources() as res:
        server = res.redis()
        url = f"{server.url}/0"
        from .proj import make_app

        app = make_app(broker=url, store=url)
        res.callback(app.close)
        client = server.client()
        res.callback(client.close)
        filler = _Filler(app)
        store = filler.store
        companion = res.companion(app)
        from werkzeug.test import Client

        from celery_zdelay.web import create_app

        dashboard = create_app(app)
        res.callback(dashboard.close)
        web = Client(dashboard)
        from celery_zdelay.companion.metrics import Metrics

        metrics = Metrics(store)
        parked = 0
        for size in sizes:
            print(f"scale: filling to {size:,} ...", file=sys.stderr, flush=True)
            fill = filler.grow(client, size - parked)
            parked = size
            print(f"scale: measuring at {size:,} ...", file=sys.stderr, flush=True)
            load = MachineLoad()
            point: dict[str, Any] = {"parked": size, "fill": fill}
            point.update(_measure_size(app, store, client, web, metrics, rounds, calls))
            point["release"] = _burst(app, client, filler, burst_n)
            point["redis_used_memory_bytes"] = used_memory(client)
            point["redis_parked_entries"] = sum(
                int(client.zcard(store.keys(s).due)) for s in store.shards
            )
            point["machine"] = load.stop()
            result["points"].append(point)
            print(_point_line(point), file=sys.stderr, flush=True)
        companion.stop()
        info = client.info("memory")
        result["redis_peak_memory_bytes"] = int(info["used_memory_peak"])
        result["redis_rss_bytes"] = int(info["used_memory_rss"])
    result["seconds"] = round(time.monotonic() - started, 1)
    result["machine"]["loadavg_end"] = loadavg()
    result["verdicts"] = verdicts(result)
    if plot is not None:
        result["plot"] = str(plot_scale(result, plot))
    return result


# -- filling ----------------------------------------------------------------------


class _Filler:
    """Grows the backlog with copies of two park requests: a plain one and a marked one."""

    def __init__(self, app: Celery, *, first_seq: int = 0) -> None:
        due = now_ms() + (AHEAD_DAYS + SPAN_DAYS) * _DAY_MS
        noop = app.tasks["bench.noop"]
        captured: list[ParkRequest] = []
        park = Store.park

        def spy(store: Store, requests: Any) -> Any:
            captured.extend(requests)
            return park(store, requests)

        # The seeds go through the product's own path; their requests are copied.
        setattr(Store, "park", spy)  # noqa: B010 (for these two calls)
        try:
            noop.apply_delayed_many([(0, due)], eta=eta_for(due))
            noop.apply_delayed_many(
                [(1, due)], eta=eta_for(due), keys=[f"seed-{first_seq}"], tags=["a", "b"]
            )
        finally:
            setattr(Store, "park", park)  # noqa: B010
        self.store = store_for(app)
        self.plain, self.marked = captured
        assert self.plain.mark is None
        assert self.marked.mark is not None
        # The seeds count as two of the backlog's entries. Fillers of one store
        # that serve different apps start at different *first_seq*: ids never meet.
        self.seq = first_seq + 2
        # With several shards a copy may land on one that lacks the template.
        self.keep_template = self.store.config.shards > 1
        #: Plain entries parked per second by the last fill (a guess before one).
        self.rate = 10_000.0

    def requests(self, count: int, *, marked: bool, due_ms: Callable[[int], int]) -> Iterator[Any]:
        """Yield lists of up to FILL_CHUNK park requests: copies under new ids."""
        seed = self.marked if marked else self.plain
        seed_id = seed.task_id.encode()
        for start in range(0, count, FILL_CHUNK):
            chunk = []
            for _ in range(min(FILL_CHUNK, count - start)):
                seq = self.seq
                self.seq += 1
                task_id = str(uuid.UUID(int=seq))
                mark = None
                if marked and seed.mark is not None:
                    tags = (f"user:{seq}", f"tenant:{seq % 1000}")
                    mark = dataclasses.replace(seed.mark, key=f"order:{seq}", tags=tags)
                chunk.append(
                    dataclasses.replace(
                        seed,
                        task_id=task_id,
                        due=Due("a", due_ms(seq)),
                        payload=seed.payload.replace(seed_id, task_id.encode()),
                        template=seed.template if self.keep_template else None,
                        mark=mark,
                        message=None,
                    )
                )
            yield chunk

    def grow(self, client: redis.Redis, count: int) -> dict[str, Any]:
        """Park *count* more entries months ahead; return the time and memory they took."""
        if count <= 0:
            return {"added": 0}
        base = now_ms() + AHEAD_DAYS * _DAY_MS
        span = SPAN_DAYS * _DAY_MS

        def due_ms(seq: int) -> int:
            # Spread over the span, each entry at its own place: parks land
            # anywhere in the set, as a reminder per user does.
            return base + (seq * 2_654_435_761) % span

        marked_n = count // MARKED_SHARE
        plain_n = count - marked_n
        out: dict[str, Any] = {"added": count}
        for kind, n, marked in (("plain", plain_n, False), ("marked", marked_n, True)):
            before = used_memory(client)
            began = time.perf_counter()
            for chunk in self.requests(n, marked=marked, due_ms=due_ms):
                self.store.park(chunk)
            seconds = time.perf_counter() - began
            added = used_memory(client) - before
            if not marked and n >= FILL_CHUNK:
                self.rate = n / seconds
            out[kind] = {
                "n": n,
                "seconds": round(seconds, 1),
                "per_second": round(n / seconds) if seconds else None,
                "bytes_per_task": round(added / n) if n else None,
            }
        return out


# -- one size ---------------------------------------------------------------------


def _measure_size(
    app: Celery,
    store: Store,
    client: redis.Redis,
    web: Any,
    metrics: Any,
    rounds: int,
    calls: int,
) -> dict[str, Any]:
    from click.testing import CliRunner

    from celery_zdelay.cli import zdelay

    noop = app.tasks["bench.noop"]
    samples: dict[str, list[list[float]]] = {}
    redis_us: dict[str, list[float]] = {}
    due_key = store.keys(0).due
    total = int(client.zcard(due_key))
    pages = dict(_PAGES)
    if total:
        middle = client.zrange(due_key, total // 2, total // 2, withscores=True)
        from celery_zdelay.web.queries import Cursor

        cursor = Cursor(int(middle[0][1]), 0, middle[0][0].decode()).encode()
        pages["list (deep cursor)"] = f"/parked?cursor={cursor}"
    else:
        pages.pop("list (deep cursor)")
    base = now_ms() + AHEAD_DAYS * _DAY_MS
    span = SPAN_DAYS * _DAY_MS
    cli_obj = _cli_context(app)
    exit_codes: dict[str, list[int]] = {}

    def timed(name: str, fn: Callable[[], Any], count: int = 1) -> Any:
        """Run *fn*, add its ms to this round's samples of *name* (divided by *count*)."""
        before = redis_usec(client)
        began = time.perf_counter()
        value = fn()
        elapsed = (time.perf_counter() - began) * 1000
        spent = redis_usec(client) - before
        samples.setdefault(name, [[] for _ in range(rounds)])[round_no].append(elapsed / count)
        redis_us.setdefault(name, []).append(spent / count)
        return value

    for round_no in range(rounds):
        dues = [base + (i * 40_503 + round_no * 7_919) * 997 % span for i in range(calls)]
        ids = [
            timed("apply_delayed", lambda d=d: noop.apply_delayed((0, d), eta=eta_for(d))).id
            for d in dues
        ]
        many_ids: list[str] = []
        for d in dues[: max(calls // 10, 5)]:
            results = timed(
                "apply_delayed_many",
                lambda d=d: noop.apply_delayed_many(
                    [(i, d) for i in range(MANY_BATCH)], eta=eta_for(d)
                ),
            )
            many_ids += [r.id for r in results]
        for task_id in ids:
            timed("lookup", lambda t=task_id: celery_zdelay.lookup(t, app=app))
        for task_id, d in zip(ids, reversed(dues), strict=True):
            when = eta_for(d)
            timed(
                "reschedule", lambda t=task_id, w=when: celery_zdelay.reschedule(t, eta=w, app=app)
            )
        for task_id in ids:
            timed("cancel", lambda t=task_id: celery_zdelay.cancel(t, app=app))
        cancel_ids(many_ids, app=app)
        for name in _MATCHING:
            tag = f"match:{name}:{round_no}:{uuid.uuid4().hex[:8]}"
            d = dues[0]
            for start in range(0, MATCH_N, 500):
                count = min(500, MATCH_N - start)
                noop.apply_delayed_many([(i, d) for i in range(count)], eta=eta_for(d), tags=[tag])
            if name == "cancel_matching":
                moved = timed(name, lambda t=tag: celery_zdelay.cancel_matching(tag=t, app=app))
            else:
                moved = timed(
                    name,
                    lambda t=tag: celery_zdelay.reschedule_matching(
                        tag=t, countdown=AHEAD_DAYS * 86_400, app=app
                    ),
                )
                celery_zdelay.cancel_matching(tag=tag, app=app)
            if moved != MATCH_N:
                raise BenchmarkError(f"scale: {name} moved {moved} of {MATCH_N}")
        for _ in range(PAGE_REPEAT):
            for name, path in pages.items():
                assert path is not None
                before = redis_usec(client)
                elapsed, store_ms, _ = request_page(web, path)
                redis_us.setdefault(name, []).append(redis_usec(client) - before)
                samples.setdefault(name, [[] for _ in range(rounds)])[round_no].append(elapsed)
                samples.setdefault(f"{name} (store)", [[] for _ in range(rounds)])[round_no].append(
                    store_ms
                )
            for name, args in _COMMANDS.items():
                reply = timed(name, lambda a=args: _cli(CliRunner, zdelay, cli_obj, a))
                exit_codes.setdefault(name, []).append(reply)
            timed("prometheus scrape", lambda: _scrape(metrics))
    costs = {name: _summary(per_round) for name, per_round in samples.items()}
    for name, values in redis_us.items():
        costs[name]["redis_us_per_call"] = round(sorted(values)[len(values) // 2], 1)
    return {
        "costs": costs,
        "exit_codes": {name: sorted(set(codes)) for name, codes in exit_codes.items()},
    }


def _summary(per_round: list[list[float]]) -> dict[str, Any]:
    """p50/p99 of each round; their medians across rounds with the spread (min, max)."""
    p50s = [quantiles(values)["p50"] for values in per_round if values]
    p99s = [quantiles(values)["p99"] for values in per_round if values]
    ordered50, ordered99 = sorted(p50s), sorted(p99s)
    return {
        "n": sum(len(values) for values in per_round),
        "p50": ordered50[len(ordered50) // 2],
        "p50_min": ordered50[0],
        "p50_max": ordered50[-1],
        "p99": ordered99[len(ordered99) // 2],
        "p99_min": ordered99[0],
        "p99_max": ordered99[-1],
    }


def _cli_context(app: Celery) -> Any:
    from celery.bin.base import CLIContext

    return CLIContext(app=app, no_color=True, workdir=None)


def _cli(runner_cls: Any, command: Any, obj: Any, args: tuple[str, ...]) -> int:
    reply = runner_cls().invoke(command, list(args), obj=obj, prog_name="celery zdelay")
    if reply.exception is not None and not isinstance(reply.exception, SystemExit):
        raise BenchmarkError(f"scale: zdelay {' '.join(args)} failed: {reply.exception!r}")
    return int(reply.exit_code)


def _scrape(metrics: Any) -> bytes:
    from prometheus_client import generate_latest

    return bytes(generate_latest(metrics.registry))


# -- release with the backlog behind ---------------------------------------------------


def _burst(app: Celery, client: redis.Redis, filler: _Filler, n: int) -> dict[str, Any]:
    """Park *n* copies due at one instant; seconds until the companion handed off the last."""
    queue = str(app.conf.task_default_queue)
    client.delete(queue)
    # Parking the burst takes as long as filling as many: allow twice that.
    margin_s = 3.0 + 2 * n / max(filler.rate, 1_000)
    due = now_ms() + int(margin_s * 1000)
    began = time.perf_counter()
    for chunk in filler.requests(n, marked=False, due_ms=lambda seq: due):
        filler.store.park(chunk)
    park_s = time.perf_counter() - began
    if now_ms() > due - 300:
        raise BenchmarkError(f"scale: parking the burst of {n:,} took {park_s:.1f} s, past due")
    time.sleep(max(0.0, (due - now_ms()) / 1000 - 0.05))
    load = MachineLoad()
    deadline = time.monotonic() + 60 + n / 1000
    first_ms, stamp = wait_for_list(client, queue, n, deadline, "scale")
    machine = load.stop()
    client.delete(queue)
    seconds = (stamp - due) / 1000
    return {
        "n": n,
        "seconds": round(seconds, 3),
        "rate": round(n / max(seconds, 1e-3)),
        "first_seen_ms": None if first_ms is None else first_ms - due,
        "machine": machine,
    }


# -- verdicts, table, plot -------------------------------------------------------------


def _reference(result: dict[str, Any]) -> dict[str, Any] | None:
    """The point the largest is compared with: 100,000 parked, else the smallest above 0."""
    points = [p for p in result["points"] if p["parked"] > 0]
    if len(points) < 2:
        return None
    exact = [p for p in points if p["parked"] == 100_000]
    return exact[0] if exact else points[0]


def verdicts(result: dict[str, Any]) -> dict[str, Any]:
    """Issue 34's rules on the measured points: ratios of the largest to the reference."""
    out: dict[str, Any] = {}
    reference = _reference(result)
    largest = result["points"][-1] if result["points"] else None
    if largest is None:
        return out
    if reference is not None and reference is not largest:
        ratios = {}
        for name in (*_PER_CALL, *_MATCHING, "prometheus scrape"):
            before = reference["costs"][name]["p50"]
            after = largest["costs"][name]["p50"]
            ratios[name] = round(after / before, 2) if before else None
        out["p50_ratio"] = {
            "of": largest["parked"],
            "to": reference["parked"],
            "goal": RATIO_GOAL,
            "ratios": ratios,
            "met": all(r is not None and r <= RATIO_GOAL for r in ratios.values()),
        }
    pages = [name for name in (*_PAGES, *_COMMANDS) if name in largest["costs"]]
    out["pages_p99_ms"] = {
        "at": largest["parked"],
        "goal": GOAL_MS,
        "worst": max(largest["costs"][name]["p99"] for name in pages),
        "met": all(largest["costs"][name]["p99"] < GOAL_MS for name in pages),
    }
    out["release"] = {
        "at": largest["parked"],
        "n": largest["release"]["n"],
        "seconds": largest["release"]["seconds"],
        "goal_seconds": P4_SECONDS,
        "met": largest["release"]["seconds"] <= P4_SECONDS,
    }
    return out


def table(result: dict[str, Any]) -> str:
    """The costs per size as a plain-text table: p50 (p99) ms, and Redis µs per call."""
    points = result["points"]
    names = [*_PER_CALL, *_MATCHING]
    names += [n for n in points[-1]["costs"] if not n.endswith("(store)") and n not in names]
    width = 22
    lines = [
        "Cost as the work grows: p50 ms (p99 ms) [Redis µs per call]; median of "
        f"{result['rounds']} rounds",
        f"{'parked':<28}" + "".join(f"{p['parked']:>{width},}" for p in points),
    ]
    for name in names:
        cells = []
        for p in points:
            cost = p["costs"].get(name)
            if cost is None:
                cells.append(f"{'-':>{width}}")
                continue
            redis_part = cost.get("redis_us_per_call")
            text = f"{cost['p50']:.2f} ({cost['p99']:.1f})"
            if redis_part is not None:
                text += f" [{redis_part:.0f}]"
            cells.append(f"{text:>{width}}")
        lines.append(f"{name:<28}" + "".join(cells))
    for label, key in (("B/task plain", "plain"), ("B/task key+2 tags", "marked")):
        cells = []
        for p in points:
            value = (p["fill"].get(key) or {}).get("bytes_per_task")
            cells.append(f"{'-' if value is None else f'{value:,}':>{width}}")
        lines.append(f"{label:<28}" + "".join(cells))
    lines.append(
        f"{'release of burst (s)':<28}"
        + "".join(f"{p['release']['seconds']:>{width}.2f}" for p in points)
    )
    lines.append(
        f"{'Redis used_memory (MB)':<28}"
        + "".join(f"{p['redis_used_memory_bytes'] / 1e6:>{width},.0f}" for p in points)
    )
    lines.append(f"{'fill (s)':<28}" + "".join(f"{_fill_seconds(p):>{width}.0f}" for p in points))
    machine = result["machine"]
    lines.append(
        f"machine: {machine['cpus']} CPUs ({machine['cpu']}), {machine['memory_gb']} GB; "
        f"uptime at start: {machine['uptime']}; load average at end: {machine.get('loadavg_end')}"
    )
    lines.append(
        f"took {result.get('seconds')} s; "
        f"Redis peak {result.get('redis_peak_memory_bytes', 0) / 1e9:.2f} GB"
    )
    lines.append(f"verdicts: {json.dumps(result.get('verdicts'))}")
    return "\n".join(lines)


def _fill_seconds(point: dict[str, Any]) -> float:
    return float(sum((point["fill"].get(k) or {}).get("seconds", 0) for k in ("plain", "marked")))


def rst_table(result: dict[str, Any]) -> str:
    """The table as the reStructuredText list-table docs/performance.rst shows."""
    points = result["points"]
    names = [*_PER_CALL, *_MATCHING]
    names += [n for n in points[-1]["costs"] if not n.endswith("(store)") and n not in names]
    lines = [".. list-table::", "   :header-rows: 1", "", "   * - parked"]
    lines += [f"     - {p['parked']:,}" for p in points]
    for name in names:
        label = name if " " in name and not name.startswith("zdelay") else f"``{name}``"
        lines.append(f"   * - {label}")
        for p in points:
            cost = p["costs"].get(name)
            if cost is None:
                lines.append("     - (none)")
                continue
            spread = f"[{cost['p50_min']:.2f}-{cost['p50_max']:.2f}]"
            text = f"{cost['p50']:.2f} {spread} / {cost['p99']:.1f}"
            if cost.get("redis_us_per_call") is not None:
                text += f"; Redis {cost['redis_us_per_call']:,.0f} µs"
            lines.append(f"     - {text}")
    for label, key in (
        ("memory per task, plain (B)", "plain"),
        ("memory per task, key and two tags (B)", "marked"),
    ):
        lines.append(f"   * - {label}")
        for p in points:
            value = (p["fill"].get(key) or {}).get("bytes_per_task")
            lines.append(f"     - {'(none added)' if value is None else f'{value:,}'}")
    lines.append(f"   * - release of {result['burst_n']:,} due at once (s)")
    lines += [f"     - {p['release']['seconds']:.2f}" for p in points]
    lines.append("   * - Redis ``used_memory`` (MB)")
    lines += [f"     - {p['redis_used_memory_bytes'] / 1e6:,.0f}" for p in points]
    lines.append("   * - load average during the size's measurements")
    lines += [
        f"     - {p['machine']['loadavg_start'][0]:.1f} to {p['machine']['loadavg_end'][0]:.1f}"
        for p in points
    ]
    return "\n".join(lines)


def plot_scale(result: dict[str, Any], path: Path) -> Path:
    """Draw each cost's p50 against the number parked (log scale) as a PNG at *path*."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = result["points"]
    # Zero parked sits at 1 on a log axis, labelled 0.
    xs = [max(p["parked"], 1) for p in points]
    groups = {
        "per call (p50 ms)": [*_PER_CALL],
        f"matching {result['match_n']:,} by tag (p50 ms)": [*_MATCHING],
        "pages, CLI, scrape (p50 ms)": [
            *(n for n in _PAGES if n in points[-1]["costs"]),
            *_COMMANDS,
            "prometheus scrape",
        ],
    }
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2), dpi=100)
    for axis, (title, names) in zip(axes, groups.items(), strict=False):
        for name in names:
            ys = [p["costs"].get(name, {}).get("p50") for p in points]
            axis.plot(xs, ys, marker="o", label=name)
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("tasks parked (0 drawn at 1)")
        axis.legend(fontsize=7)
        axis.grid(True, which="both", alpha=0.3)
    release = axes[3]
    release.plot(xs, [p["release"]["seconds"] for p in points], marker="o", label="release (s)")
    release.axhline(P4_SECONDS, color="#d62728", linestyle="--", linewidth=1, label="P4 target")
    memory = release.twinx()
    memory.plot(
        xs,
        [p["redis_used_memory_bytes"] / 1e9 for p in points],
        marker="s",
        color="#7f7f7f",
        label="Redis used_memory (GB)",
    )
    release.set_xscale("log")
    release.set_ylim(bottom=0)
    release.set_ylabel("seconds")
    memory.set_ylabel("Redis used_memory (GB)")
    memory.set_ylim(bottom=0)
    release.set_title(f"release of {result['burst_n']:,} due at once; memory", fontsize=10)
    release.set_xlabel("tasks parked (0 drawn at 1)")
    release.legend(loc="upper left", fontsize=7)
    memory.legend(loc="lower right", fontsize=7)
    machine = result["machine"]
    fig.suptitle(
        f"Cost as the work grows: {machine['cpus']} CPUs, load average {machine['loadavg_start']} "
        f"at start, {result['machine'].get('loadavg_end')} at end",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _point_line(point: dict[str, Any]) -> str:
    costs = point["costs"]
    return (
        f"scale: {point['parked']:,} parked: apply_delayed p50 {costs['apply_delayed']['p50']} ms, "
        f"overview p50 {costs['overview']['p50']} ms, release {point['release']['seconds']} s, "
        f"Redis {point['redis_used_memory_bytes'] / 1e6:,.0f} MB"
    )


def _machine() -> dict[str, Any]:
    cpu = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    memory_kb = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            memory_kb = int(line.split()[1])
    uptime = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "memory_gb": round(memory_kb / 1024 / 1024, 1),
        "python": platform.python_version(),
        "uptime": uptime,
        "loadavg_start": loadavg(),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _parse_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part.replace("_", "")) for part in text.split(",") if part.strip())
    except ValueError:
        raise SystemExit(f"--sizes: a comma-separated list of counts, not {text!r}") from None
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.scale", description="Cost as the number parked grows."
    )
    parser.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES}, fewer rounds")
    parser.add_argument("--sizes", type=_parse_sizes, help="comma-separated sizes, ascending")
    parser.add_argument("--out", type=Path, help="also write the result as JSON here")
    parser.add_argument(
        "--plot", type=Path, default=PLOT, help="where the PNG goes (default: %(default)s)"
    )
    parser.add_argument(
        "--show", type=Path, help="measure nothing: print the table of a JSON file, redraw its plot"
    )
    parser.add_argument("--rst", action="store_true", help="with --show: the docs' list-table")
    args = parser.parse_args(argv)
    if args.show:
        shown = json.loads(args.show.read_text())
        print(rst_table(shown) if args.rst else table(shown))
        plot_scale(shown, args.plot)  # the docs' plot, redrawn from the file
        return 0
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    result = run_scale(sizes, quick=args.quick, plot=args.plot)
    print(table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
