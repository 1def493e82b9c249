"""OpenTelemetry in the test worker: spans written as JSON lines to a file.

``celery -A tests.project.worker_app`` imports this when
:data:`OTEL_FILE_ENV` names a file, so a test reads the worker's spans beside
the ones its own process recorded (the SDK's in-memory exporter).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

#: Environment variable naming the file the worker appends its spans to.
OTEL_FILE_ENV = "ZDELAY_TEST_OTEL_FILE"
#: Environment variable naming a file: the process gets a tracing backend
#: whose exporter and span processor raise at every span's end, after
#: writing the span's name to that file (so a test knows they were called).
OTEL_BROKEN_ENV = "ZDELAY_TEST_OTEL_BROKEN"
#: Environment variable naming a file: the process gets a tracing backend
#: whose exporter (behind the SDK's BatchSpanProcessor) writes the names of
#: the spans it got to that file, then never returns: a collector that hangs.
OTEL_BLOCKING_ENV = "ZDELAY_TEST_OTEL_BLOCKING"


def span_record(span: Any) -> dict[str, Any]:
    """The parts of a finished span the tests compare, as plain JSON."""
    context = span.get_span_context()
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
        "attributes": dict(span.attributes or {}),
        "links": [f"{link.context.span_id:016x}" for link in span.links],
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "service": os.environ.get("ZDELAY_TEST_OTEL_SERVICE", "producer"),
    }


def instrument_worker(path: str) -> None:
    from opentelemetry import trace
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    class FileExporter(SpanExporter):  # type: ignore[misc]
        def export(self, spans: Sequence[Any]) -> Any:
            with open(path, "a", encoding="utf-8") as out:
                for span in spans:
                    out.write(json.dumps(span_record(span)) + "\n")
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(FileExporter()))
    trace.set_tracer_provider(provider)
    CeleryInstrumentor().instrument(tracer_provider=provider)


def broken_provider(path: str) -> Any:
    """A tracer provider whose exporter and span processor both raise."""
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter

    def called(what: str) -> None:
        with open(path, "a", encoding="utf-8") as out:
            out.write(what + "\n")

    class RaisingExporter(SpanExporter):  # type: ignore[misc]
        def export(self, spans: Sequence[Any]) -> Any:
            called("export " + " ".join(s.name for s in spans))
            raise ConnectionError("the trace collector is down")

    class RaisingProcessor(SpanProcessor):  # type: ignore[misc]
        # The SDK catches an exporter's errors but not a processor's: this
        # one reaches the code that ended the span.
        def on_end(self, span: Any) -> None:
            called("end " + span.name)
            raise RuntimeError("the span processor is broken")

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(RaisingExporter()))
    provider.add_span_processor(RaisingProcessor())
    return provider


def trace_api_with(provider: Any) -> Any:
    """``opentelemetry.trace`` as :mod:`celery_zdelay.tracing` uses it, handing out *provider*.

    For ``monkeypatch.setattr(tracing, "_trace_api", ...)``: the global
    provider of a process can be set once, and the tests' is in-memory.
    """
    from opentelemetry import trace

    class WithProvider:
        use_span = staticmethod(trace.use_span)
        ProxyTracerProvider = trace.ProxyTracerProvider
        NoOpTracerProvider = trace.NoOpTracerProvider

        @staticmethod
        def get_tracer_provider() -> Any:
            return provider

    return WithProvider


def blocking_provider(path: str) -> Any:
    """A tracer provider whose exporter blocks for good, behind a BatchSpanProcessor.

    The processor exports each span at once (batches of one, no delay), so
    the exporter is blocked from the first span on and every later span
    meets a full pipeline.
    """
    import threading

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

    never = threading.Event()

    class BlockingExporter(SpanExporter):  # type: ignore[misc]
        def export(self, spans: Sequence[Any]) -> Any:
            with open(path, "a", encoding="utf-8") as out:
                out.write("export " + " ".join(s.name for s in spans) + "\n")
            never.wait()  # the collector never answers

    provider = TracerProvider()
    provider.add_span_processor(
        BatchSpanProcessor(BlockingExporter(), max_export_batch_size=1, schedule_delay_millis=1)
    )
    return provider


if os.environ.get(OTEL_BROKEN_ENV):
    from opentelemetry import trace

    trace.set_tracer_provider(broken_provider(os.environ[OTEL_BROKEN_ENV]))
elif os.environ.get(OTEL_BLOCKING_ENV):
    from opentelemetry import trace

    trace.set_tracer_provider(blocking_provider(os.environ[OTEL_BLOCKING_ENV]))
elif os.environ.get(OTEL_FILE_ENV):
    instrument_worker(os.environ[OTEL_FILE_ENV])
