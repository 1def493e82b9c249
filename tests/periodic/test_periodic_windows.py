"""Start and end dates, a maximum run count and one-off schedules (issue 26 item 4).

An occurrence runs only between ``zdelay_start`` and ``zdelay_end``; with
``zdelay_max_runs`` (``zdelay_one_off``: one) at most that many occurrences
run per definition, however many companions plan them, counted in the same
script that records what was parked.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest
import redis
from celery import Celery

from celery_zdelay import ConfigurationError, periodic
from celery_zdelay.companion import Companion
from celery_zdelay.parking import store_for
from celery_zdelay.periodic.definition import from_beat_entry
from celery_zdelay.periodic.server import PeriodicServer
from tests.helpers import wait_for
from tests.support.clock import redis_ms
from tests.support.keys import SHARD0
from tests.support.periodic import occurrence_ms, tend, ticked_ids

pytestmark = pytest.mark.timeout(60)

DUE = SHARD0.due


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat()


def _servers(app: Celery, schedule: dict[str, Any], n: int = 1) -> list[PeriodicServer]:
    app.conf.beat_schedule = schedule
    servers = [PeriodicServer(app, store_for(app), companion_id=f"c{i}") for i in range(n)]
    servers[0].reconcile()
    return servers


def _ticked(client: redis.Redis, name: str) -> list[int]:
    """Every occurrence of *name* ever parked (parked, leased or released), by time."""
    return sorted(occurrence_ms(task_id) for task_id in ticked_ids(client, name))


def test_only_occurrences_between_the_start_and_end_dates_run(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given a 250 ms schedule that may run only from 1 s to 3 s from now
    now = redis_ms(redis_client)
    start, end = now + 1000, now + 3000
    (server,) = _servers(
        app,
        {
            "w": {
                "task": "tests.record",
                "schedule": 0.25,
                "zdelay_start": _iso(start),
                "zdelay_end": datetime.fromtimestamp(end / 1000, tz=timezone.utc),
            }
        },
    )
    anchor = server.periodic.snapshot().pointers["w"].ms

    # When companions plan it until after the end
    tend(server)
    wait_for(lambda: redis_ms(redis_client) > end + 300, timeout=10, interval=0.05)
    tend(server)

    # Then exactly the occurrences of the window were parked, none outside
    expected = [ms for ms in range(anchor + 250, end + 1, 250) if ms >= start]
    assert _ticked(redis_client, "w") == expected
    (info,) = periodic.schedules(app)[1]
    assert " from " in info.schedule
    assert " until " in info.schedule


@pytest.mark.parametrize(("key", "limit"), [("zdelay_max_runs", 3), ("zdelay_one_off", 1)])
def test_at_most_max_runs_occurrences_run_whatever_the_companions(
    app: Celery, redis_client: redis.Redis, key: str, limit: int
) -> None:
    # Given a 200 ms schedule limited to a few runs, served by three companions
    value: Any = limit if key == "zdelay_max_runs" else True
    servers = _servers(app, {"m": {"task": "tests.record", "schedule": 0.2, key: value}}, n=3)

    # When each plans it, again and again over a second
    for _ in range(3):
        for server in servers:
            tend(server)
    wait_for(lambda: len(_ticked(redis_client, "m")) >= limit, timeout=10)
    end = redis_ms(redis_client) + 1000
    while redis_ms(redis_client) < end:
        for server in servers:
            tend(server)

    # Then only the first occurrences up to the limit were parked, and run once
    ticked = _ticked(redis_client, "m")
    anchor = servers[0].periodic.snapshot().pointers["m"]
    assert len(ticked) == limit
    assert anchor.runs == limit
    with Companion(app) as companion:
        released = companion.release_due(advance_ms=10_000).released
    assert released == limit


def test_a_pause_gives_back_what_it_withdrew_and_a_change_starts_the_count_again(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given a schedule limited to two runs, both parked
    (server,) = _servers(
        app, {"m": {"task": "tests.record", "schedule": 0.2, "zdelay_max_runs": 2}}
    )
    tend(server)
    assert len(_ticked(redis_client, "m")) == 2

    # When it is paused before they ran (they are withdrawn) and resumed
    assert periodic.pause("m", app=app)
    assert periodic.resume("m", app=app)
    tend(server)

    # Then its two runs are parked again (the withdrawn ones did not count)
    with Companion(app) as companion:
        assert companion.release_due(advance_ms=10_000).released == 2

    # and once they ran, a pause and resume runs no more
    assert periodic.pause("m", app=app)
    assert periodic.resume("m", app=app)
    tend(server)
    assert not [i for i in redis_client.zrange(DUE, 0, -1) if i.startswith(b"periodic:m:")]

    # When its definition changes (a new version), it runs two more
    assert periodic.add("m", app=app, task="tests.record", schedule=0.2, args=[1], max_runs=2)
    tend(server)
    assert len([i for i in redis_client.zrange(DUE, 0, -1) if b":m:v" in i]) == 2


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"zdelay_start": "tomorrow"}, "zdelay_start must be a datetime or an ISO 8601"),
        (
            {"zdelay_start": "2026-07-02T00:00:00", "zdelay_end": "2026-07-01T00:00:00"},
            "zdelay_end is before zdelay_start",
        ),
        ({"zdelay_max_runs": 0}, "zdelay_max_runs must be a whole number"),
        ({"zdelay_max_runs": True}, "zdelay_max_runs must be a whole number"),
        ({"zdelay_one_off": "yes"}, "zdelay_one_off must be True or False"),
        ({"zdelay_one_off": True, "zdelay_max_runs": 2}, "keep one of them"),
    ],
)
def test_bad_dates_and_limits_are_refused_with_the_fix(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        from_beat_entry("a", {"task": "t", "schedule": 10.0, **extra}, known_tasks={"t"})
