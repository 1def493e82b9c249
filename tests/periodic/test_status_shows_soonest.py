"""``zdelay status`` costs the same with many schedules as with a few.

It lists every schedule up to :data:`STATUS_SCHEDULES`; beyond that, the
soonest to run (the visits index's head) and how many are stored and
paused, read with ``HLEN``/``SCARD``, never every definition.
"""

from __future__ import annotations

import json

import pytest
import redis
from celery import Celery

from celery_zdelay import periodic
from celery_zdelay.parking import store_for
from celery_zdelay.periodic.api import schedules_in
from celery_zdelay.periodic.store import PeriodicStore
from celery_zdelay.periodic.views import STATUS_SCHEDULES
from tests.support.cli import run
from tests.support.periodic import server_for, tend
from tests.support.store import write_heartbeat

pytestmark = pytest.mark.timeout(120)

MORE = STATUS_SCHEDULES + 10


def _schedules(count: int) -> dict[str, dict[str, object]]:
    # every-N seconds, N growing with the name: the soonest to run are the first names
    return {f"s{i:03d}": {"task": "tests.record", "schedule": float(60 + i)} for i in range(count)}


def test_status_beyond_the_bound_shows_the_soonest_and_counts_the_rest(
    app: Celery, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = server_for(app, _schedules(MORE))
    server.reconcile()
    tend(server)
    assert periodic.pause("s000", app=app)
    assert periodic.pause("s001", app=app)
    tend(server)

    # Reading every schedule is what status must not do at this size
    def read_everything(self: PeriodicStore) -> None:
        raise AssertionError("status read every schedule")

    monkeypatch.setattr(PeriodicStore, "snapshot", read_everything)

    document = json.loads(run(app, "status", "--json").stdout)
    shown = [s["name"] for s in document["periodic"]]
    # The soonest, paused ones left out (they do not run), in the order they run
    assert shown == [f"s{i:03d}" for i in range(2, 2 + STATUS_SCHEDULES)]
    assert document["periodic_stored"] == MORE

    text = run(app, "status").stdout
    assert f"the {STATUS_SCHEDULES} soonest to run of {MORE} (2 paused)" in text
    assert "zdelay periodic list shows all" in text

    # --check counts the active schedules without reading them (a live
    # companion that does not serve them: the problem names how many)
    write_heartbeat(store_for(app), "live-1", seen_ago_ms=0)
    checked = json.loads(run(app, "status", "--check", "--json").stdout)
    assert f"{MORE - 2} periodic schedules stored but no live companion serves them" in " ".join(
        checked["check"]["problems"]
    )


def test_status_within_the_bound_shows_every_schedule_paused_ones_too(
    app: Celery, redis_client: redis.Redis
) -> None:
    server = server_for(app, _schedules(3))
    server.reconcile()
    tend(server)
    assert periodic.pause("s001", app=app)

    document = json.loads(run(app, "status", "--json").stdout)
    assert {s["name"]: s["paused"] for s in document["periodic"]} == {
        "s000": False,
        "s001": True,
        "s002": False,
    }
    assert document["periodic_stored"] == 3
    assert "soonest to run" not in run(app, "status").stdout


def test_schedules_read_by_name_are_those_stored_in_the_order_asked(
    app: Celery, redis_client: redis.Redis
) -> None:
    server = server_for(app, _schedules(5))
    server.reconcile()
    tend(server)
    assert periodic.pause("s003", app=app)
    every = {info.name: info for info in periodic.schedules(app)[1]}

    _, some = schedules_in(PeriodicStore(store_for(app)), ["s004", "gone", "s003", "s000"])
    assert [info.name for info in some] == ["s004", "s003", "s000"]
    # Each as the whole read shows it (pointer, pause, counters, last run)
    for info in some:
        assert info == every[info.name]
