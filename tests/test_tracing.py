"""One trace from the request that parked a task to the worker that ran it.

Given OpenTelemetry's Celery instrumentation in the producer, the worker and
the companion, when a task is parked inside a request's span and later
released, then the worker's span is in the request's trace (a child of the
task's ``apply_async`` span, through the parked headers), the producer
recorded a ``zdelay.park`` span, and the companion a ``zdelay.release`` span
with the lateness and the shard (a ``zdelay.handoff`` batch span on the atomic
handoff, which does not read the messages it moves). Bulk parking and
transparent mode too. A tracer, an exporter or a span processor that raises
fails no park and no release.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from opentelemetry import trace
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import celery_zdelay
from celery_zdelay import tracing
from tests.conftest import AppFactory, RabbitMQ
from tests.helpers import ROOT, Runs, wait_for
from tests.project.otel import (
    OTEL_BLOCKING_ENV,
    OTEL_BROKEN_ENV,
    OTEL_FILE_ENV,
    broken_provider,
    span_record,
    trace_api_with,
)
from tests.support.browser import chromium, screenshot
from tests.support.trace_view import waterfall_html

pytestmark = [pytest.mark.timeout(120), pytest.mark.timing]


@pytest.fixture(scope="module")
def producer_spans() -> Iterator[InMemorySpanExporter]:
    """The test process's spans: Celery's instrumentation and celery-zdelay's."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    if trace.get_tracer_provider() is not provider:
        pytest.fail("another test set OpenTelemetry's global tracer provider in this process")
    instrumentor = CeleryInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    yield exporter
    instrumentor.uninstrument()


@pytest.fixture
def spans_file(tmp_path: Path) -> Path:
    return tmp_path / "spans.jsonl"


