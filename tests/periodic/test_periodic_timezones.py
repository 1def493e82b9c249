"""A crontab schedule in a time zone of its own (issue 26 item 4).

``zdelay_timezone`` gives one entry a zone other than the app's: its
occurrences, DST included, are those Celery's own ``crontab`` gives in an
app whose ``timezone`` is that zone (checked against Celery's ``is_due``
across the transitions of three zones on Celery 5.7, and against the
crontab's fields on the wall clock on every Celery), and a bad zone is
refused by name. A kill test of ``periodic.occurrences``
(docs/mutation.rst): the correction older Celery needs is only run here.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import redis
from celery import VERSION as CELERY_VERSION
from celery import Celery
from celery.schedules import crontab

from celery_zdelay import ConfigurationError, periodic
from celery_zdelay.parking import store_for
from celery_zdelay.periodic.definition import from_beat_entry
from celery_zdelay.periodic.occurrences import _on_the_wall_clock, next_after
from celery_zdelay.periodic.server import PeriodicServer
from tests.support.keys import SHARD0
from tests.support.periodic import occurrence_ms

pytestmark = pytest.mark.timeout(60)

#: Celery 5.7 keeps a crontab on the wall clock across DST (its is_due is the
#: reference then); before it, Celery's own crontab moves a run by an hour
#: there, which the companion corrects (see periodic/occurrences.py).
CELERY_KEEPS_THE_WALL_CLOCK = (CELERY_VERSION.major, CELERY_VERSION.minor) >= (5, 7)

#: Zones with their DST changes in 2026 (spring forward, fall back).
ZONES = {
    "Europe/Paris": ("2026-03-29", "2026-10-25"),
    "America/New_York": ("2026-03-08", "2026-11-01"),
    "Australia/Sydney": ("2026-10-04", "2026-04-05"),
}
#: Crontabs that meet the transitions: in the skipped hour, in the repeated
#: hour, every 30 minutes overnight, and a weekly one.
CRONTABS = (
    {"minute": "30", "hour": "2"},
    {"minute": "30", "hour": "1"},
    {"minute": "*/30", "hour": "0-4"},
    {"minute": "0", "hour": "3", "day_of_week": "sun"},
)


def _ms(text: str) -> int:
    return int(datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp() * 1000)


def _app(zone: str) -> Celery:
    app = Celery(set_as_current=False)
    app.conf.timezone = zone
    return app


def _entry(fields: dict[str, str], zone: str) -> Any:
    return from_beat_entry(
        "a",
        {"task": "t", "schedule": crontab(**fields), "zdelay_timezone": zone},
        known_tasks={"t"},
    )


@pytest.mark.parametrize("zone", sorted(ZONES))
@pytest.mark.parametrize("fields", CRONTABS, ids=lambda f: " ".join(f.values()))
def test_a_zoned_crontab_runs_as_celerys_crontab_in_that_zone_across_dst(
    zone: str, fields: dict[str, str]
) -> None:
    utc_app, zone_app = _app("UTC"), _app(zone)
    zoned = _entry(fields, zone).celery_schedule(utc_app)  # the app's zone is UTC
    native = crontab(**fields, app=zone_app)  # Celery's crontab, the app in that zone
    for change in ZONES[zone]:
        at = _ms(change) - 3 * 86_400_000
        for _ in range(60):
            previous, at = at, next_after(zoned, at)
            assert at > previous
            # On its wall clock: the crontab's minute, hour and weekday, the
            # hour moved on only where the clocks skipped it
            local = datetime.fromtimestamp(at / 1000, tz=ZoneInfo(zone))
            assert local.minute in native.minute, (zone, fields, local)
            assert local.hour in native.hour or _clocks_skipped_an_hour(at, zone), (fields, local)
            assert local.isoweekday() % 7 in native.day_of_week, (zone, fields, local)
            if not CELERY_KEEPS_THE_WALL_CLOCK:
                continue
            # Celery's own is_due, in an app whose timezone is the zone, agrees:
            # not due a second before the occurrence, due at it
            last = datetime.fromtimestamp(previous / 1000, tz=timezone.utc)
            when = datetime.fromtimestamp(at / 1000, tz=timezone.utc)
            for now, due in ((when - timedelta(seconds=1), False), (when, True)):
                probe = crontab(**fields, app=zone_app, nowfun=lambda now=now: now)
                assert probe.is_due(last).is_due is due, (zone, fields, last, now)
            assert next_after(native, previous) == at
    utc_app.close()
    zone_app.close()


def _clocks_skipped_an_hour(at_ms: int, zone: str) -> bool:
    """Return whether the clocks of *zone* went forward in the hour before *at_ms*."""
    hour_before = datetime.fromtimestamp(at_ms / 1000 - 3600, tz=ZoneInfo(zone))
    return (
        hour_before.utcoffset()
        != datetime.fromtimestamp(at_ms / 1000, tz=ZoneInfo(zone)).utcoffset()
    )


@pytest.mark.parametrize(
    ("last", "celerys_answer", "meant"),
    [
        # Celery < 5.7 across the clocks going back: 02:00 CET, an hour early
        ("2026-10-24T01:00:00", "2026-10-25T01:00:00", "2026-10-25T02:00:00"),
        # and going forward: 04:00 CEST, an hour late
        ("2026-03-28T02:00:00", "2026-03-29T02:00:00", "2026-03-29T01:00:00"),
        # a right answer is kept
        ("2026-10-24T01:00:00", "2026-10-25T02:00:00", "2026-10-25T02:00:00"),
    ],
)
def test_a_crontab_run_an_older_celery_moved_across_dst_is_put_back_on_the_wall_clock(
    last: str, celerys_answer: str, meant: str
) -> None:
    # Breaks if: the correction is dropped (an older Celery's daily 03:00
    # runs at 02:00 local, early) or applied to an answer that is right.
    app = Celery(set_as_current=False)
    app.conf.timezone = "Europe/Paris"
    daily = crontab(minute=0, hour=3, app=app)
    after = datetime.fromtimestamp(_ms(last) / 1000, tz=timezone.utc).astimezone(daily.tz)
    assert _on_the_wall_clock(daily, after, _ms(celerys_answer)) == _ms(meant)
    app.close()


def test_the_zone_moves_the_tick_not_the_app() -> None:
    app = _app("UTC")
    paris = _entry({"minute": "0", "hour": "3"}, "Europe/Paris").celery_schedule(app)
    # 03:00 in Paris: 01:00Z in summer time, 02:00Z after the clocks go back
    assert next_after(paris, _ms("2026-10-23T12:00:00")) == _ms("2026-10-24T01:00:00")
    assert next_after(paris, _ms("2026-10-24T01:00:00")) == _ms("2026-10-25T02:00:00")
    app.close()


@pytest.mark.parametrize(
    ("zone", "schedule", "message"),
    [
        ("Mars/Olympus", crontab(), "does not exist: use an IANA name"),
        ("", crontab(), "must be an IANA time zone name"),
        (7, crontab(), "must be an IANA time zone name"),
        ("Europe/Paris", 60.0, "applies to crontab schedules only"),
    ],
)
def test_a_bad_zone_is_refused_with_the_fix(zone: Any, schedule: Any, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        from_beat_entry(
            "a", {"task": "t", "schedule": schedule, "zdelay_timezone": zone}, known_tasks={"t"}
        )


def test_a_companion_parks_the_tick_in_the_entrys_zone(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given an app in UTC and a daily 03:00 entry in Tokyo's time
    assert app.conf.timezone in (None, "UTC")
    app.conf.beat_schedule = {
        "tokyo": {
            "task": "tests.record",
            "schedule": crontab(minute=0, hour=3),
            "zdelay_timezone": "Asia/Tokyo",
        }
    }
    server = PeriodicServer(app, store_for(app), companion_id="c")
    server.reconcile()
    server.tend()

    # Then its next occurrence is at 03:00 in Tokyo (18:00Z): parked when
    # within the planner's lead, else written down for then; listed so
    parked = [i.decode() for i in redis_client.zrange(SHARD0.due, 0, -1)]
    (info,) = periodic.schedules(app)[1]
    assert info.next_run_ms is not None
    assert datetime.fromtimestamp(info.next_run_ms / 1000, tz=timezone.utc).hour == 18
    assert [occurrence_ms(i) for i in parked] in ([], [info.next_run_ms])
    assert info.schedule == "crontab 0 3 * * * Asia/Tokyo"


def test_periodic_add_takes_a_zone(app: Celery) -> None:
    assert periodic.add(
        "z", app=app, task="tests.record", schedule=crontab(minute=0), timezone="Europe/Paris"
    )
    (info,) = periodic.schedules(app)[1]
    assert info.schedule == "crontab 0 * * * * Europe/Paris"
    with pytest.raises(ConfigurationError, match="does not exist"):
        periodic.add("y", app=app, task="tests.record", schedule=crontab(), timezone="Nowhere/X")
