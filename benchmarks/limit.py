"""P1 against the physical limit: the atomic handoff beside a bare Lua move.

Both run in one process against one private Redis, on the same count of
messages of the same size:

* handoff: N ``bench.noop`` tasks parked already due (broker = store), then
  ``Companion(app).release_due()`` hands them into the kombu list, batch by
  batch (``zdelay_batch_size``), as a running companion does;
* bare Lua move: N payloads of the mean size of the messages the handoff
  pushed, in a ZSet (id -> score) and a hash (id -> payload), moved into a
  list by :data:`BARE_MOVE_LUA`, the least any "move due messages into a
  queue" script does (ZRANGEBYSCORE ... LIMIT 0 batch, HMGET, LPUSH, ZREM,
  HDEL), called in a loop of the same batch size.

* template rendering alone: handoff.lua's own ``zdelay_render`` (loaded from
  ``_expand.lua`` as the handoff loads it) building one parked entry's
  message with a fresh delivery tag, N times in one script, timed with the
  Redis clock (:data:`RENDER_LUA`). The handoff does at least what the bare
  move does plus this, so bare / (bare + render), in script time per task,
  bounds its ratio while entries are stored as templates (P7).

* handoff of whole messages: the same N tasks parked with
  ``zdelay_whole_messages`` (each message stored exactly as it is pushed,
  delivery tag included) and released by the same handoff, which then
  builds no string: the speed side of that setting's memory/speed
  trade-off (the memory benchmark measures the other side).

Reported per path: the rate (wall clock of the calls, in this process),
Redis script time (``INFO commandstats``, EVALSHA) per released task, and
the ratios handoff / bare move and handoff of whole messages / bare move.
Runs alternate which path goes first.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import redis

from celery_zdelay.companion import Companion
from celery_zdelay.parking import store_for
from celery_zdelay.store import Store
from celery_zdelay.store.scripts import build_source, spec

from .common import Sizes, median_run, now_ms, park_bulk, release_all
from .infra import (
    BenchmarkError,
    MachineLoad,
    Resources,
    commands_per_task,
    reset_stats,
    script_stats,
)
from .proj import DEFAULT_QUEUE, make_app

#: Batch sizes measured: the default (200) and a large one.
BATCH_SIZES = (200, 1000)

#: The least a script moving due messages from a ZSet+hash into a list does.
BARE_MOVE_LUA = """
-- KEYS[1] due zset  id -> score (due ms)
-- KEYS[2] msg hash  id -> message
-- KEYS[3] list      the queue the messages go to
-- ARGV[1] most messages to move
-- returns how many were moved
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_ms, 'LIMIT', 0, tonumber(ARGV[1]))
if #ids == 0 then return 0 end
local messages = redis.call('HMGET', KEYS[2], unpack(ids))
redis.call('LPUSH', KEYS[3], unpack(messages))
redis.call('ZREM', KEYS[1], unpack(ids))
redis.call('HDEL', KEYS[2], unpack(ids))
return #ids
"""

#: handoff.lua's rendering alone, on one parked entry (run after _expand.lua).
RENDER_LUA = """
-- KEYS[1] templates hash, KEYS[2] msg hash; ARGV[1] an entry id, ARGV[2] N,
-- ARGV[3] delivery tag prefix. Returns {µs for N renders, the last message}.
local payload = redis.call('HGET', KEYS[2], ARGV[1])
local template, pos = zdelay_fast_entry(KEYS[1], payload)
if not template then return redis.error_reply('ERR not an entry in the template form') end
local n, prefix = tonumber(ARGV[2]), ARGV[3]
local function clock_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local message
local started = clock_us()
for k = 1, n do
  message = zdelay_render(template, payload, pos, prefix .. k .. '"}}')
