"""P5: what parking costs the producer, beside plain ``apply_async(countdown=)``.

Per call
    ``noop.apply_delayed(args, countdown=3600)`` against
    ``noop.apply_async(args, countdown=3600)``, both to the same private Redis
    (broker = store), one call at a time as application code makes them.
    ``call_n`` calls of each, alternating which goes first, for ``call_rounds``
    rounds; the per-call time of each is the median over rounds, and the ratio
    is taken between those medians. Both paths are warmed up first (connections,
    script loading).

Bulk
    ``bulk_n`` tasks on each path, 1,000 calls per block, on one Redis:

    * ``apply_delayed_many``: ``noop.apply_delayed_many(calls, countdown=3600)``;
    * ``batch``: ``noop.apply_delayed(...)`` calls inside ``celery_zdelay.batch``;
    * ``apply_async``: ``noop.apply_async(..., countdown=3600)`` one by one,
      sent to the broker (the same Redis) as Celery sends them;
    * ``bare park``: the limit of one round trip, :data:`BARE_PARK_LUA` (ZADD +
      HSET per entry) parking payloads of the mean size the bulk path parked,
      built from bytes prepared before the clock starts;
    * ``celery build``: the other limit, Celery's own work per call alone:
      ``celery_zdelay.bulk.build_messages``, which ``apply_delayed_many`` runs
      before it encodes and parks (``create_task_message``, the publish
      signals and kombu's serialization per call), with nothing parked.

    Rate = tasks / wall time; CPU time of this process per task
    (``time.process_time``); Redis time per task from ``INFO commandstats``
    (EVALSHA, and every command), reset before each path.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any

import celery_zdelay
from celery_zdelay.bulk import build_messages

from .common import PARK_CHUNK, Sizes
from .infra import MachineLoad, Resources, commands_per_task, reset_stats, script_stats
from .proj import make_app

#: The least a script parking N messages in a ZSet+hash does, one round trip.
BARE_PARK_LUA = """
-- KEYS[1] due zset  id -> score
-- KEYS[2] msg hash  id -> payload
-- ARGV    three per entry: id, score, payload
-- returns how many were parked
for i = 1, #ARGV, 3 do
  redis.call('ZADD', KEYS[1], ARGV[i + 1], ARGV[i])
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 2])
end
return #ARGV / 3
"""


def run_producer(sizes: Sizes) -> dict[str, Any]:
    with Resources() as res:
        server = res.redis()
        url = f"{server.url}/0"
        app = make_app(broker=url, store=url)
        res.callback(app.close)
        noop = app.tasks["bench.noop"]

        def delayed(n: int, offset: int) -> float:
            started = time.perf_counter()
            for seq in range(offset, offset + n):
                noop.apply_delayed((seq, 0), countdown=3600)
            return (time.perf_counter() - started) / n

        def plain(n: int, offset: int) -> float:
            started = time.perf_counter()
            for seq in range(offset, offset + n):
                noop.apply_async((seq, 0), countdown=3600)
            return (time.perf_counter() - started) / n

        delayed(200, 0)
        plain(200, 0)
        load = MachineLoad()
        per_call: dict[str, list[float]] = {"apply_delayed": [], "apply_async": []}
        offset = 1000
        for round_no in range(sizes.call_rounds):
            order = [("apply_delayed", delayed), ("apply_async", plain)]
            if round_no % 2:
                order.reverse()
            for name, fn in order:
                per_call[name].append(fn(sizes.call_n, offset))
                offset += sizes.call_n
        calls_machine = load.stop()

        client = server.client()
        res.callback(client.close)
        bulk = _bulk_paths(app, client, sizes.bulk_n, offset)

    delayed_us = statistics.median(per_call["apply_delayed"]) * 1e6
    plain_us = statistics.median(per_call["apply_async"]) * 1e6
    return {
        "call_n": sizes.call_n,
        "rounds": sizes.call_rounds,
        "apply_delayed_us": round(delayed_us, 1),
        "apply_async_us": round(plain_us, 1),
        "ratio": round(delayed_us / plain_us, 3),
        "rounds_us": {k: [round(v * 1e6, 1) for v in vs] for k, vs in per_call.items()},
        "calls_machine": calls_machine,
        "bulk_n": sizes.bulk_n,
        "bulk_chunk": PARK_CHUNK,
        "bulk": bulk,
        "bulk_rate": bulk["apply_delayed_many"]["rate"],
        "bulk_limit_ratio": round(
            bulk["apply_delayed_many"]["rate"] / bulk["bare park"]["rate"], 3
        ),
        "bulk_celery_ratio": round(
            bulk["apply_delayed_many"]["rate"] / bulk["celery build"]["rate"], 3
        ),
    }


def _bulk_paths(app: Any, client: Any, n: int, offset: int) -> dict[str, Any]:
    noop = app.tasks["bench.noop"]
    due_key = celery_zdelay.parking.store_for(app).keys(0).due
    msg_key = celery_zdelay.parking.store_for(app).keys(0).msg

    def chunks(base: int) -> list[range]:
        return [
            range(base + start, base + min(start + PARK_CHUNK, n))
            for start in range(0, n, PARK_CHUNK)
        ]

    def many(base: int) -> None:
        for chunk in chunks(base):
            noop.apply_delayed_many([(seq, 0) for seq in chunk], countdown=3600)

    def batch(base: int) -> None:
        for chunk in chunks(base):
            with celery_zdelay.batch(app):
                for seq in chunk:
                    noop.apply_delayed((seq, 0), countdown=3600)

    def plain(base: int) -> None:
        with app.producer_or_acquire() as producer:
            for seq in range(base, base + n):
                noop.apply_async((seq, 0), countdown=3600, producer=producer)

    def celery_build(base: int) -> None:
        for chunk in chunks(base):
            build_messages(noop, [(seq, 0) for seq in chunk], {"countdown": 3600})

    many(0)  # warm: scripts loaded, the first call's path recorded
    paths: dict[str, Any] = {}
    for name, fn in (
        ("apply_delayed_many", many),
        ("batch", batch),
        ("apply_async", plain),
        ("celery build", celery_build),
    ):
        client.flushdb()
        paths[name] = _timed(client, n, functools.partial(fn, offset))
        offset += n
    client.flushdb()
    many(offset)
    ids = client.zrange(due_key, 0, 999)
    size = round(sum(client.hstrlen(msg_key, i) for i in ids) / len(ids))
    client.flushdb()
    paths["bare park"] = _bare_park(client, n, size)
    paths["bare park"]["payload_bytes"] = size
    return paths


def _timed(client: Any, n: int, run: Any) -> dict[str, Any]:
    reset_stats(client)
    load = MachineLoad()
    started = time.perf_counter()
    cpu_started = time.process_time()
    run()
    cpu_seconds = time.process_time() - cpu_started
    seconds = time.perf_counter() - started
    machine = load.stop()
    scripts = script_stats(client)
    commands = commands_per_task(client, n)
    # EVALSHA's time already holds the commands its scripts ran.
    all_usec = sum(
        v["us_per_task"]
        for k, v in commands.items()
        if k in ("evalsha", "eval") or not scripts["calls"]
    )
    return {
        "n": n,
        "seconds": round(seconds, 3),
        "rate": round(n / seconds),
        "wall_us_per_task": round(seconds * 1e6 / n, 1),
        # This process's CPU time: what a loaded machine disturbs least.
        "cpu_us_per_task": round(cpu_seconds * 1e6 / n, 1),
        "script_us_per_task": round(scripts["server_ms"] * 1000 / n, 2),
        "redis_us_per_task": round(all_usec, 2),
        "redis_scripts": scripts,
        "commands_per_task": commands,
        "machine": machine,
    }


def _bare_park(client: Any, n: int, size: int) -> dict[str, Any]:
    park = client.register_script(BARE_PARK_LUA)
    park(keys=["bare:due", "bare:msg"], args=[])
    calls = []
    for start in range(0, n, PARK_CHUNK):
        args: list[Any] = []
        for seq in range(start, min(n, start + PARK_CHUNK)):
            task_id = f"{seq:08d}-bare-park-task-id"
            args += [task_id, seq, task_id.encode().ljust(size, b"x")]
        calls.append(args)

    def run() -> None:
        for args in calls:
            park(keys=["bare:due", "bare:msg"], args=args)

    result = _timed(client, n, run)
    if client.zcard("bare:due") != n:
        raise RuntimeError("bare park: not every entry was parked")
    return result
