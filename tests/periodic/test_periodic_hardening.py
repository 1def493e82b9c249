"""The periodic scripts check everything that can fail before their first
write (issue 11 item 3, for issue 13's scripts), and a change or removal of
a schedule withdraws the old version's occurrences in the same script
(issue 20 item 2)."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import pytest
import redis
from celery import Celery

from celery_zdelay import periodic
from celery_zdelay.companion import Companion
from celery_zdelay.errors import StoreRefusedError
from celery_zdelay.periodic.server import PeriodicServer, occurrence_id
from celery_zdelay.schedule import Due
from celery_zdelay.testing import RedisServer, free_port
from tests.conftest import AppFactory
from tests.helpers import wait_for
from tests.support.clock import redis_ms
from tests.support.periodic import occurrence_ms, parked_ids, server_for, tend, ticked_ids

pytestmark = pytest.mark.timeout(90)


def _everything(client: redis.Redis) -> dict[bytes, Any]:
    """Every key of the (private) Redis with its serialized value."""
    return {key: client.dump(key) for key in sorted(client.keys("*"))}


def _served(app: Celery, client: redis.Redis) -> PeriodicServer:
    """A schedule "a" every 10 s, its next occurrences parked (so its pointer lists ids)."""
    server = server_for(app, {"a": {"task": "tests.record", "schedule": 10.0}})
    assert server.reconcile() == "done"
    tend(server)
    assert parked_ids(client, "a")
    return server


# -- item 1: nothing written before a check that fails --------------------------------


def test_define_with_a_corrupt_version_fails_and_changes_nothing(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given a served schedule whose version counter was overwritten by hand
    server = _served(app, redis_client)
    redis_client.hset(server.periodic.keys.versions, "a", "not a number")
    before = _everything(redis_client)

    # When it is changed, the call fails naming the counter
    with pytest.raises(StoreRefusedError) as failure:
        periodic.add("a", app=app, task="tests.record", schedule=20)

    # Then nothing changed: no occurrence cancelled, the definition as it was
    assert _everything(redis_client) == before
    assert "not a count" in str(failure.value)


def test_define_with_a_key_of_the_wrong_type_fails_and_changes_nothing(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given a served schedule and a "superseded" key that something else wrote
    server = _served(app, redis_client)
    redis_client.set(server.periodic.keys.superseded, "not a set")
    before = _everything(redis_client)

    # When a companion with another configuration stores it, the call fails
    other = server_for(app, {"b": {"task": "tests.record", "schedule": 10.0}}, "c2")
    with pytest.raises(StoreRefusedError) as failure:
        other.reconcile(force=True)

    # Then "a" was neither removed nor its occurrences cancelled
    assert _everything(redis_client) == before
    assert "WRONGTYPE celery-zdelay key" in str(failure.value)


def test_pause_with_a_cancel_set_of_the_wrong_type_fails_and_changes_nothing(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given a served schedule whose cancel set is a string
    server = _served(app, redis_client)
    redis_client.set(server.periodic.keys.cancel, "not a set")
    before = _everything(redis_client)

    # When it is paused, the call fails
    with pytest.raises(StoreRefusedError) as failure:
        periodic.pause("a", app=app)

    # Then it is not marked paused with its occurrences still parked
    assert _everything(redis_client) == before
    assert "WRONGTYPE celery-zdelay key" in str(failure.value)
    assert not redis_client.sismember(server.periodic.keys.paused, "a")


def test_resume_with_a_corrupt_version_fails_and_changes_nothing(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given a paused schedule whose version counter was overwritten by hand
    server = _served(app, redis_client)
    assert periodic.pause("a", app=app)
    redis_client.hset(server.periodic.keys.versions, "a", "9" * 30)
    before = _everything(redis_client)

    # When it is resumed, the call fails
    with pytest.raises(StoreRefusedError) as failure:
        periodic.resume("a", app=app)

    # Then it is still paused, as it was
    assert _everything(redis_client) == before
    assert "not a count" in str(failure.value)


def test_park_once_with_an_invalid_due_time_fails_and_ticks_nothing(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given an occurrence request whose due time is not a number
    server = _served(app, redis_client)
    store = server.periodic
    (parked,) = parked_ids(redis_client, "a")
    definition = store.snapshot().definitions["a"]
    task_id = occurrence_id("a", 1, occurrence_ms(parked) + 10_000)  # the next one
    (request,) = server._requests(definition, task_id, occurrence_ms(parked))
    broken = dataclasses.replace(request, due=Due("a", "nan"))  # type: ignore[arg-type]
    before = _everything(redis_client)

    # When it is parked once, the call fails
    with pytest.raises(StoreRefusedError) as failure:
        store.park_once(broken, occurrence_ms=occurrence_ms(parked))

    # Then it is not remembered as parked: parked properly, it is parked
    assert _everything(redis_client) == before
    assert "no valid due time" in str(failure.value)
    assert store.park_once(request, occurrence_ms=occurrence_ms(parked)) is True
    assert task_id in parked_ids(redis_client, "a")


# -- issue 20 item 2: a change or removal withdraws the old version at once ---------------


@pytest.mark.parametrize("how", ["changed", "removed"])
def test_a_change_or_removal_withdraws_every_old_occurrence_and_the_new_version_runs_the_due_one(
    app: Celery, redis_client: redis.Redis, how: str
) -> None:
    # Given a 1-second schedule parked ahead, its first occurrence due but not
    # released (no companion is releasing, as in a broker outage)
    first = server_for(app, {"a": {"task": "tests.record", "schedule": 1.0}})
    first.reconcile()
    tend(first)
    old = parked_ids(redis_client, "a")
    earliest = min(occurrence_ms(i) for i in old)
    wait_for(lambda: redis_ms(redis_client) > earliest, timeout=10)

    # When the entry is changed (or removed) by a deploy
    schedule = {"a": {"task": "tests.record", "schedule": 30.0}} if how == "changed" else {}
    second = server_for(app, {**schedule, "z": {"task": "tests.record", "schedule": 60.0}}, "c2")
    assert second.reconcile() == "done"

    # Then, as soon as the change returns and before any companion's pass,
    # no occurrence of the old version is parked any more
    assert not parked_ids(redis_client, "a")

    # And the tick that was due and waiting runs once, under the new
    # version (a removed entry runs nothing more)
    tend(second)
    with Companion(app) as companion:
        companion.release_due()
    queued = redis_client.lrange("celery", 0, -1)
    assert not any(i.encode() in raw for i in old for raw in queued)
    ran = {i for i in ticked_ids(redis_client) if i.startswith("periodic:a:v2:")}
    if how == "changed":
        assert occurrence_id("a", 2, earliest) in ran
        assert sum(occurrence_id("a", 2, earliest).encode() in raw for raw in queued) == 1
    else:
        assert not ran


def test_a_companion_that_read_the_schedule_before_a_change_parks_nothing_of_the_old_version(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given a 1-second schedule nobody parked yet, its first occurrence due,
    # and a companion that read the schedules then
    server = server_for(app, {"a": {"task": "tests.record", "schedule": 1.0}})
    server.reconcile()
    start = server.periodic.snapshot().pointers["a"].ms
    wait_for(lambda: redis_ms(redis_client) > start + 1000, timeout=10)
    snap = server.periodic.snapshot()
    definition = snap.definitions["a"]

    # When the entry changes before that companion parks from what it read
    other = server_for(app, {"a": {"task": "tests.record", "schedule": 30.0}}, "c2")
    assert other.reconcile() == "done"
    assert server._tend_one(definition, snap) == 0

    # Then it parked nothing of the old version, not even the due one: each
    # park was refused in the same script that checked the version
    assert not [i for i in ticked_ids(redis_client) if ":v1:" in i]
    assert not parked_ids(redis_client, "a")


# -- a broker outage does not hold back parking ahead ----------------------------------


def test_during_a_broker_outage_a_live_companion_keeps_parking_ahead(
    make_test_app: AppFactory,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a companion serving a 1-second schedule whose broker is unreachable:
    # each release pass waits on connection retries, then backs off 8 s
    # (longer than the 5 s parked ahead)
    monkeypatch.setattr("celery_zdelay.companion.loop.BACKOFF_SECONDS", (8.0,))
    app = make_test_app(broker=f"redis://127.0.0.1:{free_port()}/0")
    app.conf.beat_schedule = {"a": {"task": "tests.record", "schedule": 1.0}}
    companion = Companion(app, beat=True)
    thread = threading.Thread(target=companion.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: bool(ticked_ids(redis_client)), timeout=20)
        # When the outage lasts through the backoff
        lags, times = [], []
        end = time.monotonic() + 9
        while time.monotonic() < end:
            newest = max(occurrence_ms(i) for i in ticked_ids(redis_client))
            lags.append(redis_ms(redis_client) - newest)
            times.append(time.monotonic())
            time.sleep(0.2)  # sampling, not synchronisation
    finally:
        companion.stop()
        thread.join(timeout=30)
    # Then an occurrence ahead of now was parked at every moment: no tick
    # falls behind while the companion waits for the broker
    assert max(lags) < 0, [(round(t, 1), lag) for t, lag in zip(times, lags, strict=True)]
