"""What monitoring costs: Celery events and OpenTelemetry spans, on and off (issue 27).

``python -m benchmarks.monitoring [--quick]`` runs on one private Redis (broker
= store, so releases take the atomic handoff) and, when it answers, RabbitMQ as
the broker (releases publish, one ``zdelay.release`` span per task), in one
process, and prints one JSON document. Four variants, switched in the same
process and interleaved (A B C D, D C B A, ...) so the machine's load falls
on all alike:

- ``bare``: celery-zdelay's monitoring taken out: the event and tracing
  receivers disconnected from the library's signals, and tracing as
  without OpenTelemetry installed. The baseline: the code as if issue 27
  had not been built (the signals are still sent, to no receiver);
- ``off``: the defaults: ``task_send_sent_event`` off, OpenTelemetry's API
  installed with no SDK configured (its no-op tracer), as most deployments
  run;
- ``events``: ``task_send_sent_event = True``: each park hands a
  ``task-sent`` event to the sender thread, which publishes it to the broker;
- ``tracing``: the OpenTelemetry SDK's ``TracerProvider`` with a
  ``BatchSpanProcessor`` whose exporter drops the spans: the SDK's work in
  the process, no network.

Measured:

- ``park`` (P5): ``noop.apply_delayed(args, countdown=3600)``, one call at a
  time, ``call_n`` calls per variant per round, each timed alone; per round
  the p50 of each variant and its ratio to ``bare``; reported, each ratio's
  median over the rounds with its spread (min-max, IQR). Also this
  process's CPU time per call (``time.process_time``, every thread: the
  event sender's publishes and the span processor's work included), which a
  loaded machine disturbs far less than wall time;
- ``release`` (P1): ``release_n`` tasks parked due now, released by an
  in-process companion (``release_due`` until none is left); the rate's
  ratio to ``bare`` per round, median and spread; and CPU time per task. Events are not sent by
  releases (the worker sends its own), so the release rows have no
  ``events`` variant.

- ``off_path``: what monitoring adds to each park and each release when it
  is off, timed alone with :mod:`timeit` (``off_n`` calls per round, the
  park's and the release's code interleaved round by round): per park the
  ``zdelay.park`` span's context manager (no SDK: no span) and the
  ``tasks_parked`` signal with the events receiver (``task_send_sent_event``
  off: it returns); per release batch the ``batch_released`` signal with the
  release-span receiver (no SDK: it returns). Each is the whole of that
  code, the signal's dispatch included, which the code without monitoring
  runs too: an upper bound of what "off" costs. Set against the park (P5,
  ``off`` variant's p50) and against the release of a batch of one task
  (the p50 of ``one_n`` such releases by the in-process companion, "off",
  measured in the same run: the smallest release, so the largest share; a
  bigger batch shares the same per-batch cost among its tasks). Wall time
  against wall time, and this process's CPU time against the park's and the
  release's CPU time (the off path is CPU work only, while a park or a
  release also waits for Redis or the broker, which a loaded machine
  stretches more). The ``share_max`` of each is the largest round's share.

P3 (lateness) is not measured here: it follows from the release rate and the
companion's wake-up, which monitoring does not touch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import timeit
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kombu import Connection

from celery_zdelay import events, signals, tracing
from celery_zdelay.companion import Companion

from .common import percentile, spread
from .infra import RABBITMQ_URL, MachineLoad, Resources, rabbitmq_version, unique
from .keys import _park, _release_rate
from .proj import make_app

PARK_VARIANTS = ("bare", "off", "events", "tracing")
RELEASE_VARIANTS = ("bare", "off", "tracing")

#: The receivers issue 27 connected, by signal: ``bare`` disconnects them.
_RECEIVERS = {
    signals.tasks_parked: "celery_zdelay.events.parked",
    signals.tasks_cancelled: "celery_zdelay.events.cancelled",
    signals.tasks_rescheduled: "celery_zdelay.events.rescheduled",
    signals.task_dead_lettered: "celery_zdelay.events.dead",
    signals.batch_released: "celery_zdelay.tracing.release",
}


class _SdkTracing:
    """``opentelemetry.trace`` as :mod:`celery_zdelay.tracing` uses it, on an SDK provider.

    The global provider can be set once per process; this one is handed to
    celery-zdelay alone, so the variants can be switched round by round.
    """

    def __init__(self) -> None:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            SpanExporter,
            SpanExportResult,
        )

        class Dropping(SpanExporter):  # type: ignore[misc]
            def export(self, spans: Sequence[Any]) -> Any:
                return SpanExportResult.SUCCESS

        self.provider = TracerProvider()
        self.provider.add_span_processor(BatchSpanProcessor(Dropping()))
        self.use_span = trace.use_span
        self.ProxyTracerProvider = trace.ProxyTracerProvider
        self.NoOpTracerProvider = trace.NoOpTracerProvider

    def get_tracer_provider(self) -> Any:
        return self.provider


@contextlib.contextmanager
def _variant(app: Any, name: str, sdk: _SdkTracing) -> Iterator[None]:
    """Switch this process to variant *name* for the block."""
    real = tracing._trace_api
    app.conf.task_send_sent_event = name == "events"
    if name == "bare":
        for signal, uid in _RECEIVERS.items():
            signal.disconnect(dispatch_uid=uid)
        tracing._trace_api = lambda: None  # type: ignore[assignment]
    elif name == "tracing":
        tracing._trace_api = lambda: sdk  # type: ignore[assignment]
    try:
        yield
    finally:
        tracing._trace_api = real  # type: ignore[assignment]
        app.conf.task_send_sent_event = False
        events.connect_receivers()  # idempotent: by their dispatch_uid
        tracing.connect_receivers()


def _order(variants: Sequence[str], round_no: int) -> list[str]:
    return list(variants) if round_no % 2 == 0 else list(reversed(variants))


def _ratios(values: dict[str, list[float]], *, higher_is_cost: bool) -> dict[str, Any]:
    """Each variant against ``bare``, round by round: >1 means it costs more."""
    out = {}
    for name, per_round in values.items():
        if name == "bare":
            continue
        out[name] = spread(
            [
                (v / b if higher_is_cost else b / v)
                for v, b in zip(per_round, values["bare"], strict=True)
            ]
        )
    return out


def _park_rounds(app: Any, sdk: _SdkTracing, n: int, rounds: int) -> dict[str, Any]:
    noop = app.tasks["bench.noop"]
    seq = iter(range(10**9))

    def timed(count: int) -> list[float]:
        times = []
        clock = time.perf_counter
        for _ in range(count):
            started = clock()
            noop.apply_delayed((next(seq), 0), countdown=3600)
            times.append(clock() - started)
        return times

    for name in PARK_VARIANTS:  # warm: connections, scripts, the sender thread
        with _variant(app, name, sdk):
            timed(200)
    load = MachineLoad()
    p50: dict[str, list[float]] = {name: [] for name in PARK_VARIANTS}
    cpu: dict[str, list[float]] = {name: [] for name in PARK_VARIANTS}
    for round_no in range(rounds):
        for name in _order(PARK_VARIANTS, round_no):
            with _variant(app, name, sdk):
                cpu_started = time.process_time()
                p50[name].append(percentile(timed(n), 0.5) * 1e6)
                if name == "events":  # the sender thread's publishes count too
                    events.flush(app)
                cpu[name].append((time.process_time() - cpu_started) / n * 1e6)
    return {
        "call_n": n,
        "rounds": rounds,
        "p50_us": {k: round(statistics.median(v), 1) for k, v in p50.items()},
        "p50_ratio_to_bare": _ratios(p50, higher_is_cost=True),
        "cpu_us_per_call": {k: round(statistics.median(v), 1) for k, v in cpu.items()},
        "cpu_ratio_to_bare": _ratios(cpu, higher_is_cost=True),
        "machine": load.stop(),
    }


def _release_rounds(
    app: Any, sdk: _SdkTracing, n: int, rounds: int, empty_broker: Callable[[], None]
) -> dict[str, Any]:
    load = MachineLoad()
    rates: dict[str, list[float]] = {name: [] for name in RELEASE_VARIANTS}
    cpu: dict[str, list[float]] = {name: [] for name in RELEASE_VARIANTS}
    for round_no in range(rounds):
        for name in _order(RELEASE_VARIANTS, round_no):
            with _variant(app, name, sdk):
                _park(app, n, countdown=0, marked=False)
                cpu_started = time.process_time()
                rates[name].append(_release_rate(app, n))
                if name == "tracing":  # the batch processor's thread counts too
                    sdk.provider.force_flush()
                cpu[name].append((time.process_time() - cpu_started) / n * 1e6)
            empty_broker()
    return {
        "n": n,
        "rounds": rounds,
        "tasks_per_s": {k: round(statistics.median(v)) for k, v in rates.items()},
        "rate_ratio_bare_to_variant": _ratios(rates, higher_is_cost=False),
        "cpu_us_per_task": {k: round(statistics.median(v), 1) for k, v in cpu.items()},
        "cpu_ratio_to_bare": _ratios(cpu, higher_is_cost=True),
        "machine": load.stop(),
    }


def _parked_message(app: Any) -> tuple[Any, int]:
    """A message as parking hands it to ``tasks_parked``, and its due time (ms)."""
    heard: list[tuple[Any, int]] = []

    def grab(sender: Any, messages: Sequence[Any], due_ms: Sequence[int], **_: Any) -> None:
        heard.append((messages[0], due_ms[0]))

    signals.tasks_parked.connect(grab, weak=False, dispatch_uid="benchmarks.monitoring.grab")
    try:
        app.tasks["bench.noop"].apply_delayed((0, 0), countdown=3600)
    finally:
        signals.tasks_parked.disconnect(dispatch_uid="benchmarks.monitoring.grab")
    return heard[0]


def _off_path_rounds(
    app: Any, sdk: _SdkTracing, n: int, rounds: int
) -> dict[str, dict[str, list[float]]]:
    """Time, alone, the code monitoring runs per park and per release batch when off.

    Per round and call: wall time and this process's CPU time (us), by clock.
    """
    message, due_ms = _parked_message(app)
    release_args = {
        "shard": 0,
        "path": "publish",
        "count": 1,
        "lateness_ms": [3],
        "task_ids": [message.task_id],
        "headers": [message.headers],
    }
    releaser = object()  # a companion's place: no receiver is bound to it

    def park() -> None:
        with tracing.park_span([message.task_id]):
            pass
        signals.tasks_parked.send(sender=app, messages=[message], due_ms=[due_ms])

    def release() -> None:
        signals.batch_released.send_robust(sender=releaser, **release_args)

    timers = {"park": timeit.Timer(park), "release_batch": timeit.Timer(release)}
    times: dict[str, dict[str, list[float]]] = {"wall": {}, "cpu": {}}
    with _variant(app, "off", sdk):
        for timer in timers.values():
            timer.timeit(n // 10)  # warm
        for round_no in range(rounds):
            for name in _order(list(timers), round_no):
                cpu_started = time.process_time()
                wall = timers[name].timeit(n)
                cpu = time.process_time() - cpu_started
                times["wall"].setdefault(name, []).append(wall / n * 1e6)
                times["cpu"].setdefault(name, []).append(cpu / n * 1e6)
    return times


def _one_task_release_us(
    app: Any, sdk: _SdkTracing, k: int, empty_broker: Callable[[], None]
) -> dict[str, float]:
    """The p50 of *k* releases of a batch of one task, "off" (us, wall and CPU): the smallest."""
    times: dict[str, list[float]] = {"wall": [], "cpu": []}
    with _variant(app, "off", sdk), Companion(app) as companion:
        for _ in range(k):
            _park(app, 1, countdown=0, marked=False)
            started, cpu_started = time.perf_counter(), time.process_time()
            released = companion.release_due().released
            times["cpu"].append(time.process_time() - cpu_started)
            times["wall"].append(time.perf_counter() - started)
            if released != 1:
                raise RuntimeError(f"released {released} tasks, not 1")
    empty_broker()
    return {clock: percentile(values, 0.5) * 1e6 for clock, values in times.items()}


def _off_path(
    times: dict[str, dict[str, list[float]]],
    n: int,
    park_us: dict[str, float],
    release_us: dict[str, dict[str, float]],
) -> dict[str, Any]:
    """The off path's time per call, and its share of a park and of a one-task release.

    Wall time against wall time, CPU time against CPU time (the off path is
    CPU work alone; a park or a release also waits for Redis and the broker,
    which a loaded machine stretches more than it stretches CPU work).
    """
    out: dict[str, Any] = {"off_n": n, "us_per_call": {}, "share_of": {}}
    for clock, by_name in times.items():
        against = {
            "park": {"park": park_us[clock]},
            "release_batch": {
                f"one-task release, {path}": us[clock] for path, us in release_us.items()
            },
        }
        for name, per_round in by_name.items():
            out["us_per_call"][f"{name}, {clock}"] = spread(per_round)
            for what, us in against[name].items():
                shares = [t / us for t in per_round]
                out["share_of"][f"{name} / {what}, {clock}"] = {
                    "us": round(us, 1),
                    "share_median": round(statistics.median(shares), 5),
                    "share_max": round(max(shares), 5),
                }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.monitoring")
    parser.add_argument("--quick", action="store_true")
    options = parser.parse_args(argv)
    call_n, release_n, rounds = (300, 2_000, 5) if options.quick else (1_000, 10_000, 7)
    off_n, one_n = (20_000, 100) if options.quick else (100_000, 300)
    sdk = _SdkTracing()
    document: dict[str, Any] = {"rounds": rounds}
    with Resources() as res:
        server = res.redis()
        url = f"{server.url}/0"
        app = make_app(broker=url, store=url)
        res.callback(app.close)
        client = server.client()
        res.callback(client.close)
        document["park_redis_broker"] = _park_rounds(app, sdk, call_n, rounds)
        off_times = _off_path_rounds(app, sdk, off_n, rounds)
        client.flushall()
        document["release_handoff"] = _release_rounds(
            app, sdk, release_n, rounds, lambda: client.delete("celery")
        )
        one_task_us = {
            "handoff": _one_task_release_us(app, sdk, one_n, lambda: client.delete("celery"))
        }
        if rabbitmq_version():
            queue = unique("zbench")
            rabbit = make_app(broker=RABBITMQ_URL, store=url, queue=queue)
            res.callback(rabbit.close)

            def on_queue(action: str) -> Callable[[], None]:
                def run() -> None:
                    with Connection(RABBITMQ_URL) as connection:
                        bound = rabbit.amqp.queues[queue].bind(connection.default_channel)
                        getattr(bound, action)()

                return run

            on_queue("declare")()
            res.callback(on_queue("delete"))
            document["release_publish_rabbitmq"] = _release_rounds(
                rabbit, sdk, release_n, rounds, on_queue("purge")
            )
            one_task_us["rabbitmq"] = _one_task_release_us(rabbit, sdk, one_n, on_queue("purge"))
        else:
            document["release_publish_rabbitmq"] = "not measured: RabbitMQ unreachable"
        document["off_path"] = _off_path(
            off_times,
            off_n,
            {
                "wall": document["park_redis_broker"]["p50_us"]["off"],
                "cpu": document["park_redis_broker"]["cpu_us_per_call"]["off"],
            },
            one_task_us,
        )
    sdk.provider.shutdown()
    json.dump(document, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
