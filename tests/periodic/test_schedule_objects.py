"""Celery's schedule objects: one per spec, shared by every schedule of it, and bounded.

(The planner's decoded definitions are bounded the same way: the second test.)

A ``crontab`` object takes 3 to 5 KB (its expanded minute, hour, day and
month sets). The planner kept one per schedule and version, never dropped:
300 to 500 MB per companion at 100,000 crontab rows, and more with each
edit. It now keeps one per spec (every row "daily at 03:00" shares one), the
:data:`SCHEDULES_KEPT` used last. Against a real Redis, through the
planner's passes.
"""

from __future__ import annotations

import pytest
import redis
from celery import Celery
from celery.schedules import crontab

from celery_zdelay.periodic import server as server_module
from celery_zdelay.periodic import store as store_module
from tests.support.periodic import server_for, tend, ticked_ids

pytestmark = pytest.mark.timeout(60)


def test_schedules_of_one_spec_share_one_schedule_object(app: Celery) -> None:
    # Given 200 schedules every day at 03:00 and 100 every day at 04:00
    entries = {
        f"three-{i}": {"task": "tests.record", "schedule": crontab(minute=0, hour=3)}
        for i in range(200)
    } | {
        f"four-{i}": {"task": "tests.record", "schedule": crontab(minute=0, hour=4)}
        for i in range(100)
    }
    server = server_for(app, entries)
    server.reconcile()

    # When the first pass plans each one's next occurrence
    tend(server)

    # Then two schedule objects serve them all (mutant: kept per schedule
    # name and version, as before: 300)
    assert len(server._schedules) == 2


def test_the_objects_and_definitions_kept_are_bounded_and_one_dropped_is_made_again(
    app: Celery, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a planner that keeps 3 schedule objects and 3 decoded
    # definitions, serving 8 schedules of 8 specs that tick every 1.0 s to 1.7 s
    monkeypatch.setattr(server_module, "SCHEDULES_KEPT", 3)
    monkeypatch.setattr(store_module, "DEFINITIONS_KEPT", 3)
    entries = {f"every-{i}": {"task": "tests.record", "schedule": 1.0 + i / 10} for i in range(8)}
    server = server_for(app, entries)
    server.reconcile()

    # When passes go on
    for _ in range(3):
        tend(server)

    # Then no more than 3 of each are kept (mutants: either bound left out),
    # and every schedule parked its ticks all the same, each object built
    # (each definition decoded) again when its schedule was visited after
    # it was dropped
    assert len(server._schedules) <= 3
    assert len(server.periodic._decoded) <= 3
    for i in range(8):
        assert ticked_ids(redis_client, f"every-{i}"), f"every-{i} parked nothing"
