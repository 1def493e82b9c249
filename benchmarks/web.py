"""Dashboard pages over a large store: ``python -m benchmarks --only web``.

Parks N tasks (1,000,000 in a full run, 50,000 with ``--quick``) on one
private Redis, spread over the next week; 1 % of them are another task,
``bench.rare``. The first 10,000 go through the real ``apply_delayed``
path, the rest are copies of their stored payloads under new ids (see
:func:`_park`). Then each page of the
dashboard is requested again and again in this process, through its WSGI
interface (no HTTP socket), and three durations are kept: the whole page
(routing, store, rendering) and the store's part of it (Redis round trips
and reading entries' headers), both per request, from the dashboard's
``Server-Timing`` header; and the time Redis itself spent executing the
page's commands, from ``INFO commandstats`` before and after all requests
of a page, divided by their number (a mean). The goal is a p99 under
200 ms for the overview and the listing.

The pages, side by side:

- ``overview``: counts per shard, companions and the timeline of the next
  day (one ``ZCOUNT`` per bar); ``overview (week)`` and ``overview (all)``
  the same with other spans;
- ``parked``: the first page of the listing (50 entries);
- ``parked (due window)``: a page of entries due in a one-hour window two
  days ahead (a range read from the window's start);
- ``parked (deep page)``: the page after a cursor half-way through the set;
- ``parked (task=bench.noop)``: a filter 99 % of entries match;
- ``parked (task=bench.rare)``: a filter 1 % match: it reads up to its scan
  bound per shard and says where it stopped;
- ``entry``: one entry's detail.
"""

from __future__ import annotations

import re
import sys
import time
import uuid
from typing import Any

import celery_zdelay
from celery_zdelay.config import get_config
from celery_zdelay.store import Store
from celery_zdelay.store.redis_keys import shard_keys

from .common import PARK_CHUNK, Sizes, eta_for, now_ms, quantiles
from .infra import MachineLoad, Resources
from .proj import make_app

#: Requests per page, after WARMUP unmeasured ones.
REPEAT_FULL = 200
REPEAT_QUICK = 40
WARMUP = 5
#: Tasks parked through the real path; the rest are copies of their payloads.
SEED = 10_000
COPY_CHUNK = 5_000
#: Goal of the overview and listing pages (p99 of the whole page).
GOAL_MS = 200.0
_WEEK_MS = 7 * 24 * 3600_000