def _remote_spans(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def _named(spans: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [s for s in spans if s["name"] == name]


def _spans_with(path: Path, name: str) -> list[dict[str, Any]]:
    """The spans written to *path* once one called *name* is among them.

    The companion writes a span when it ends: the release span ends at the
    broker's confirm, which can come after the worker has run the task.
    """

    def found() -> list[dict[str, Any]] | None:
        spans = _remote_spans(path)
        return spans if _named(spans, name) else None

    spans = wait_for(found, timeout=30, message=f"the companion's {name} span in {path}")
    assert spans is not None
    return spans


def _run_span(path: Path, task_id: str) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        for span in _named(_remote_spans(path), "run/tests.record"):
            if span["attributes"].get("messaging.message.id") == task_id:
                return span
        return None

    span = wait_for(found, timeout=60, message=f"the worker's span of {task_id}")
    assert span is not None
    return span


PATHS = ["handoff", pytest.param("publish", marks=pytest.mark.rabbitmq)]


def _app_on(
    path: str, request: pytest.FixtureRequest, make_test_app: AppFactory
) -> tuple[Celery, tuple[str, ...]]:
    """An app releasing on *path* ("handoff" or "publish"), and its worker's queues."""
    conf: dict[str, Any] = {"zdelay_threshold": 0}
    if path == "handoff":
        return make_test_app(conf=conf), ()
    rabbitmq: RabbitMQ = request.getfixturevalue("rabbitmq")
    app = make_test_app(broker=rabbitmq.url, conf={**conf, "task_default_queue": rabbitmq.queue})
    return app, (rabbitmq.queue,)


@pytest.fixture(params=PATHS)
def traced_app(
    request: pytest.FixtureRequest,
    make_test_app: AppFactory,
    worker,
    companion,
    spans_file: Path,
    producer_spans: InMemorySpanExporter,
) -> Celery:
    """An app on the given release path, with a traced worker and companion."""
    producer_spans.clear()
    app, queues = _app_on(request.param, request, make_test_app)
    env = {OTEL_FILE_ENV: str(spans_file)}
    worker(app, *queues, env={**env, "ZDELAY_TEST_OTEL_SERVICE": "worker"})
    companion(app, env={**env, "ZDELAY_TEST_OTEL_SERVICE": "companion"})
    app._zdelay_test_path = request.param  # type: ignore[attr-defined]
    return app


def _ids(spans: list[Any], name: str) -> dict[str, dict[str, Any]]:
    """Producer spans of *name* by their task id."""
    records = [span_record(s) for s in spans if s.name == name]
    return {r["attributes"]["messaging.message.id"]: r for r in records}


def test_a_parked_task_runs_in_the_trace_of_the_request_that_parked_it(
    traced_app: Celery,
    producer_spans: InMemorySpanExporter,
    spans_file: Path,
    runs: Runs,
    tmp_path: Path,
) -> None:
    tracer = trace.get_tracer("tests")
    with tracer.start_as_current_span("request") as request_span:
        result = traced_app.tasks["tests.record"].apply_delayed((1,), countdown=0.2)
    trace_id = f"{request_span.get_span_context().trace_id:032x}"
    request_id = f"{request_span.get_span_context().span_id:016x}"

    run = _run_span(spans_file, result.id)
    sent = _ids(producer_spans.get_finished_spans(), "apply_async/tests.record")[result.id]
    # The worker continues the request's trace, under the task's publish span.
    assert run["trace_id"] == trace_id
    assert run["parent_id"] == sent["span_id"]
    assert sent["parent_id"] == request_id
    # The park is a step of the request.
    (park,) = [
        span_record(s) for s in producer_spans.get_finished_spans() if s.name == "zdelay.park"
    ]
    assert park["trace_id"] == trace_id
    assert park["parent_id"] == request_id
    assert park["attributes"]["messaging.message.id"] == result.id
    # The release is a step of the same trace, with its lateness and shard.
    publish = traced_app._zdelay_test_path == "publish"  # type: ignore[attr-defined]
    released = _spans_with(spans_file, "zdelay.release" if publish else "zdelay.handoff")
    if publish:
        (release,) = _named(released, "zdelay.release")
        assert release["trace_id"] == trace_id
        assert release["parent_id"] == sent["span_id"]
        assert release["attributes"]["messaging.message.id"] == result.id
        assert release["attributes"]["zdelay.lateness_ms"] >= 0
        assert release["attributes"]["zdelay.shard"] == 0
        # And a person sees the whole trace, producer to worker (the
        # screenshot of docs/monitoring.rst)
        local = [span_record(s) for s in producer_spans.get_finished_spans()]
        _show_trace([s for s in [*local, *released] if s["trace_id"] == trace_id], tmp_path)
    else:
        (handoff,) = _named(released, "zdelay.handoff")
        assert handoff["attributes"]["zdelay.task_count"] == 1


def _show_trace(spans: list[dict[str, Any]], tmp_path: Path) -> None:
    """Draw the trace in Chromium; check its rows; keep the screenshot for the docs."""
    names = [s["name"] for s in sorted(spans, key=lambda s: s["start_ns"])]
    # From the request, through the park and the release (from the due time
    # to the broker's confirm), to the worker
    assert names[:3] == ["request", "apply_async/tests.record", "zdelay.park"]
    assert set(names[3:]) == {"zdelay.release", "run/tests.record"}
    (release,) = [s for s in spans if s["name"] == "zdelay.release"]
    assert release["end_ns"] - release["start_ns"] == pytest.approx(
        release["attributes"]["zdelay.lateness_ms"] * 1e6, abs=1e6
    )
    page_html = waterfall_html(spans, title="A task parked by a request, released, and run")
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1200, "height": 330})
        page.set_content(page_html)
        assert page.locator("tr.span").count() == len(spans)
        assert "zdelay.release" in page.inner_text("body")
        screenshot(page, "monitoring-trace.png", tmp_path)


def test_bulk_and_transparent_parks_keep_each_task_in_its_trace(
    traced_app: Celery, producer_spans: InMemorySpanExporter, spans_file: Path
) -> None:
    record = traced_app.tasks["tests.record"]
    tracer = trace.get_tracer("tests")
    with tracer.start_as_current_span("request") as request_span:
        bulk = record.apply_delayed_many([(n,) for n in range(3)], countdown=0.2)
        transparent = record.apply_async((9,), countdown=0.2)  # zdelay_threshold = 0
    trace_id = f"{request_span.get_span_context().trace_id:032x}"
    request_id = f"{request_span.get_span_context().span_id:016x}"

    sent = _ids(producer_spans.get_finished_spans(), "apply_async/tests.record")
    for result in [*bulk, transparent]:
        run = _run_span(spans_file, result.id)
        assert run["trace_id"] == trace_id
        # Each under its own publish span, and each publish span under the
        # request: parking many does not nest one task's trace in another's.
        assert run["parent_id"] == sent[result.id]["span_id"]
        assert sent[result.id]["parent_id"] == request_id
    assert trace.get_current_span() is trace.INVALID_SPAN


