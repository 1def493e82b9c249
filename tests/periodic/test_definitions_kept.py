"""What a companion keeps per schedule: one spec object per spec, a bounded set of definitions.

At 100,000 crontab rows a companion's RSS was about 515 MB after the rows
were stored (in process, ``--daily crontab`` rows): each definition decoded
its own copy of its spec, and the planner kept every definition it had
decoded, beside the rows' reader's own. Specs are now shared by the
definitions that have them, and the planner keeps the
:data:`~celery_zdelay.periodic.store.DEFINITIONS_KEPT` read last (246 MB
at 100,000 rows). Against a real Redis, through the planner's passes.
"""

from __future__ import annotations

import pytest
import redis
from celery import Celery

from celery_zdelay.periodic import store as store_module
from celery_zdelay.periodic.definition import Definition
from tests.support.periodic import server_for, tend, ticked_ids

pytestmark = pytest.mark.timeout(60)


def test_definitions_of_one_spec_share_one_spec_object_and_its_text() -> None:
    body = (
        '{"args":[],"kwargs":{},"missed":"once","options":{},"source":"config",'
        '"schedule":{"crontab":{"day_of_month":"*","day_of_week":"*","hour":"3",'
        '"minute":"0","month_of_year":"*"}},"task":"tests.record"}'
    )
    first = Definition.from_body("first", body)
    second = Definition.from_body("second", body.encode())

    # One spec object for both (mutant: each keeps the one it decoded)
    assert second.schedule is first.schedule
    assert second.schedule_key() is first.schedule_key()
    # and the same values as before: equal, its canonical text, its task
    assert first.schedule == {
        "crontab": {
            "day_of_month": "*",
            "day_of_week": "*",
            "hour": "3",
            "minute": "0",
            "month_of_year": "*",
        }
    }
    assert first.schedule_key() == (
        '{"crontab":{"day_of_month":"*","day_of_week":"*","hour":"3",'
        '"minute":"0","month_of_year":"*"}}'
    )
    assert (first.task, first.missed, first.source) == ("tests.record", "once", "config")
    # A definition made directly computes the same key
    made = Definition(name="made", task="tests.record", schedule=dict(first.schedule))
    assert made.schedule_key() == first.schedule_key()


def test_the_planner_keeps_a_bounded_number_of_definitions_and_decodes_the_others_again(
    app: Celery, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a planner that keeps 3 definitions, serving 8 schedules that
    # tick every 1.0 s to 1.7 s
    monkeypatch.setattr(store_module, "DEFINITIONS_KEPT", 3)
    entries = {f"every-{i}": {"task": "tests.record", "schedule": 1.0 + i / 10} for i in range(8)}
    server = server_for(app, entries)
    server.reconcile()

    # When passes go on
    for _ in range(3):
        tend(server)

    # Then no more than 3 are kept (mutant: the bound left out: 8), and
    # every schedule parked its ticks all the same
    assert len(server.periodic._decoded) <= 3
    for i in range(8):
        assert ticked_ids(redis_client, f"every-{i}"), f"every-{i} parked nothing"
