"""P5: what parking costs the producer, beside plain ``apply_async(countdown=)``.

Per call
    ``noop.apply_delayed(args, countdown=3600)`` against
    ``noop.apply_async(args, countdown=3600)``, one call at a time as
    application code makes them, once with the broker on the store's Redis and
    once with RabbitMQ as the broker (store on Redis; skipped when RabbitMQ is
    unreachable). ``call_rounds`` rounds (at least five) of ``call_n`` calls
    of each, interleaved (A, B, B, A, ...), each call timed alone; per round
    the p50 and p90 of each path and their ratios. Reported: the median of
    each ratio over the rounds with its spread (min-max, IQR). Both paths are
    warmed up first (connections, script loading).

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

    Bulk against Celery, interleaved: ``call_rounds`` rounds of
    ``apply_delayed_many`` and ``celery build`` alternately; the ratio of
    their rates per round, its median and spread (``bulk_rounds``). Each
    round also times the ``bare park`` of as many prepared entries, so that
    the round gives the *ceiling* of that ratio: ``celery build``'s time over
    itself plus the bare park's, what ``apply_delayed_many`` would reach if
    its own encoding cost nothing and its script did no more than one
    ``ZADD`` and one ``HSET`` per entry (it builds with Celery's builder,
    then waits for one script, so it cannot do better without giving up
    "one call is all or nothing").

    Rate = tasks / wall time; CPU time of this process per task
    (``time.process_time``); Redis time per task from ``INFO commandstats``
    (EVALSHA, and every command), reset before each path.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any

from kombu import Connection

import celery_zdelay
from celery_zdelay.bulk import build_messages

from .common import PARK_CHUNK, Sizes, percentile, spread
from .infra import (
    RABBITMQ_URL,
    MachineLoad,
    Resources,
    commands_per_task,
    rabbitmq_version,
    reset_stats,
    script_stats,
    unique,
)
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
        per_call = _per_call(app, sizes)

        rabbit = _rabbit_per_call(res, url, sizes) if rabbitmq_version() else None

        client = server.client()
        res.callback(client.close)
        offset = 10_000_000
        bulk = _bulk_paths(app, client, sizes.bulk_n, offset)
        size = bulk["bare park"]["payload_bytes"]
        bulk_rounds = _bulk_rounds(app, client, sizes, 2 * offset, size)

    result = {
        "call_n": sizes.call_n,
        "rounds": sizes.call_rounds,
        "apply_delayed_us": per_call["apply_delayed_us"],
        "apply_async_us": per_call["apply_async_us"],
        "ratio": per_call["p50_ratio"]["median"],
        "per_call": {"redis": per_call, "rabbitmq": rabbit},
        "bulk_n": sizes.bulk_n,
        "bulk_chunk": PARK_CHUNK,
        "bulk": bulk,
        "bulk_rate": bulk["apply_delayed_many"]["rate"],
        "bulk_limit_ratio": round(
            bulk["apply_delayed_many"]["rate"] / bulk["bare park"]["rate"], 3
        ),
        "bulk_rounds": bulk_rounds,
        "bulk_celery_ratio": bulk_rounds["ratio"]["median"],
    }
    return result


def _rabbit_per_call(res: Resources, store_url: str, sizes: Sizes) -> dict[str, Any]:
    """The per-call comparison with RabbitMQ as the broker, the store on Redis."""
    queue = unique("zbench")
    app = make_app(broker=RABBITMQ_URL, store=store_url, queue=queue)
    res.callback(app.close)
    with Connection(RABBITMQ_URL) as connection:
        app.amqp.queues[queue].bind(connection.default_channel).declare()

    def delete() -> None:
        with Connection(RABBITMQ_URL) as connection:
            app.amqp.queues[queue].bind(connection.default_channel).delete()

    res.callback(delete)
    return _per_call(app, sizes)


def _per_call(app: Any, sizes: Sizes) -> dict[str, Any]:
    """``apply_delayed`` vs ``apply_async(countdown=)``, one call at a time.

    ``call_rounds`` rounds of ``call_n`` calls of each, interleaved (A, B, B,
    A, ...) so that the machine's load falls on both alike. Each call is timed
    alone; per round, the p50 and p90 of each path and their ratios. Reported:
    the median over rounds of each ratio, with its spread.
    """
    noop = app.tasks["bench.noop"]

    def timed(call: Any, n: int, offset: int) -> list[float]:
        times = []
        clock = time.perf_counter
        for seq in range(offset, offset + n):
            started = clock()
            call((seq, 0), countdown=3600)
            times.append(clock() - started)
        return times

    paths = {"apply_delayed": noop.apply_delayed, "apply_async": noop.apply_async}
    for call in paths.values():  # warm: connections, scripts loaded
        timed(call, 200, 0)
    load = MachineLoad()
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in paths}
    offset = 1000
    for round_no in range(sizes.call_rounds):
        order = list(paths.items())
        if round_no % 2:
            order.reverse()
        for name, call in order:
            times = timed(call, sizes.call_n, offset)
            offset += sizes.call_n
            rounds[name].append(
                {
                    "p50": percentile(times, 0.5) * 1e6,
                    "p90": percentile(times, 0.9) * 1e6,
                    "mean": statistics.fmean(times) * 1e6,
                }
            )
    machine = load.stop()

    def median_of(name: str, stat: str) -> float:
        return round(statistics.median(r[stat] for r in rounds[name]), 1)

    def ratios(stat: str) -> dict[str, Any]:
        return spread(
            [
                d[stat] / a[stat]
                for d, a in zip(rounds["apply_delayed"], rounds["apply_async"], strict=True)
            ]
        )

    return {
        "broker": app.conf.broker_url.split(":", 1)[0],
        "call_n": sizes.call_n,
        "rounds": sizes.call_rounds,
        "apply_delayed_us": median_of("apply_delayed", "p50"),
        "apply_async_us": median_of("apply_async", "p50"),
        "apply_delayed_p90_us": median_of("apply_delayed", "p90"),
        "apply_async_p90_us": median_of("apply_async", "p90"),
        "p50_ratio": ratios("p50"),
        "p90_ratio": ratios("p90"),
        "mean_ratio": ratios("mean"),
        "rounds_us": {
            name: [{k: round(v, 1) for k, v in r.items()} for r in rs]
            for name, rs in rounds.items()
        },
        "machine": machine,
    }


def _bulk_rounds(app: Any, client: Any, sizes: Sizes, offset: int, size: int) -> dict[str, Any]:
    """``apply_delayed_many`` vs Celery's own build and send, interleaved rounds.

    Each round parks ``bulk_n / call_rounds`` tasks through
    ``apply_delayed_many`` (1,000 per call), builds the same calls with
    ``build_messages`` (nothing parked) and bare-parks as many entries of
    *size* bytes, the order turned round every round. The ratio of rates and
    its ceiling (see the module's docstring) are taken per round; reported:
    their medians and spreads.
    """
    noop = app.tasks["bench.noop"]
    n = max(PARK_CHUNK, sizes.bulk_n // sizes.call_rounds)

    def many(base: int) -> None:
        for start in range(base, base + n, PARK_CHUNK):
            noop.apply_delayed_many(
                [(seq, 0) for seq in range(start, start + PARK_CHUNK)], countdown=3600
            )

    def built(base: int) -> None:
        for start in range(base, base + n, PARK_CHUNK):
            build_messages(
                noop, [(seq, 0) for seq in range(start, start + PARK_CHUNK)], {"countdown": 3600}
            )

    bare = _bare_calls(client, n, size)

    def bare_park(base: int) -> None:
        bare()

    load = MachineLoad()
    rates: dict[str, list[float]] = {"apply_delayed_many": [], "celery build": [], "bare park": []}
    for round_no in range(sizes.call_rounds):
        client.flushdb()
        order = [("apply_delayed_many", many), ("celery build", built), ("bare park", bare_park)]
        if round_no % 2:
            order.reverse()
        for name, fn in order:
            started = time.perf_counter()
            fn(offset)
            rates[name].append(n / (time.perf_counter() - started))
            offset += n
    client.flushdb()
    return {
        "n": n,
        "rounds": sizes.call_rounds,
        "rates": {k: [round(v) for v in vs] for k, vs in rates.items()},
        "apply_delayed_many_rate": round(statistics.median(rates["apply_delayed_many"])),
        "celery_build_rate": round(statistics.median(rates["celery build"])),
        "ratio": spread(
            [m / b for m, b in zip(rates["apply_delayed_many"], rates["celery build"], strict=True)]
        ),
        # Time is n / rate: build / (build + bare) = bare_rate / (bare_rate + build_rate).
        "ceiling": spread(
            [p / (p + b) for b, p in zip(rates["celery build"], rates["bare park"], strict=True)]
        ),
        "bare_park_rate": round(statistics.median(rates["bare park"])),
        "machine": load.stop(),
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


def _bare_calls(client: Any, n: int, size: int) -> Any:
    """Return a function that bare-parks *n* entries of *size* bytes, prepared now."""
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

    return run


def _bare_park(client: Any, n: int, size: int) -> dict[str, Any]:
    result = _timed(client, n, _bare_calls(client, n, size))
    if client.zcard("bare:due") != n:
        raise RuntimeError("bare park: not every entry was parked")
    return result
