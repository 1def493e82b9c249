"""Prometheus metrics for the companion: ``celery -A proj zdelay --metrics-port 9808``.

Needs the optional extra: ``pip install 'celery-zdelay[prometheus]'``;
``prometheus_client`` is imported only when metrics are asked for.

Gauges are read from Redis when Prometheus scrapes, with the same cheap
commands as ``zdelay status`` (``ZCARD``/``ZCOUNT``, one pipeline), for every
shard of the store, so a shard no companion releases still shows up::

    zdelay_parked_tasks{shard}           entries waiting, overdue ones included
    zdelay_overdue_tasks{shard}          entries past due, waiting or in flight
    zdelay_oldest_overdue_seconds{shard} how late the oldest of them is (0: none)
    zdelay_in_flight_tasks{shard}        entries claimed, not yet acknowledged
    zdelay_dead_tasks{shard}             dead-lettered entries
    zdelay_live_companions               companions with a fresh heartbeat
    zdelay_beat_companions               of those, the ones serving periodic schedules
    zdelay_store_up                      1 if this scrape could read the store

and those of the periodic schedules (:mod:`celery_zdelay.periodic.metrics`)::

    zdelay_periodic_next_run_timestamp_seconds{schedule}
    zdelay_periodic_last_run_timestamp_seconds{schedule}
    zdelay_periodic_last_run_lateness_seconds{schedule}
    zdelay_periodic_paused{schedule}

Counters and histograms count what *this* companion did since it started,
fed by :mod:`celery_zdelay.signals`::

    zdelay_released_total{path}                 entries released ("handoff" or "publish")
    zdelay_dead_lettered_total                  entries moved to the dead-letter set
    zdelay_release_lateness_seconds{path}       release time minus due time
    zdelay_claim_duration_seconds               duration of each claim call that took entries
    zdelay_held_total{control,reason}           entries held back by a rate limit or a pause
    zdelay_stale_total{outcome}                 entries released past their max_late, by what
                                                zdelay_on_stale did: "dead", "drop" or "run"

and the entries held back now (:mod:`celery_zdelay.control_metrics`)::

    zdelay_held_tasks{control,reason}           reason "rate_limit", "concurrency" or "pause"

There is no cancellation counter: cancellations happen in producers and in
``zdelay cancel``; the one kind a companion makes, dropping a stale task, is
``zdelay_stale_total{outcome="drop"}``.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from .. import signals
from ..control_metrics import ControlCollector
from ..errors import ConfigurationError, ZDelayError
from ..periodic.metrics import PeriodicCollector
from ..stale import ON_STALE
from ..store import Store, admin

if TYPE_CHECKING:
    from .loop import Companion

__all__ = [
    "CLAIM_BUCKETS",
    "DEFAULT_METRICS_ADDR",
    "LATENESS_BUCKETS",
    "Metrics",
    "MetricsServer",
    "serve_metrics",
]

logger = logging.getLogger(__name__)

#: Buckets of ``zdelay_release_lateness_seconds``: 1 ms to 1 min, so both the
#: millisecond lateness of a healthy companion and a backlog after an outage fit.
LATENESS_BUCKETS = (
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
#: Buckets of ``zdelay_claim_duration_seconds``: a claim is bounded to a few ms.
CLAIM_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
#: Release paths, labelled from the start so ``rate()`` has a zero to start from.
_PATHS = ("handoff", "publish")
#: What a stale release did (``zdelay_on_stale``), labelled from the start too.
_STALE_OUTCOMES = ON_STALE


def _prometheus() -> Any:
    try:
        import prometheus_client
        import prometheus_client.core  # the collector's metric families
    except ImportError as exc:
        raise ConfigurationError(
            "Metrics need the prometheus-client package: pip install 'celery-zdelay[prometheus]'."
        ) from exc
    return prometheus_client


class _StoreCollector:
    """Gauges computed from the store's set sizes each time Prometheus scrapes."""

    def __init__(self, store: Store, prometheus: Any) -> None:
        self.store = store
        self._core = prometheus.core

    def _families(self) -> dict[str, Any]:
        gauge = self._core.GaugeMetricFamily
        shard = ["shard"]
        return {
            "parked": gauge("zdelay_parked_tasks", "Entries waiting in the due set.", labels=shard),
            "overdue": gauge(
                "zdelay_overdue_tasks",
                "Entries past their due time, waiting or in flight.",
                labels=shard,
            ),
            "oldest": gauge(
                "zdelay_oldest_overdue_seconds",
                "How late the oldest overdue entry is; 0 when none is.",
                labels=shard,
            ),
            "in_flight": gauge(
                "zdelay_in_flight_tasks",
                "Entries claimed by a companion, not yet acknowledged.",
                labels=shard,
            ),
            "dead": gauge("zdelay_dead_tasks", "Dead-lettered entries.", labels=shard),
            "companions": gauge("zdelay_live_companions", "Companions whose heartbeat is fresh."),
            "beat": gauge(
                "zdelay_beat_companions",
                "Live companions that serve the periodic schedules (--beat).",
            ),
        }

    def describe(self) -> Iterator[Any]:
        yield from self._families().values()
        yield self._core.GaugeMetricFamily("zdelay_store_up", "")

    def collect(self) -> Iterator[Any]:
        up = self._core.GaugeMetricFamily(
            "zdelay_store_up", "1 when this scrape could read the store, else 0."
        )
        try:
            counted = admin.counts(self.store)
            live = [c for c in admin.companions(self.store, now_ms=counted.now_ms) if c.alive]
        except ZDelayError as exc:
            if not exc.transient:
                raise  # a damaged key or a bug, not an outage
            logger.warning("Metrics scrape could not read the store: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        families = self._families()
        for s in counted.shards:
            label = [str(s.shard)]
            families["parked"].add_metric(label, s.parked)
            families["overdue"].add_metric(label, s.overdue)
            families["oldest"].add_metric(label, (s.oldest_overdue_age_ms or 0) / 1000)
            families["in_flight"].add_metric(label, s.in_flight)
            families["dead"].add_metric(label, s.dead)
        families["companions"].add_metric([], len(live))
        families["beat"].add_metric([], sum(1 for c in live if c.beat))
        up.add_metric([], 1)
        yield from families.values()
        yield up


class Metrics:
    """The metrics of one companion process, in a registry of their own.

    The registry holds the store gauges, the release counters and
    histograms, and the standard process metrics (CPU, memory, open files).
    """

    def __init__(self, store: Store, *, registry: Any = None) -> None:
        prometheus = _prometheus()
        self.registry = registry if registry is not None else prometheus.CollectorRegistry()
        if registry is None:
            prometheus.ProcessCollector(registry=self.registry)
            prometheus.PlatformCollector(registry=self.registry)
        self.collector = _StoreCollector(store, prometheus)
        self.registry.register(self.collector)
        self.registry.register(PeriodicCollector(store, prometheus.core))
        self.registry.register(ControlCollector(store, prometheus.core))
        self.released = prometheus.Counter(
            "zdelay_released",
            "Entries this companion released to the broker.",
            ["path"],
            registry=self.registry,
        )
        self.dead_lettered = prometheus.Counter(
            "zdelay_dead_lettered",
            "Entries this companion moved to the dead-letter set.",
            registry=self.registry,
        )
        self.lateness = prometheus.Histogram(
            "zdelay_release_lateness_seconds",
            "Release time minus due time of each released entry.",
            ["path"],
            buckets=LATENESS_BUCKETS,
            registry=self.registry,
        )
        self.claim_duration = prometheus.Histogram(
            "zdelay_claim_duration_seconds",
            "Duration of each claim call that took entries.",
            buckets=CLAIM_BUCKETS,
            registry=self.registry,
        )
        self.held = prometheus.Counter(
            "zdelay_held",
            "Entries this companion held back under a rate limit or a pause.",
            ["control", "reason"],
            registry=self.registry,
        )
        self.stale = prometheus.Counter(
            "zdelay_stale",
            "Entries this companion found stale (past their max_late), by what it did.",
            ["outcome"],
            registry=self.registry,
        )
        for path in _PATHS:
            self.released.labels(path)
            self.lateness.labels(path)
        for outcome in _STALE_OUTCOMES:
            self.stale.labels(outcome)
        self._sender: Any = None

    def connect(self, sender: Any = None) -> Metrics:
        """Count what *sender* (a companion; ``None``: any) reports through the signals."""
        self._sender = sender
        signals.batch_released.connect(self._on_released, sender=sender, weak=False)
        signals.batch_claimed.connect(self._on_claimed, sender=sender, weak=False)
        signals.task_dead_lettered.connect(self._on_dead_lettered, sender=sender, weak=False)
        signals.tasks_held.connect(self._on_held, sender=sender, weak=False)
        signals.tasks_stale.connect(self._on_stale, sender=sender, weak=False)
        return self

    def close(self) -> None:
        """Stop counting; the registry keeps the values it has."""
        signals.batch_released.disconnect(self._on_released, sender=self._sender)
        signals.batch_claimed.disconnect(self._on_claimed, sender=self._sender)
        signals.task_dead_lettered.disconnect(self._on_dead_lettered, sender=self._sender)
        signals.tasks_held.disconnect(self._on_held, sender=self._sender)
        signals.tasks_stale.disconnect(self._on_stale, sender=self._sender)

    def _on_released(self, path: str, count: int, lateness_ms: list[int], **kwargs: Any) -> None:
        self.released.labels(path).inc(count)
        histogram = self.lateness.labels(path)
        for ms in lateness_ms:
            histogram.observe(max(ms, 0) / 1000)

    def _on_claimed(self, seconds: float, **kwargs: Any) -> None:
        self.claim_duration.observe(seconds)

    def _on_dead_lettered(self, **kwargs: Any) -> None:
        self.dead_lettered.inc()

    def _on_held(self, control: str, reason: str, count: int, **kwargs: Any) -> None:
        self.held.labels(control, reason).inc(count)

    def _on_stale(self, outcome: str, task_ids: list[str], **kwargs: Any) -> None:
        self.stale.labels(outcome).inc(len(task_ids))


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    """One thread per scrape, so a slow scrape never blocks the next."""

    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape on the companion's stderr."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


#: Where metrics are served unless told otherwise: loopback, as the
#: dashboard. The endpoint has no authentication and names schedules, shards
#: and queues, so listening on every interface is a choice (``--metrics-addr
#: 0.0.0.0``, e.g. in a pod scraped by its IP), not a default.
DEFAULT_METRICS_ADDR = "127.0.0.1"


class MetricsServer:
    """An HTTP server answering ``GET /metrics`` from a daemon thread."""

    def __init__(self, metrics: Metrics, *, port: int, addr: str = DEFAULT_METRICS_ADDR) -> None:
        prometheus = _prometheus()
        self.metrics = metrics
        server_class = type(
            "_Server",
            (_ThreadingWSGIServer,),
            {"address_family": socket.AF_INET6 if ":" in addr else socket.AF_INET},
        )
        try:
            self._server: WSGIServer = make_server(
                addr,
                port,
                prometheus.make_wsgi_app(metrics.registry),
                server_class,
                handler_class=_QuietHandler,
            )
        except OSError as exc:
            raise ConfigurationError(
                f"Cannot serve metrics on {addr}:{port}: {exc.strerror or exc}. "
                "Choose another --metrics-port, or 0 for a free one."
            ) from exc
        self.addr = addr
        #: The port listened on (the one picked when 0 was asked for).
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="zdelay-metrics", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.addr in ("", "0.0.0.0") else self.addr
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and stop counting."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        self.metrics.close()


def serve_metrics(
    companion: Companion, *, port: int, addr: str = DEFAULT_METRICS_ADDR
) -> MetricsServer:
    """Count what *companion* does and serve it, with the store gauges, on *port*.

    Raises:
        ConfigurationError: prometheus-client is not installed, or the port is taken.
    """
    metrics = Metrics(companion.store).connect(companion)
    try:
        server = MetricsServer(metrics, port=port, addr=addr)
    except ConfigurationError:
        metrics.close()
        raise
    logger.info("Serving Prometheus metrics on %s:%d/metrics", addr, server.port)
    return server
