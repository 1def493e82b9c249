"""Periodic tasks while companions die: every tick once, none missing, none early.

Three companions serve 1-second schedules (plain, jittered, and with an
overlap policy) and a crontab schedule for more than a minute while one of
them at a time is SIGKILLed and restarted at random moments (at least one
stays up: with none up, ticks are missed, and ``zdelay_missed`` decides).
Then every expected occurrence id is counted.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta, timezone

import pytest
import redis
from celery import Celery

from celery_zdelay.periodic.definition import from_beat_entry
from celery_zdelay.periodic.server import occurrence_id
from celery_zdelay.store.redis_keys import periodic_keys
from tests.conftest import AppFactory, RabbitMQ
from tests.helpers import CeleryProcess, Runs
from tests.support.clock import redis_ms
from tests.support.django_beat import add_interval_row, django_run
from tests.support.django_beat import companion as django_beat_companion
from tests.support.periodic import occurrence_ms, start_beat_companion, ticks_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

#: Companions SIGKILLed during one run, at least.
MIN_KILLS = 10

SCHEDULE = {
    "second": {"task": "tests.record", "schedule": 1.0},
    "minute": {"task": "tests.record", "schedule": {"crontab": {"minute": "*"}}},
    # Jitter and overlap keep the promise too: each jittered tick runs once,
    # never before its offset; a skip policy whose runs are far shorter than
    # the period skips none.
    "jittered": {"task": "tests.record", "schedule": 1.0, "zdelay_jitter": 0.8},
    "no_overlap": {"task": "tests.record", "schedule": 1.0, "zdelay_overlap": "skip"},
}
#: The 1-second schedules: one occurrence per second after the anchor.
EVERY_SECOND = ("second", "jittered", "no_overlap")
#: Their definitions, for the jittered ticks' offsets.
DEFINITIONS = {
    name: from_beat_entry(name, SCHEDULE[name], known_tasks={"tests.record"})
    for name in EVERY_SECOND
}


def serve_with_chaos(
    start: Callable[[], CeleryProcess],
    processes: list[CeleryProcess],
    *,
    seconds: float,
    seed: int,
) -> list[CeleryProcess]:
    """Run three companions (each started by *start*) for *seconds*, killing
    and restarting them at random."""
    rng = random.Random(seed)
    companions: list[CeleryProcess | None] = [start() for _ in range(3)]
    started: list[CeleryProcess] = [c for c in companions if c is not None]
    processes.extend(started)
    kills = 0
    deadline = time.monotonic() + seconds
    # At least MIN_KILLS kills, however long restarts take on a loaded machine.
    while time.monotonic() < deadline or kills < MIN_KILLS:
        time.sleep(rng.uniform(0.5, 3.0))
        alive = [i for i, c in enumerate(companions) if c is not None]
        dead = [i for i, c in enumerate(companions) if c is None]
        if dead and (len(alive) == 1 or rng.random() < 0.5):
            slot = rng.choice(dead)
            fresh = start()
            processes.append(fresh)
            started.append(fresh)
            companions[slot] = fresh
        elif len(alive) > 1:
            slot = rng.choice(alive)
            victim = companions[slot]
            assert victim is not None
            victim.kill()  # SIGKILL: mid-pass, mid-park, anywhere
            companions[slot] = None
            kills += 1
    return started


def expected_ids(anchor_ms: int, end_ms: int) -> dict[str, set[str]]:
    """Every occurrence of SCHEDULE after *anchor_ms* and not after *end_ms*."""
    expected = {
        name: {occurrence_id(name, 1, ms) for ms in range(anchor_ms + 1000, end_ms + 1, 1000)}
        for name in EVERY_SECOND
    }
    first_minute = datetime.fromtimestamp(anchor_ms / 1000, tz=timezone.utc).replace(
        second=0, microsecond=0
    ) + timedelta(minutes=1)
    minutes = set()
    at = first_minute
    while at.timestamp() * 1000 <= end_ms:
        minutes.add(occurrence_id("minute", 1, int(at.timestamp() * 1000)))
        at += timedelta(minutes=1)
    return {**expected, "minute": minutes}


def check_ticks(runs: Runs, expected: dict[str, set[str]], *, allow_duplicates: bool) -> None:
    all_runs = runs.all()
    for name, ids in expected.items():
        ticks = ticks_of(all_runs, name)
        ran = Counter(t["id"] for t in ticks)
        missing = ids - set(ran)
        assert not missing, f"{name}: {len(missing)} ticks missing, e.g. {sorted(missing)[:3]}"
        if not allow_duplicates:
            twice = {i: c for i, c in ran.items() if c > 1}
            assert not twice, f"{name}: ticks ran more than once: {twice}"
        offset = DEFINITIONS[name].offset_ms if name in DEFINITIONS else lambda _: 0
        early = [
            t["id"] for t in ticks if t["redis_ms"] < (at := occurrence_ms(t["id"])) + offset(at)
        ]
        assert not early, f"{name}: ticks ran early: {early[:3]}"
        # Nothing ran that is not an occurrence of the schedule.
        stray = set(ran) - ids
        assert all(occurrence_ms(i) > max(occurrence_ms(j) for j in ids) for i in stray), stray


def run_chaos(
    app: Celery,
    processes: list[CeleryProcess],
    runs: Runs,
    client: redis.Redis,
    seconds: float,
    *,
    start: Callable[[], CeleryProcess] | None = None,
    names: Iterable[str] = SCHEDULE,
) -> dict[str, set[str]]:
    """Serve *names* of SCHEDULE through the chaos; return the ids expected, once run."""
    before_ms = redis_ms(client)
    serve_with_chaos(
        start or (lambda: start_beat_companion(app, SCHEDULE)),
        processes,
        seconds=seconds,
        seed=int(time.time()),
    )
    end_ms = redis_ms(client)
    # Counted from the schedule, not from what ran: its anchor is when the
    # first companion stored it (a tick missing at the start must fail).
    anchor_ms = int(client.hget(periodic_keys("zdelay").meta, "written_ms") or 0)
    assert before_ms <= anchor_ms <= before_ms + 60_000
    expected = {name: ids for name, ids in expected_ids(anchor_ms, end_ms).items() if name in names}
    assert len(expected["second"]) >= seconds - 5
    assert expected["minute"], "the run crossed no minute boundary"
    runs.wait_for_ids(set().union(*expected.values()), stall_timeout=60)
    return expected


def test_three_companions_killed_at_random_run_every_tick_exactly_once_on_redis(
    app: Celery, worker, processes: list[CeleryProcess], runs: Runs, redis_client: redis.Redis
) -> None:
    # Given a worker on a Redis broker (the companions hand off atomically)
    worker(app)
    # When three companions serve the schedules for 70 s while being killed
    expected = run_chaos(app, processes, runs, redis_client, seconds=70)
    # Then every tick ran exactly once, none missing, none early
    check_ticks(runs, expected, allow_duplicates=False)


@pytest.mark.rabbitmq
def test_on_rabbitmq_no_tick_is_missing_and_the_guard_drops_duplicates(
    make_test_app: AppFactory,
    rabbitmq: RabbitMQ,
    worker,
    processes: list[CeleryProcess],
    runs: Runs,
    redis_client: redis.Redis,
) -> None:
    # Given a RabbitMQ broker and the worker guard on
    app = make_test_app(
        broker=rabbitmq.url,
        conf={
            "task_default_queue": rabbitmq.queue,
            "zdelay_worker_dedupe": True,
            "zdelay_lease_seconds": 3,
        },
    )
    worker(app, rabbitmq.queue)
    expected = run_chaos(app, processes, runs, redis_client, seconds=65)
    # Then none is missing and the guard let no duplicate run
    check_ticks(runs, expected, allow_duplicates=False)


@pytest.mark.parametrize("database", ["postgres"], indirect=True)
def test_django_celery_beat_rows_run_every_tick_exactly_once_through_the_kills(
    make_test_app: AppFactory,
    database: str,
    worker,
    processes: list[CeleryProcess],
    runs: Runs,
    redis_client: redis.Redis,
) -> None:
    # Given the same two schedules as django-celery-beat rows in PostgreSQL
    add_interval_row(database, "second", 1, [], task="tests.record")
    django_run(
        database,
        """
        from django_celery_beat.models import CrontabSchedule, PeriodicTask
        every_minute = CrontabSchedule.objects.create(minute="*", timezone="UTC")
        PeriodicTask.objects.create(name="minute", crontab=every_minute, task="tests.record")
        """,
    )
    app = make_test_app(conf={"zdelay_beat": True})
    worker(app)
    # When three companions told -S django serve them for 70 s while being killed
    expected = run_chaos(
        app,
        processes,
        runs,
        redis_client,
        seconds=70,
        start=lambda: django_beat_companion(app, [], database, "--beat", "-S", "django"),
        names=("second", "minute"),
    )
    # Then every tick ran exactly once, none missing, none early
    check_ticks(runs, expected, allow_duplicates=False)
