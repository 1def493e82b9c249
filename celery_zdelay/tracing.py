"""OpenTelemetry spans for parking and releasing, when OpenTelemetry is installed.

The trace of the code that called ``apply_delayed`` continues into the
worker without anything from here: OpenTelemetry's Celery instrumentation
writes the trace context into the message headers in ``before_task_publish``,
celery-zdelay parks those headers as they are, and the worker reads them
back. What this module adds are the two steps in between, so a trace shows
where the time went:

- ``zdelay.park``, in the producer, around the store call (a child of the
  caller's current span): how many tasks, on which due time;
- ``zdelay.release``, in the companion, one per task it published (a child
  of the task's ``apply_async`` span, from the parked headers), with the
  lateness and the shard as attributes; it lasts from the task's due time
  to its release, so its length is the lateness. The atomic handoff into a Redis
  broker moves messages inside Redis without reading them, so it has no
  per-task context: it records one ``zdelay.handoff`` span per batch,
  outside the tasks' traces.

Nothing here imports OpenTelemetry unless it is installed (the ``otel``
extra), and a tracer, exporter or span processor that raises never fails
a park or a release: the park span swallows tracing errors (at its start and
its end), and the release spans are signal receivers, sent after the tasks
reached the broker, whose errors the companion logs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

from . import signals

__all__ = ["TRACER_NAME", "connect_receivers", "park_span"]

logger = logging.getLogger(__name__)

#: The instrumentation scope of celery-zdelay's spans.
TRACER_NAME = "celery_zdelay"


@functools.cache
def _trace_api() -> Any:
    """Return ``opentelemetry.trace``, or None when it is not installed (looked up once)."""
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    return trace


def _tracer(trace: Any) -> Any:
    """celery-zdelay's tracer, or None while no SDK is configured.

    Without a configured provider the API hands out no-op spans; skipping
    them keeps tracing free when it is off (the release path would otherwise
    read each message's trace context for nothing, measurable per task).
    """
    provider = trace.get_tracer_provider()
    if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None
    return provider.get_tracer(TRACER_NAME)


def connect_receivers() -> None:
    """Connect the release-span receiver (idempotent)."""
    signals.batch_released.connect(
        release_spans, weak=False, dispatch_uid="celery_zdelay.tracing.release"
    )


@contextlib.contextmanager
def park_span(task_ids: Sequence[str], due_ms: int | None = None) -> Iterator[None]:
    """Trace the park of *task_ids* as ``zdelay.park``, when OpenTelemetry is installed."""
    trace = _trace_api()
    if trace is None:
        yield
        return
    try:
        tracer = _tracer(trace)
        span = None if tracer is None else tracer.start_span("zdelay.park")
        if span is not None:
            span.set_attribute("zdelay.task_count", len(task_ids))
            if len(task_ids) == 1:
                span.set_attribute("messaging.message.id", task_ids[0])
            if due_ms is not None:
                span.set_attribute("zdelay.due_ms", due_ms)
    except Exception:  # a broken tracer never fails a park
        logger.debug("Could not start the zdelay.park span", exc_info=True)
        span = None
    if span is None:  # no SDK configured, or a broken one
        yield
        return
    try:
        with trace.use_span(span, end_on_exit=False, record_exception=True):
            yield
    finally:
        # Ended here, not by use_span: the SDK catches an exporter's errors
        # but not a span processor's, and the tasks are parked by now.
        try:
            span.end()
        except Exception:
            logger.debug("Could not end the zdelay.park span", exc_info=True)


def release_spans(
    sender: Any,
    shard: int,
    path: str,
    lateness_ms: Sequence[int],
    task_ids: Sequence[str | None] | None = None,
    headers: Sequence[dict[str, Any]] | None = None,
    **_: Any,
) -> None:
    """Record ``zdelay.release`` per published task (``zdelay.handoff`` per handed batch)."""
    trace = _trace_api()
    if trace is None:
        return
    tracer = _tracer(trace)
    if tracer is None:
        return
    end_ns = time.time_ns()
    if headers is None:
        span = tracer.start_span(
            "zdelay.handoff",
            attributes=_batch_attributes(shard, lateness_ms),
            start_time=_due_ns(end_ns, max(lateness_ms, default=0)),
        )
        span.end(end_time=end_ns)
        return
    from opentelemetry.propagate import extract

    ids = task_ids or [None] * len(headers)
    for message_headers, late_ms, task_id in zip(headers, lateness_ms, ids, strict=True):
        attributes: dict[str, Any] = {
            "zdelay.shard": shard,
            "zdelay.path": path,
            "zdelay.lateness_ms": late_ms,
        }
        if task_id is not None:
            attributes["messaging.message.id"] = task_id
        name = message_headers.get("task")
        if isinstance(name, str):
            attributes["celery.task_name"] = name
        span = tracer.start_span(
            "zdelay.release",
            context=extract(_text_headers(message_headers)),
            attributes=attributes,
            start_time=_due_ns(end_ns, late_ms),
        )
        span.end(end_time=end_ns)


def _due_ns(released_ns: int, lateness_ms: int) -> int:
    """When a task released at *released_ns*, *lateness_ms* late, was due: its span's start.

    A release span lasts from the due time to the broker's confirmation, so
    a trace shows the lateness as a bar, not only as an attribute.
    """
    return released_ns - max(0, lateness_ms) * 1_000_000


def _batch_attributes(shard: int, lateness_ms: Sequence[int]) -> dict[str, Any]:
    return {
        "zdelay.shard": shard,
        "zdelay.path": "handoff",
        "zdelay.task_count": len(lateness_ms),
        "zdelay.lateness_ms_max": max(lateness_ms, default=0),
    }


def _text_headers(headers: dict[str, Any]) -> dict[str, str]:
    # Only text values can be trace context (traceparent, tracestate, baggage).
    return {k: v for k, v in headers.items() if isinstance(k, str) and isinstance(v, str)}
