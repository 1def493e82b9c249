"""``python -m benchmarks.floor``: the least one ``apply_delayed`` can cost, beside ``apply_async``.

``apply_delayed`` promises that when it returns, the entry is parked: it
waits for the store's reply, one Redis round trip. ``apply_async`` on a Redis
broker waits for one too (kombu's ``LPUSH``); with RabbitMQ as the broker it
waits for none (py-amqp writes the ``basic.publish`` frames to the socket and
returns; no publisher confirms). So the floor of the ratio depends on the
broker. This measures, side by side on one private Redis and the machine's
RabbitMQ, each call timed alone from the client, in interleaved rounds
(the order of the paths turned round every round):

* ``PING``; ``LPUSH`` of the message ``apply_async`` puts in the Redis broker;
* ``EVALSHA`` of a no-op script (``return 1`` behind ``_guard.lua``, as every
  store script runs) carrying the keys and arguments of one real park;
* ``EVALSHA`` of ``park.lua`` itself (``Store.park`` of one entry);
* an AMQP publish of the same message through kombu's producer, as Celery's
  ``apply_async`` sends it (no confirm);
* ``apply_async(countdown=)`` and ``apply_delayed`` with RabbitMQ as the
  broker (the store on the private Redis).

The floor with RabbitMQ as the broker: even if everything celery-zdelay adds
in Python and in ``park.lua`` were free, ``apply_delayed`` would still do
Celery's own build of the message (it captures exactly what ``apply_async``
builds) and wait for a no-op script's round trip instead of handing frames to
the socket, so per round::

    floor = (apply_async - AMQP publish + no-op EVALSHA) / apply_async

(p50s of the round), and the same with ``park.lua``'s round trip in place of
the no-op's: what ``apply_delayed`` would cost if nothing but Celery's build
and the park itself were left (the work ``park.lua`` does is what the
guarantees of ``docs/guarantees.rst`` need, see ``docs/performance.rst``).
Reported: the median of each path's p50 over the rounds and of each ratio,
with the spread. Writes ``results/<timestamp>-floor.json``.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from kombu import Connection

from celery_zdelay.capture import capture
from celery_zdelay.parking import park_requests, store_for
from celery_zdelay.schedule import due_from
from celery_zdelay.store.scripts import build_source, spec

from .common import percentile, spread
from .infra import (
    RABBITMQ_URL,
    RESULTS_DIR,
    BenchmarkError,
    MachineLoad,
    Resources,
    rabbitmq_version,
    unique,
)
from .proj import make_app

#: The ratios reported, each a function of one round's p50s (µs) by path.
RATIOS: dict[str, Callable[[dict[str, float]], float]] = {
    "no-op EVALSHA / AMQP publish": lambda r: r["evalsha no-op"] / r["amqp publish"],
    "no-op EVALSHA / LPUSH": lambda r: r["evalsha no-op"] / r["lpush"],
    "park.lua / no-op EVALSHA": lambda r: r["evalsha park.lua"] / r["evalsha no-op"],
    "apply_delayed / apply_async, RabbitMQ broker": lambda r: (
        r["apply_delayed rabbitmq"] / r["apply_async rabbitmq"]
    ),
    "floor, RabbitMQ broker": lambda r: (
        (r["apply_async rabbitmq"] - r["amqp publish"] + r["evalsha no-op"])
        / r["apply_async rabbitmq"]
    ),
    "floor with park.lua, RabbitMQ broker": lambda r: (
        (r["apply_async rabbitmq"] - r["amqp publish"] + r["evalsha park.lua"])
        / r["apply_async rabbitmq"]
    ),
}


def measure(n: int, rounds: int) -> dict[str, Any]:
    """Time each path *n* calls per round over *rounds* interleaved rounds."""
    if rabbitmq_version() is None:
        raise BenchmarkError(
            f"RabbitMQ is not reachable at {RABBITMQ_URL}: the floor compares an AMQP "
            "publish with a Redis round trip. Start RabbitMQ or set ZBENCH_RABBITMQ."
        )
    with Resources() as res:
        server = res.redis()
        url = f"{server.url}/0"
        client = server.client()
        res.callback(client.close)
        queue = unique("zbench-floor")
        redis_app = make_app(broker=url, store=url)
        rabbit_app = make_app(broker=RABBITMQ_URL, store=url, queue=queue)
        res.callback(redis_app.close)
        res.callback(rabbit_app.close)
        connection = Connection(RABBITMQ_URL)
        res.callback(connection.release)
        amqp_queue = rabbit_app.amqp.queues[queue]
        amqp_queue.bind(connection.default_channel).declare()
        res.callback(lambda: amqp_queue.bind(connection.default_channel).delete())
        paths = _paths(redis_app, rabbit_app, client, connection, queue)

        seq = 0
        for call in paths.values():  # warm: connections, scripts loaded
            for _ in range(100):
                seq += 1
                call(seq)
        load = MachineLoad()
        per_round: list[dict[str, float]] = []
        p90: dict[str, list[float]] = {name: [] for name in paths}
        for round_no in range(rounds):
            names = list(paths)
            shift = round_no % len(names)
            order = names[shift:] + names[:shift]
            if round_no % 2:
                order.reverse()
            p50s = {}
            for name in order:
                call = paths[name]
                times = []
                for _ in range(n):
                    seq += 1
                    started = time.perf_counter()
                    call(seq)
                    times.append(time.perf_counter() - started)
                p50s[name] = percentile(times, 0.5) * 1e6
                p90[name].append(percentile(times, 0.9) * 1e6)
            per_round.append(p50s)
            client.flushdb()
        machine = load.stop()
    return {
        "n": n,
        "rounds": rounds,
        "p50_us": {name: spread([r[name] for r in per_round], digits=1) for name in paths},
        "p90_us": {name: round(statistics.median(v), 1) for name, v in p90.items()},
        "ratios": {name: spread([fn(r) for r in per_round]) for name, fn in RATIOS.items()},
        "machine": machine,
    }


def _paths(
    redis_app: Any, rabbit_app: Any, client: Any, connection: Connection, queue: str
) -> dict[str, Callable[[int], Any]]:
    """The calls timed, each taking a sequence number (fresh task ids and arguments)."""
    noop = redis_app.tasks["bench.noop"]
    rabbit_noop = rabbit_app.tasks["bench.noop"]
    store = store_for(redis_app)
    noop.apply_delayed((0, 0), countdown=3600)  # scripts loaded, ACL and limits asked

    # What apply_async puts in the Redis broker, and one real park request.
    noop.apply_async((0, 0), countdown=3600)
    message = client.lindex(redis_app.conf.task_default_queue, 0)
    envelope = json.loads(message)
    _, captured = capture(redis_app, lambda p: noop.apply_async((0, 0), producer=p))
    request = park_requests(redis_app, captured, due_from(3600, None))[0]
    # own.lua includes nothing: "return 1" behind _guard.lua alone.
    no_op = client.register_script(build_source(spec("own"), body="return 1"))
    keys, args = store.park_arguments(store.shard_of(request.task_id), [request])
    producer = rabbit_app.amqp.Producer(connection)

    def park(seq: int) -> Any:
        return store.park([dataclasses.replace(request, task_id=f"{seq:012d}-floor")])

    body = base64.b64decode(envelope["body"])  # kombu's Redis envelope holds it in base64
    properties = {
        k: v
        for k, v in envelope["properties"].items()
        if k in ("correlation_id", "reply_to", "delivery_mode", "priority")
    }

    def publish(seq: int) -> Any:
        return producer.publish(
            body,
            routing_key=queue,
            headers=envelope["headers"],
            content_type=envelope["content-type"],
            content_encoding=envelope["content-encoding"],
            serializer=None,
            **properties,
        )

    return {
        "ping": lambda seq: client.ping(),
        "lpush": lambda seq: client.lpush("floor:list", message),
        "evalsha no-op": lambda seq: no_op(keys=keys, args=args),
        "evalsha park.lua": park,
        "amqp publish": publish,
        "apply_async rabbitmq": lambda seq: rabbit_noop.apply_async((seq, 0), countdown=3600),
        "apply_delayed rabbitmq": lambda seq: rabbit_noop.apply_delayed((seq, 0), countdown=3600),
    }


def render(out: dict[str, Any]) -> str:
    lines = [
        f"per call, client-side p50, N={out['n']:,} calls per path and round, "
        f"{out['rounds']} interleaved rounds; load average {out['machine']['loadavg_start']} "
        f"-> {out['machine']['loadavg_end']}, {out['machine']['cpu_busy_pct']} % of the CPUs busy",
        "",
        f"{'path':<26} {'p50 µs (median)':>16} {'min-max':>16} {'p90 µs':>8}",
    ]
    for name, value in out["p50_us"].items():
        lines.append(
            f"{name:<26} {value['median']:>16.1f} "
            f"{value['min']:>7.1f}-{value['max']:<8.1f} {out['p90_us'][name]:>8.1f}"
        )
    lines += ["", f"{'ratio (median of the rounds)':<46} {'median':>7} {'min-max':>13}"]
    for name, value in out["ratios"].items():
        lines.append(
            f"{name:<46} {value['median']:>7.2f} {value['min']:>6.2f}-{value['max']:<6.2f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1000, help="calls per path and round")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (at least 5)")
    options = parser.parse_args()
    if options.rounds < 5:
        parser.error("--rounds must be at least 5: a ratio is the median of the rounds")
    out = measure(options.n, options.rounds)
    RESULTS_DIR.mkdir(exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = RESULTS_DIR / f"{stamp}-floor.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(render(out))
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