end
return {tostring(clock_us() - started), message}
"""

_BARE_KEYS = ("bare:due", "bare:msg", "bare:queue")


def run_limit(sizes: Sizes) -> dict[str, Any]:
    """The handoff and the bare Lua move, per batch size; median of the repeats."""
    results: dict[str, Any] = {"n": sizes.limit_n, "repeat": sizes.release_repeat}
    with Resources() as res:
        server = res.redis()
        client = server.client()
        res.callback(client.close)
        for batch in BATCH_SIZES:
            results[f"batch-{batch}"] = _compare(res, server.url, client, sizes, batch)
    return results


def _compare(
    res: Resources, url: str, client: redis.Redis, sizes: Sizes, batch: int
) -> dict[str, Any]:
    n = sizes.limit_n
    client.flushall()
    app = make_app(broker=f"{url}/0", store=f"{url}/0", conf={"zdelay_batch_size": batch})
    res.callback(app.close)
    companion = Companion(app)
    res.callback(companion.close)
    companion.release_due()  # connected and past handoff detection, as when running
    # The same tasks parked both ways; the companion releases either form.
    park_bulk(app, n, now_ms() - 1000)
    parked = {"handoff": {key: client.dump(key) for key in client.keys("*")}}
    render = _time_render(client, store_for(app), n, sizes.release_repeat)
    client.flushdb()
    whole_app = make_app(broker=f"{url}/0", store=f"{url}/0", conf={"zdelay_whole_messages": True})
    res.callback(whole_app.close)
    park_bulk(whole_app, n, now_ms() - 1000)
    parked["handoff_whole"] = {key: client.dump(key) for key in client.keys("*")}

    paths = ("handoff", "bare", "handoff_whole")
    runs: dict[str, list[dict[str, Any]]] = {path: [] for path in paths}
    message_bytes = 0
    for run_no in range(sizes.release_repeat):
        # The first run is handoff first: it measures the message size.
        for path in paths if run_no % 2 == 0 else paths[::-1]:
            client.flushdb()
            if path == "bare":
                runs[path].append(_time_move(client, n, batch, message_bytes))
                continue
            for key, value in parked[path].items():
                client.restore(key, 0, value)
            runs[path].append(_time_handoff(client, companion, n))
            length = _mean_length(client, DEFAULT_QUEUE)
            message_bytes = message_bytes or length
            # Only the delivery tags differ: a whole message's is chosen at park time.
            if abs(length - message_bytes) > 0.06 * message_bytes:
                raise BenchmarkError("the two forms released messages of different sizes")
    client.flushdb()

    handoff, bare, whole = (median_run(runs[path], "rate") for path in paths)
    if abs(render.pop("message_bytes") - message_bytes) > 0.05 * message_bytes:
        raise BenchmarkError("the rendered message is not the size of those the handoff pushed")
    return {
        "batch": batch,
        "message_bytes": message_bytes,
        "handoff": {**handoff, "runs": [r["rate"] for r in runs["handoff"]]},
        "bare": {**bare, "runs": [r["rate"] for r in runs["bare"]]},
        "handoff_whole": {**whole, "runs": [r["rate"] for r in runs["handoff_whole"]]},
        "ratio": round(handoff["rate"] / bare["rate"], 3),
        "whole_ratio": round(whole["rate"] / bare["rate"], 3),
        "render": render,
        # The handoff does the bare move's work and renders each message.
        "render_bound": round(
            bare["script_us_per_task"] / (bare["script_us_per_task"] + render["us_per_entry"]), 3
        ),
        "script_time_ratio": round(handoff["script_us_per_task"] / bare["script_us_per_task"], 2)
        if bare["script_us_per_task"]
        else None,
    }


def _time_handoff(client: redis.Redis, companion: Companion, n: int) -> dict[str, Any]:
    reset_stats(client)
    load = MachineLoad()
    started = time.perf_counter()
    passes, handed_off = release_all(companion, n, "handoff")
    seconds = time.perf_counter() - started
    if handed_off != n:
        raise BenchmarkError("handoff: entries took the generic path; the handoff is off")
    return _figures(client, n, seconds, load, DEFAULT_QUEUE, passes=passes)


def _time_render(client: redis.Redis, store: Store, n: int, repeat: int) -> dict[str, Any]:
    """µs per entry of handoff.lua's rendering alone, on one parked entry; median of *repeat*."""
    keys = store.keys(0)
    (entry_id,) = client.zrange(keys.due, 0, 0)
    render = client.register_script(build_source(spec("handoff"), body=RENDER_LUA))
    timings, message = [], b""
    for _ in range(repeat):
        elapsed_us, message = render(
            keys=[keys.templates, keys.msg], args=[entry_id, n, keys.tag_prefix]
        )
        timings.append(int(elapsed_us) / n)
    return {
        "us_per_entry": round(statistics.median(timings), 3),
        "runs": [round(t, 3) for t in timings],
        "message_bytes": len(message),
    }


def _time_move(client: redis.Redis, n: int, batch: int, size: int) -> dict[str, Any]:
    """Time the bare move of *n* messages of *size* bytes."""
    due, msg, queue = _BARE_KEYS
    move = client.register_script(BARE_MOVE_LUA)
    # A unique body per message, padded to the handoff's mean message size.
    due_ms = now_ms() - 1000
    with client.pipeline(transaction=False) as pipe:
        for start in range(0, n, 1000):
            ids = [f"{seq:08d}-bare-move-task-id" for seq in range(start, min(n, start + 1000))]
            pipe.zadd(due, dict.fromkeys(ids, due_ms))
            pipe.hset(msg, mapping={i: i.encode().ljust(size, b"x") for i in ids})
        pipe.execute()
    move(keys=list(_BARE_KEYS), args=[0])  # loaded, as the handoff's scripts are
    reset_stats(client)
    load = MachineLoad()
    started = time.perf_counter()
    moved = calls = 0
    while moved < n:
        calls += 1
        got = int(move(keys=list(_BARE_KEYS), args=[batch]))
        if got == 0:
            raise BenchmarkError(f"bare move: stalled at {moved}/{n}")
        moved += got
    seconds = time.perf_counter() - started
    return _figures(client, n, seconds, load, queue, passes=calls)


def _figures(
    client: redis.Redis, n: int, seconds: float, load: MachineLoad, queue: str, *, passes: int
) -> dict[str, Any]:
    machine = load.stop()
    stats = script_stats(client)
    commands = commands_per_task(client, n)
    in_queue = int(client.llen(queue))
    if in_queue != n:
        raise BenchmarkError(f"{in_queue} messages in {queue}, expected {n}")
    return {
        "n": n,
        "seconds": round(seconds, 4),
        "rate": round(n / seconds),
        "calls": passes,
        "redis_scripts": stats,
        "commands_per_task": commands,
        "script_us_per_task": round(stats["server_ms"] * 1000 / n, 2),
        "wall_us_per_task": round(seconds * 1e6 / n, 2),
        "machine": machine,
    }


def _mean_length(client: redis.Redis, queue: str) -> int:
    """Mean byte length of the messages in *queue* (a sample of up to 1,000)."""
    sample = client.lrange(queue, 0, 999)
    if not sample:
        raise BenchmarkError(f"no message in {queue} to measure")
    return round(statistics.fmean(len(m) for m in sample))
