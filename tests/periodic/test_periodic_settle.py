"""A periodic run released without its id is recorded once, by the companion that parked it.

A companion names the entries it releases only while it knows an
occurrence is due. An occurrence another companion parked already due
(a clocked moment edited into the past, a missed run) can go out before
the releasing companion's next pass: unnamed. Its parker then finds it
gone from the store and records the run, once (``record_runs.lua`` keeps a
run only over an older one). Real Redis, the store's own claim and ack.
"""

from __future__ import annotations

import json

import pytest
from celery import Celery

from celery_zdelay.parking import store_for
from celery_zdelay.periodic.clocked import ClockedAt
from celery_zdelay.periodic.definition import config_hash, from_beat_entry
from celery_zdelay.periodic.server import PeriodicServer, occurrence_id
from celery_zdelay.periodic.store import LATE_MS
from tests.helpers import wait_for
from tests.support.clock import redis_ms

pytestmark = pytest.mark.timeout(60)


def _server(app: Celery, companion_id: str) -> PeriodicServer:
    """A companion's periodic part that serves what is stored (this app has no beat_schedule)."""
    server = PeriodicServer(app, store_for(app), companion_id=companion_id)
    server._took_over = True
    server._last_check = float("inf")
    return server


def _tend(server: PeriodicServer) -> None:
    server._last_tend = 0.0
    server.tend()


def test_an_occurrence_released_unnamed_is_recorded_once_by_its_parker(app: Celery) -> None:
    # Given a clocked schedule whose moment passed, stored to run once from just before it
    parker = _server(app, "parker")
    at = redis_ms(parker.periodic.store.client) - 500
    definition = from_beat_entry(
        "once",
        {"task": "tests.record", "schedule": ClockedAt(at), "zdelay_one_off": True},
        known_tasks={"tests.record"},
    )
    parker.periodic.store_config(
        [definition],
        config_hash([definition]),
        writer="parker",
        force=False,
        since={"once": f"={at - 1}"},
    )
    # When the parker parks it (due at once)
    _tend(parker)
    task_id = occurrence_id("once", 1, at)
    assert parker.periodic.parked_among([task_id]) == {task_id}

    # And another companion takes it and publishes it, unnamed
    store = parker.periodic.store
    shard = store.shard_of(task_id)
    claimed = store.claim(shard, limit=10, lease_ms=30_000)
    assert [entry.task_id for entry in claimed.entries] == [task_id]
    # (in flight: not a run yet)
    wait_for(lambda: redis_ms(store.client) > at + LATE_MS, timeout=10)
    _tend(parker)
    assert parker.periodic.snapshot().runs == {}
    assert store.ack(shard, claimed.token, [task_id]) == 1

    # Then the parker's next pass records the run
    _tend(parker)
    recorded = json.loads(store.client.hget(parker.periodic.keys.runs, "once"))
    assert (recorded["ms"], recorded["id"], recorded["by"]) == (at, task_id, "parker")
    # and the releaser naming it later, or another parker finding it, records nothing more
    assert parker.periodic.record_runs({"once": json.dumps({**recorded, "by": "late"})}) == []
    other = _server(app, "other")
    _tend(other)
    assert json.loads(store.client.hget(parker.periodic.keys.runs, "once"))["by"] == "parker"