def test_a_tracer_that_raises_fails_no_park(app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken:
        def get_tracer_provider(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("the tracing backend is broken")

    monkeypatch.setattr(tracing, "_trace_api", Broken)
    result = app.tasks["tests.record"].apply_delayed((1,), countdown=600)
    assert celery_zdelay.lookup(result.id, app=app) is not None


def test_an_exporter_that_raises_fails_no_park(
    app: Celery, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The SDK's own provider, its exporter and a span processor raising at
    # the span's end (the global provider is the module's in-memory one).
    called = tmp_path / "called"
    monkeypatch.setattr(tracing, "_trace_api", trace_api_with(broken_provider(str(called))))
    record = app.tasks["tests.record"]
    results = [
        record.apply_delayed((1,), countdown=600),
        *record.apply_delayed_many([(2,)], countdown=600),
    ]
    assert all(celery_zdelay.lookup(r.id, app=app) is not None for r in results)
    assert called.read_text().count("export zdelay.park") == 2


@pytest.mark.parametrize("backend", [OTEL_BROKEN_ENV, OTEL_BLOCKING_ENV])
@pytest.mark.parametrize("path", PATHS)
def test_a_tracing_backend_that_raises_or_hangs_fails_and_delays_no_release(
    path: str,
    backend: str,
    request: pytest.FixtureRequest,
    make_test_app: AppFactory,
    worker,
    companion,
    runs: Runs,
    tmp_path: Path,
) -> None:
    # Breaks if: release_spans' errors escaped the companion's release (a
    # plain signal send instead of send_robust), tracing ran before the
    # release and failed it, or the spans were exported in the companion's
    # loop (a SimpleSpanProcessor, a force_flush): a hanging exporter would
    # stop every later release.
    app, queues = _app_on(path, request, make_test_app)
    called = tmp_path / "called"
    worker(app, *queues)
    companion(app, env={backend: str(called)})
    record = app.tasks["tests.record"]
    parked = [record.apply_delayed((n,), countdown=0.5) for n in range(3)]
    runs.wait_for_ids({r.id for r in parked})
    span = "zdelay.release" if path == "publish" else "zdelay.handoff"
    # The companion did call the backend, for what it released
    wait_for(lambda: f"export {span}" in _text(called), timeout=30, message="the exporter called")
    if backend == OTEL_BROKEN_ENV:
        # The raising processor runs after the exporter, in the same span end:
        # wait for it too, the file is written by another process.
        wait_for(lambda: f"end {span}" in _text(called), timeout=30, message="the processor called")
        return
    # The exporter hangs in its first export (a BatchSpanProcessor's thread):
    # what is released from now on meets a full pipeline, and still runs.
    later = [record.apply_delayed((n,), countdown=0.5) for n in range(20)]
    runs.wait_for_ids({r.id for r in later})
    assert _text(called).count("export") == 1


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


#: A process with OpenTelemetry's API installed and no SDK configured (the
#: default) and Celery's task_send_sent_event off: the park span, the release
#: receiver and the events receiver must do no span or event work at all
#: (what benchmarks.monitoring's off_path times is this code).
_NO_SDK = """
import opentelemetry.propagate
import opentelemetry.trace


def refuse(*args, **kwargs):
    raise AssertionError("span work with no SDK configured")


opentelemetry.propagate.extract = refuse
opentelemetry.trace.ProxyTracerProvider.get_tracer = refuse
from celery_zdelay import tracing

headers = [{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}]
tracing.release_spans(
    None, shard=0, path="publish", lateness_ms=[1], task_ids=["x"], headers=headers
)
tracing.release_spans(None, shard=0, path="handoff", lateness_ms=[1])
with tracing.park_span(["x"], due_ms=1):
    pass

from celery import Celery
from celery_zdelay import events

app = Celery("off", set_as_current=False)
events.announce_parked(app, messages=[None], due_ms=[1])
events.announce_cancelled(app, task_ids=["x"])
events.announce_rescheduled(app, task_ids=["x"], due_ms=[1])
assert not hasattr(app, "_zdelay_event_sender"), "event work with task_send_sent_event off"
print("no span work")
"""


def test_with_monitoring_off_parks_and_releases_do_no_span_or_event_work() -> None:
    # Breaks if: _tracer handed out the API's no-op tracer (each published
    # task's trace context would be read for nothing: benchmarks.monitoring),
    # park_span started a span without an SDK, or an events receiver lost
    # its task_send_sent_event check (a sender thread per process, or an
    # error on the message).
    done = subprocess.run(
        [sys.executable, "-c", _NO_SDK],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "no span work"
