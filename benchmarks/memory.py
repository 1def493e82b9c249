"""P6/P7: worker RSS and Redis memory of N delayed tasks, parked vs native ETA.

One private Redis (broker = store, no persistence) and real solo workers
(``celery worker -P solo``); RSS is VmRSS from /proc/<pid>/status, Redis
memory is INFO memory ``used_memory``.

celery-zdelay
    A worker starts and idles (baseline RSS). N tasks are parked
    (countdown 1 h) with ``celery_zdelay.batch``. RSS is read again after the
    settle time: the worker never sees parked tasks. Redis: used_memory after
    minus before, / N; MEMORY USAGE of the due zset and the message hash split
    it up.

Native ETA
    The database is flushed and N ``apply_async(countdown=3600)`` messages are
    published with no worker running: used_memory delta / N is the cost of a
    task waiting in kombu's queue list. A second solo worker of the same
    command then starts; Celery prefetches every ETA task (it raises the
    prefetch limit for each), and kombu's Redis transport keeps each one in
    the ``unacked`` hash and ``unacked_index`` zset until it runs. When the
    hash holds all N and the list is empty, RSS and used_memory are read:
    RSS minus the first worker's idle baseline (same command, same app) is
    the worker's cost, used_memory delta / N the Redis cost of held tasks.

celery-zdelay with ``zdelay_whole_messages``
    Between the two, the database is flushed and the same N tasks are parked
    by an app with the setting on (each message stored exactly as it is
    pushed): used_memory after minus before, / N. It is the memory side of
    the setting's trade-off; the limit benchmark measures its speed.
"""

from __future__ import annotations

import time
from typing import Any

from celery_zdelay.parking import store_for

from .common import Sizes, now_ms, park_bulk
from .infra import (
    BenchmarkError,
    MachineLoad,
    Resources,
    memory_usage,
    rss_bytes,
    used_memory,
    wait_for,
)
from .proj import DEFAULT_QUEUE, make_app

MIB = 1024 * 1024


def run_memory(sizes: Sizes) -> dict[str, Any]:
    n = sizes.memory_n
    settle = sizes.settle_seconds
    with Resources() as res:
        url, app, client = res.redis_app()
        noop = app.tasks["bench.noop"]
        load = MachineLoad()

        # -- celery-zdelay: parked, the worker idles --------------------------------
        worker = res.worker(app)
        time.sleep(settle)
        rss_idle = rss_bytes(worker.pid)
        before = used_memory(client)
        park_s = park_bulk(app, n, now_ms() + 3_600_000)
        parked = used_memory(client)
        time.sleep(settle)
        rss_parked = rss_bytes(worker.pid)
        if client.llen(DEFAULT_QUEUE) or client.hlen("unacked"):
            raise BenchmarkError("the worker received parked tasks")
        keys = store_for(app).keys(0)
        due_bytes = memory_usage(client, keys.due)
        msg_bytes = memory_usage(client, keys.msg)
        payload_len = _mean_field_len(client, keys.msg)
        worker.stop()

        # -- celery-zdelay, zdelay_whole_messages: the same tasks stored whole -----
        client.flushall()
        whole_app = make_app(broker=url, store=url, conf={"zdelay_whole_messages": True})
        res.callback(whole_app.close)
        whole_before = used_memory(client)
        park_bulk(whole_app, n, now_ms() + 3_600_000)
        whole = {
            "redis_bytes_per_task": round((used_memory(client) - whole_before) / n),
            "due_zset_bytes_per_task": round(memory_usage(client, keys.due) / n),
            "msg_hash_bytes_per_task": round(memory_usage(client, keys.msg) / n),
            "mean_payload_bytes": _mean_field_len(client, keys.msg),
        }

        # -- native ETA: first in the queue list, then held by a worker ------------
        client.flushall()
        base = used_memory(client)
        started = time.perf_counter()
        with app.producer_or_acquire() as producer:
            for seq in range(n):
                noop.apply_async((seq, 0), countdown=3600, producer=producer)
        publish_s = time.perf_counter() - started
        queued = used_memory(client)
        list_bytes = memory_usage(client, DEFAULT_QUEUE)
        message_len = _mean_list_item_len(client, DEFAULT_QUEUE)

        started = time.perf_counter()
        native = res.worker(app)
        # A warm stop would restore every held task to the queue: not measured.
        res.callback(lambda: native.stop(timeout=5, kill=True))
        wait_for(
            lambda: client.hlen("unacked") >= n and client.llen(DEFAULT_QUEUE) == 0,
            timeout=120 + n / 500,
            interval=0.1,
            what=lambda: f"the worker to hold all {n} ETA tasks (holds {client.hlen('unacked')})",
        )
        ingest_s = time.perf_counter() - started
        time.sleep(settle)
        rss_native = rss_bytes(native.pid)
        held = used_memory(client)
        unacked_bytes = memory_usage(client, "unacked")
        index_bytes = memory_usage(client, "unacked_index")
        machine = load.stop()

    return {
        "n": n,
        "zdelay": {
            "worker_rss_idle_mib": round(rss_idle / MIB, 1),
            "worker_rss_mib": round(rss_parked / MIB, 1),
            "worker_rss_added_mib": round((rss_parked - rss_idle) / MIB, 2),
            "redis_bytes_per_task": round((parked - before) / n),
            "due_zset_bytes_per_task": round(due_bytes / n),
            "msg_hash_bytes_per_task": round(msg_bytes / n),
            "mean_payload_bytes": payload_len,
            "park_seconds": round(park_s, 2),
        },
        "zdelay_whole": whole,
        "native": {
            "worker_rss_mib": round(rss_native / MIB, 1),
            "worker_rss_added_mib": round((rss_native - rss_idle) / MIB, 1),
            "worker_rss_bytes_per_task": round((rss_native - rss_idle) / n),
            "queue_list_bytes_per_task": round((queued - base) / n),
            "list_key_bytes_per_task": round(list_bytes / n),
            "mean_message_bytes": message_len,
            "held_bytes_per_task": round((held - base) / n),
            "unacked_hash_bytes_per_task": round(unacked_bytes / n),
            "unacked_index_bytes_per_task": round(index_bytes / n),
            "publish_seconds": round(publish_s, 2),
            "worker_ingest_seconds": round(ingest_s, 2),
        },
        "machine": machine,
    }


def _mean_field_len(client: Any, key: str, sample: int = 200) -> int:
    _, fields = client.hscan(key, 0, count=sample)
    lengths = [len(value) for value in fields.values()]
    return round(sum(lengths) / len(lengths)) if lengths else 0


def _mean_list_item_len(client: Any, key: str, sample: int = 200) -> int:
    items = client.lrange(key, 0, sample - 1)
    return round(sum(map(len, items)) / len(items)) if items else 0