def run_web(sizes: Sizes) -> dict[str, Any]:
    from werkzeug.test import Client

    from celery_zdelay.web import create_app
    from celery_zdelay.web.queries import Cursor

    n = sizes.memory_n * 10
    repeat = REPEAT_FULL if n >= 500_000 else REPEAT_QUICK
    with Resources() as res:
        server = res.redis()
        url = f"{server.url}/0"
        app = make_app(broker=url, store=url)
        res.callback(app.close)
        start_ms = now_ms() + 60_000
        park_s = _park(app, n, start_ms)
        client = server.client()
        memory = int(client.info("memory")["used_memory"])
        dashboard = create_app(app)
        res.callback(dashboard.close)
        web = Client(dashboard)
        listing = web.get("/parked").get_data(as_text=True)
        some_id = re.search(r'data-id="([^"]+)"', listing)
        assert some_id is not None, listing[:500]
        due_key = shard_keys(get_config(app).key_prefix, 0).due
        middle = client.zrange(due_key, n // 2, n // 2, withscores=True)
        cursor = Cursor(int(middle[0][1]), 0, middle[0][0].decode()).encode()
        pages = {
            "overview": "/",
            "overview (week)": "/overview.part?span=week",
            "overview (all)": "/overview.part?span=all",
            "parked": "/parked",
            "parked (due window)": "/parked?due_after=2d&due_before=2d1h",
            "parked (deep page)": f"/parked?cursor={cursor}",
            "parked (task=bench.noop)": "/parked?task=bench.noop",
            "parked (task=bench.rare)": "/parked?task=bench.rare",
            "entry": f"/entry?id={some_id.group(1)}",
        }
        load = MachineLoad()
        results: dict[str, Any] = {}
        for name, path in pages.items():
            results[name] = _measure(web, client, path, repeat)
        machine = load.stop()
    goal_pages = ("overview", "parked", "parked (due window)", "parked (task=bench.noop)")
    return {
        "parked_n": n,
        "park_seconds": round(park_s, 1),
        "redis_used_memory_bytes": memory,
        "repeat": repeat,
        "pages": results,
        "goal_p99_ms": GOAL_MS,
        "goal_met": all(results[p]["page_ms"]["p99"] < GOAL_MS for p in goal_pages),
        "added_index_bytes_per_entry": 0,
        "machine": machine,
    }


def _park(app: Any, n: int, start_ms: int) -> float:
    """Park *n* tasks due over the next week, 1 % of them ``bench.rare``; return seconds.

    The first :data:`SEED` are parked through ``apply_delayed`` (and
    ``send_delayed``); the rest are their stored payloads copied under new
    ids with later due times, written with pipelined HSET/ZADD, so filling
    a million entries takes seconds rather than most of an hour on a loaded
    machine. Every page reads them as it reads any entry.
    """
    noop = app.tasks["bench.noop"]
    step = max(_WEEK_MS // n, 1)
    started = time.perf_counter()
    seed = min(n, SEED)
    for chunk in range(0, seed, PARK_CHUNK):
        with celery_zdelay.batch(app):
            for seq in range(chunk, min(chunk + PARK_CHUNK, seed)):
                due = start_ms + seq * step
                if seq % 100 == 99:
                    celery_zdelay.send_delayed(app, "bench.rare", args=(seq,), eta=eta_for(due))
                else:
                    noop.apply_delayed((seq, due), eta=eta_for(due))
    store = Store(get_config(app))
    try:
        keys = store.keys(0)
        assert store.config.shards == 1
        ordered = [m for m, _ in store.client.zrange(keys.due, 0, -1, withscores=True)]
        payloads = store.client.hmget(keys.msg, ordered)
        for chunk in range(seed, n, COPY_CHUNK):
            with store.client.pipeline(transaction=False) as pipe:
                end = min(chunk + COPY_CHUNK, n)
                copies = {f"copy-{seq:07d}-{uuid.uuid4()}": seq for seq in range(chunk, end)}
                pipe.hset(
                    keys.msg,
                    mapping={tid: payloads[seq % seed] for tid, seq in copies.items()},
                )
                pipe.zadd(
                    keys.due, {tid: (start_ms + seq * step) * 1024 for tid, seq in copies.items()}
                )
                pipe.execute()
    finally:
        store.close()
    return time.perf_counter() - started


def _measure(web: Any, client: Any, path: str, repeat: int) -> dict[str, Any]:
    page_ms: list[float] = []
    store_ms: list[float] = []
    for index in range(WARMUP + repeat):
        if index == WARMUP:
            before = redis_usec(client)
        elapsed, store, body = request_page(web, path)
        if index < WARMUP:
            continue
        page_ms.append(elapsed)
        store_ms.append(store)
    spent_usec = redis_usec(client) - before
    return {
        "path": path,
        "page_ms": quantiles(page_ms),
        "store_ms": quantiles(store_ms),
        "redis_server_ms_mean": round(max(spent_usec, 0) / repeat / 1000, 3),
        "bytes": len(body),
    }


def request_page(web: Any, path: str) -> tuple[float, float, bytes]:
    """Request *path* of the dashboard (a werkzeug test client); return its costs and body.

    The costs are the whole page in ms, measured here, and the store's part
    of it in ms, from the page's ``Server-Timing`` header.
    """
    started = time.perf_counter()
    reply = web.get(path)
    body = reply.get_data()
    elapsed = (time.perf_counter() - started) * 1000
    assert reply.status_code == 200, (path, reply.status_code, body[:300])
    timing = re.search(r"store;dur=([0-9.]+)", reply.headers["Server-Timing"])
    assert timing is not None
    return elapsed, float(timing.group(1)), body


def redis_usec(client: Any) -> int:
    """Microseconds Redis spent executing commands so far, INFO (our reading) left out."""
    stats = client.info("commandstats")
    return sum(int(value["usec"]) for name, value in stats.items() if name != "cmdstat_info")


def table(result: dict[str, Any]) -> str:
    """Return the pages as a plain-text table."""
    lines = [
        f"{result['parked_n']:,} parked (parked in {result['park_seconds']} s); "
        f"{result['repeat']} requests per page; goal p99 < {result['goal_p99_ms']:.0f} ms",
        f"{'page':<28}{'p50 ms':>9}{'p99 ms':>9}{'store p50':>11}{'store p99':>11}"
        f"{'redis mean':>12}{'KB':>7}",
    ]
    for name, page in result["pages"].items():
        lines.append(
            f"{name:<28}{page['page_ms']['p50']:>9.1f}{page['page_ms']['p99']:>9.1f}"
            f"{page['store_ms']['p50']:>11.1f}{page['store_ms']['p99']:>11.1f}"
            f"{page['redis_server_ms_mean']:>12.2f}{page['bytes'] / 1024:>7.0f}"
        )
    lines.append(f"goal met: {result['goal_met']}; load: {result['machine']}")
    return "\n".join(lines)


if __name__ == "__main__":
    from .common import FULL, QUICK

    print(table(run_web(QUICK if "--quick" in sys.argv else FULL)))
