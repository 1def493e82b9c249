"""Prometheus metrics, scraped over HTTP and checked against the real counts."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

import pytest
from celery import Celery
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from celery_zdelay.cli import EXIT_CONFIG
from celery_zdelay.companion import Companion
from celery_zdelay.companion.metrics import Metrics, MetricsServer
from celery_zdelay.config import get_config
from celery_zdelay.store import Store, admin
from celery_zdelay.store.redis_keys import periodic_keys
from celery_zdelay.testing import RedisServer, free_port
from tests.conftest import AppFactory
from tests.helpers import ROOT, CeleryProcess, wait_for
from tests.project import app_env
from tests.support.store import ids_on_shard, put_raw

pytestmark = pytest.mark.timeout(90)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    """GET *url* and return every sample: (name, labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def test_a_running_companion_serves_metrics_that_match_the_store(
    make_test_app: AppFactory, companion: Callable[..., CeleryProcess]
) -> None:
    # Given two shards, and a companion that releases shard 0 only
    app = make_test_app(conf={"zdelay_shards": 2})
    record = app.tasks["tests.record"]
    store = Store(get_config(app))
    try:
        past = datetime.now(timezone.utc) - timedelta(seconds=10)
        zero, one = ids_on_shard(store, 0, 9, "s0"), ids_on_shard(store, 1, 5, "s1")
        # ... one entry of shard 0 taken by a companion that will never ack it
        record.apply_delayed(("taken",), task_id=zero[0], eta=past)
        assert len(store.claim(0, limit=1, lease_ms=600_000).entries) == 1
        # ... five due on shard 0, three overdue on shard 1 nobody releases
        released = [record.apply_delayed((i,), task_id=zero[1 + i], countdown=0) for i in range(5)]
        for i in range(3):
            record.apply_delayed((i,), task_id=one[i], eta=past)
        # ... two parked for later on each shard, and one damaged entry on shard 0
        for task_id in (zero[6], zero[7], one[3], one[4]):
            record.apply_delayed((task_id,), task_id=task_id, countdown=3600)
        put_raw(store, zero[8], b"damaged", due_in_ms=-1000)

        # When the companion runs with --metrics-port
        port = free_port()
        process = companion(app, "--shards", "0", "--metrics-port", str(port))
        assert f"Serving Prometheus metrics on 127.0.0.1:{port}/metrics" in process.log()
        url = f"http://127.0.0.1:{port}/metrics"

        # Then its counters show what it did
        wait_for(
            lambda: _settled(scrape(url)),
            timeout=30,
            message="5 releases, 1 dead letter and a heartbeat in the metrics",
        )
        # A scrape reads the store's gauges before the counters, so the one
        # that first saw the counters settle may hold gauges read mid-release:
        # the next scrape starts after the releases and must agree throughout.
        samples = scrape(url)
        assert _settled(samples)
        counted = admin.counts(store)
    finally:
        store.close()

    assert value(samples, "zdelay_released_total", path="handoff") == len(released)
    assert value(samples, "zdelay_released_total", path="publish") == 0
    assert value(samples, "zdelay_dead_lettered_total") == 1
    assert value(samples, "zdelay_release_lateness_seconds_count", path="handoff") == 5
    lateness_sum = value(samples, "zdelay_release_lateness_seconds_sum", path="handoff")
    assert lateness_sum is not None
    assert 0 < lateness_sum < 5 * 60
    claims = value(samples, "zdelay_claim_duration_seconds_count")
    assert claims is not None
    assert claims >= 1
    # ... and its gauges are the store's counts, shard by shard
    expected = {
        "zdelay_parked_tasks": [2, 5],
        # shard 0's entry in flight is past its due time: overdue too
        "zdelay_overdue_tasks": [1, 3],
        "zdelay_in_flight_tasks": [1, 0],
        "zdelay_dead_tasks": [1, 0],
    }
    for name, per_shard in expected.items():
        assert [value(samples, name, shard=str(s)) for s in (0, 1)] == per_shard, name
    for shard in counted.shards:
        label = str(shard.shard)
        assert value(samples, "zdelay_parked_tasks", shard=label) == shard.parked
        assert value(samples, "zdelay_overdue_tasks", shard=label) == shard.overdue
        assert value(samples, "zdelay_in_flight_tasks", shard=label) == shard.in_flight
        assert value(samples, "zdelay_dead_tasks", shard=label) == shard.dead
    oldest = value(samples, "zdelay_oldest_overdue_seconds", shard="1")
    assert oldest is not None
    assert 10 <= oldest < 60
    in_flight_age = value(samples, "zdelay_oldest_overdue_seconds", shard="0")
    assert in_flight_age is not None
    assert in_flight_age > 0
    assert value(samples, "zdelay_live_companions") == 1
    assert value(samples, "zdelay_store_up") == 1
    assert value(samples, "process_cpu_seconds_total") is not None

    # When it stops, it stops serving
    assert process.terminate() == 0
    with pytest.raises(urllib.error.URLError):
        scrape(url)


def _settled(samples: Samples) -> Samples | None:
    if (
        value(samples, "zdelay_released_total", path="handoff") == 5
        and value(samples, "zdelay_dead_lettered_total") == 1
        and value(samples, "zdelay_live_companions") == 1
    ):
        return samples
    return None


def test_the_gauges_are_read_from_redis_at_each_scrape(make_test_app: AppFactory) -> None:
    with RedisServer() as server:
        app = make_test_app(
            conf={
                "zdelay_redis_url": f"{server.url}/0",
                "zdelay_retry_policy": {"max_retries": 0},
            }
        )
        store = Store(get_config(app))
        metrics = Metrics(store)
        http = MetricsServer(metrics, port=0, addr="127.0.0.1")
        try:
            assert value(scrape(http.url), "zdelay_parked_tasks", shard="0") == 0
            for i in range(3):
                app.tasks["tests.record"].apply_delayed((i,), countdown=0 if i else 600)
            samples = scrape(http.url)
            assert value(samples, "zdelay_parked_tasks", shard="0") == 3
            assert value(samples, "zdelay_overdue_tasks", shard="0") == 2
            assert value(samples, "zdelay_live_companions") == 0

            # When Redis goes away, the scrape still answers, saying so
            server.stop()
            samples = scrape(http.url)
            assert value(samples, "zdelay_store_up") == 0
            assert value(samples, "zdelay_parked_tasks", shard="0") is None
        finally:
            http.close()
            store.close()


def test_a_periodic_key_that_cannot_be_read_is_logged_not_hidden(
    app: Celery, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a periodic definitions key damaged into another type
    store.client.set(periodic_keys("zdelay").defs, "not a hash")
    metrics = Metrics(store, registry=CollectorRegistry())

    # When Prometheus scrapes
    with caplog.at_level(logging.ERROR, logger="celery_zdelay.periodic.metrics"):
        text = generate_latest(metrics.registry).decode()

    # Then the store gauges are there and the missing periodic ones are explained
    assert "zdelay_store_up 1.0" in text
    assert "zdelay_periodic_paused{" not in text
    (record,) = caplog.records
    assert "periodic schedules" in record.getMessage()
    assert record.exc_info is not None
    assert "WRONGTYPE" in str(record.exc_info[1])


def test_counters_follow_the_signals_of_their_own_companion_only(app: Celery, store: Store) -> None:
    record = app.tasks["tests.record"]
    metrics = Metrics(store)
    with Companion(app, store=store) as counted, Companion(app, store=store) as other:
        metrics.connect(counted)
        try:
            for i in range(4):
                record.apply_delayed((i,), countdown=0)
            put_raw(store, "damaged-1", b"damaged", due_in_ms=-1000)
            assert counted.release_due().released == 4
            record.apply_delayed(("other",), countdown=0)
            assert other.release_due().released == 1
        finally:
            metrics.close()
        record.apply_delayed(("after close",), countdown=0)
        assert counted.release_due().released == 1

    registry = metrics.registry
    assert registry.get_sample_value("zdelay_released_total", {"path": "handoff"}) == 4
    assert registry.get_sample_value("zdelay_dead_lettered_total") == 1
    assert (
        registry.get_sample_value("zdelay_release_lateness_seconds_count", {"path": "handoff"}) == 4
    )
    assert registry.get_sample_value("zdelay_claim_duration_seconds_count") == 1


def _companion_exit(app: Celery, *args: str, block_prometheus: bool = False) -> tuple[int, str]:
    code = (
        "import sys\n"
        + ("sys.modules['prometheus_client'] = None\n" if block_prometheus else "")
        + "from celery.bin.celery import main\n"
        + "sys.argv = ['celery', '-A', 'tests.project.worker_app', 'zdelay', *sys.argv[1:]]\n"
        + "main()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **app_env(app)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.returncode, done.stderr


def test_without_prometheus_client_the_companion_says_what_to_install(app: Celery) -> None:
    code, stderr = _companion_exit(app, "--metrics-port", "0", block_prometheus=True)

    assert code == EXIT_CONFIG
    assert "pip install 'celery-zdelay[prometheus]'" in stderr


def test_a_taken_metrics_port_is_refused_with_the_fix(app: Celery) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        code, stderr = _companion_exit(
            app, "--metrics-port", str(port), "--metrics-addr", "127.0.0.1"
        )

    assert code == EXIT_CONFIG
    assert f"Cannot serve metrics on 127.0.0.1:{port}" in stderr
    assert "Choose another --metrics-port, or 0 for a free one." in stderr


def test_the_grafana_dashboard_queries_only_metrics_that_exist(store: Store) -> None:
    dashboard = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    expressions = [
        target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])
    ]
    used = {name for expr in expressions for name in re.findall(r"\b(?:zdelay|process)_\w+", expr)}
    metrics = Metrics(store)
    http = MetricsServer(metrics, port=0, addr="127.0.0.1")
    try:
        exported = {name for name, _ in scrape(http.url)}
    finally:
        http.close()

    assert used <= exported, used - exported
    assert {
        "zdelay_parked_tasks",
        "zdelay_overdue_tasks",
        "zdelay_in_flight_tasks",
        "zdelay_dead_tasks",
        "zdelay_released_total",
        "zdelay_release_lateness_seconds_bucket",
    } <= used
