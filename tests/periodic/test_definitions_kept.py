"""What a companion keeps per schedule: one spec object per spec.

At 100,000 crontab rows each companion's RSS was 540 to 582 MiB
(``python -m benchmarks.beat_rows --daily crontab``): each definition
decoded its own copy of its spec, and the planner kept every definition it
had decoded, beside the rows' reader's own. Specs are now shared by the
definitions that have them, and the planner keeps the
:data:`~celery_zdelay.periodic.store.DEFINITIONS_KEPT` read last
(``test_schedule_objects.py`` bounds both caches).
"""

from __future__ import annotations

import pytest

from celery_zdelay.periodic.definition import Definition

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
