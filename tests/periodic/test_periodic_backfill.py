"""Tick counters and ``periodic backfill``: what was missed is seen, and can be run once.

Issue 26 item 5: per schedule, the last run (time, task id, lateness) and
counters of missed, skipped-by-overlap and late ticks, in ``periodic list``,
the metrics and the dashboard; ``zdelay periodic backfill NAME --since``
runs the missed occurrences of a window now, once each, under their own
occurrence ids. Real Redis, a real companion and a real worker.
"""

from __future__ import annotations

import re
from collections import Counter
from datetime import datetime, timezone
from typing import Any

import pytest
from celery import Celery

from celery_zdelay import ConfigurationError, periodic
from celery_zdelay.parking import store_for
from celery_zdelay.periodic.definition import config_hash, from_beat_entry
from celery_zdelay.periodic.server import PeriodicServer, occurrence_id
from tests.helpers import CeleryProcess, Runs
from tests.support.cli import run
from tests.support.clock import redis_ms
from tests.support.periodic import occurrence_ms

pytestmark = pytest.mark.timeout(240)

ENTRY = {"task": "tests.record", "schedule": 1.0, "zdelay_missed": "skip"}
#: How long before now the schedule went unserved (a takeover from celery beat).
GAP_MS = 40_000


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat()


def _server(app: Celery, companion_id: str) -> PeriodicServer:
    """A companion's periodic part that serves what is stored (this app has no beat_schedule)."""
    server = PeriodicServer(app, store_for(app), companion_id=companion_id)
    server._took_over = True
    server._last_tend = 0.0
    server._last_check = float("inf")  # no reconcile from this app's (empty) beat_schedule
    return server


def _store_after_a_gap(app: Celery) -> tuple[PeriodicServer, int]:
    """Store the schedule as last run GAP_MS ago (a takeover); return a server and now."""
    definition = from_beat_entry("poll", ENTRY, known_tasks=set(app.tasks.keys()))
    server = _server(app, "t")
    now = redis_ms(server.periodic.store.client)
    server.periodic.store_config(
        [definition],
        config_hash([definition]),
        writer="t",
        force=False,
        since={"poll": now - GAP_MS},
    )
    server._config_hash = config_hash([definition])
    return server, now


def _serve_after_a_gap(app: Celery) -> tuple[PeriodicServer, int]:
    """As _store_after_a_gap, then plan once."""
    server, now = _store_after_a_gap(app)
    server.tend()
    return server, now


def _missed_count(app: Celery) -> int:
    return next(i.counts["missed"] for i in periodic.schedules(app)[1] if i.name == "poll")


def test_missed_ticks_are_counted_once_and_shown_in_list_and_metrics(app: Celery) -> None:
    # Given a schedule that nobody served for 40 s (zdelay_missed skip), and
    # two companions that read it at the same moment
    server, _ = _store_after_a_gap(app)
    other = _server(app, "t2")
    snap = other.periodic.snapshot()

    # When the first plans past the gap
    server.tend()
    missed = _missed_count(app)
    # Then each occurrence of the gap is counted missed
    assert GAP_MS // 1000 - 2 <= missed <= GAP_MS // 1000 + 1

    # When the second plans the same gap from what it read before
    other._tend_one(snap.definitions["poll"], snap)

    # Then nothing is counted twice
    assert _missed_count(app) == missed
    # and list, the JSON and the metrics show the counters
    listed = run(app, "periodic", "list").stdout
    assert f"missed {missed}  skipped by overlap 0  late 0" in listed
    document = run(app, "periodic", "list", "--json").stdout
    assert f'"missed": {missed}' in document
    from prometheus_client import generate_latest

    from celery_zdelay.companion.metrics import Metrics

    scraped = generate_latest(Metrics(store_for(app)).registry).decode()
    assert f'zdelay_periodic_ticks_total{{outcome="missed",schedule="poll"}} {missed}.0' in (
        scraped
    )


def test_backfill_runs_each_missed_occurrence_of_the_window_once(
    app: Celery, worker: Any, companion: Any, processes: list[CeleryProcess], runs: Runs
) -> None:
    # Given a schedule nobody served for 40 s, a worker and a companion releasing
    server, now = _serve_after_a_gap(app)
    version = server.periodic.snapshot().pointers["poll"].version
    worker(app)
    companion(app)
    since, until = now - 30_000, now - 20_000

    # When the window's missed occurrences are backfilled from the command line
    out = run(app, "periodic", "backfill", "poll", "--since", _iso(since), "--until", _iso(until))

    # Then each occurrence of the window is sent under its own occurrence id
    assert out.exit_code == 0, out.output
    sent = re.findall(r"^sent (\S+)$", out.stdout, re.MULTILINE)
    assert 9 <= len(sent) <= 11, out.stdout
    assert f"backfilled {len(sent)} missed occurrences of poll" in out.stdout
    for task_id in sent:
        assert since <= occurrence_ms(task_id) <= until
        assert task_id == occurrence_id("poll", version, occurrence_ms(task_id))
    runs.wait_for_ids(set(sent))

    # When the same window is backfilled again, and a wider one
    assert periodic.backfill("poll", app=app, since=_iso(since), until=_iso(until)) == []
    wider = periodic.backfill("poll", app=app, since=_iso(since - 5_000), until=_iso(until))

    # Then only what was not run yet runs, and every occurrence ran once
    assert 4 <= len(wider) <= 6
    assert not set(wider) & set(sent)
    runs.wait_for_ids(set(wider))
    ran = Counter(runs.ids())
    assert all(ran[task_id] == 1 for task_id in [*sent, *wider])


def test_backfill_refuses_an_unknown_schedule_and_a_bad_window(app: Celery) -> None:
    _serve_after_a_gap(app)
    out = run(app, "periodic", "backfill", "nope", "--since", "2026-01-01T00:00:00Z")
    assert out.exit_code == 3
    assert "No periodic schedule is named 'nope'" in out.stderr
    with pytest.raises(ConfigurationError, match="since must be a datetime or an ISO 8601"):
        periodic.backfill("poll", app=app, since="yesterday")
    with pytest.raises(ConfigurationError, match="before until"):
        periodic.backfill("poll", app=app, since="2026-01-02T00:00:00Z", until="2026-01-01")
