"""Cancel, reschedule and look up parked tasks by the id the caller holds, or by filter.

Given a chain or a group parked with ``apply_delayed``, when the caller
cancels or reschedules the id of the result it got, then the whole parked
canvas is cancelled or moved. Given parked, in-flight and dead-lettered
entries, ``lookup`` tells them apart. Given many parked tasks, bulk cancel
and reschedule act on exactly those that match, and a dry run only counts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import celery
import pytest
import redis
from celery import Celery, chain, group

import celery_zdelay
from celery_zdelay.companion import Companion
from celery_zdelay.errors import ConfigurationError
from celery_zdelay.parking import store_for
from celery_zdelay.store.dead_reason import DeadReason
from tests.support.keys import SHARD0

pytestmark = pytest.mark.timeout(60)

DUE = SHARD0.due
HOUR_MS = 3_600_000


def _release_within_the_hour(app: Celery) -> int:
    with Companion(app) as companion:
        return companion.release_due(advance_ms=HOUR_MS + 60_000).released


def _due_ms(client: redis.Redis, task_id: str) -> int | None:
    score = client.zscore(DUE, task_id)
    return None if score is None else int(score) // 1024


@pytest.fixture
def current(app: Celery) -> Iterator[Celery]:
    """*app* as Celery's current app, restored afterwards."""
    previous = celery.current_app._get_current_object()
    app.set_current()
    yield app
    previous.set_current()


# -- canvases, by the id the caller holds -------------------------------------------


def test_cancelling_a_chain_by_its_result_id_cancels_the_parked_chain(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Regression: cancel(result.id) returned False (only r.parent.id was
    # parked), and a False reads as "already released", so the chain ran.
    record = app.tasks["tests.record"]
    result = celery_zdelay.apply_delayed(
        chain(record.si("a"), record.si("b"), record.si("c")), countdown=600, app=app
    )

    assert celery_zdelay.cancel(result.id, app=app) is True
    assert celery_zdelay.cancel(result.id, app=app) is False
    assert redis_client.zcard(DUE) == 0
    assert _release_within_the_hour(app) == 0
    assert redis_client.llen("celery") == 0


def test_cancelling_a_group_by_its_id_cancels_every_member(
    app: Celery, redis_client: redis.Redis
) -> None:
    add = app.tasks["tests.add"]
    result = celery_zdelay.apply_delayed(
        group(add.s(i, i) for i in range(4)), countdown=600, app=app
    )
    assert redis_client.zcard(DUE) == 4

    assert celery_zdelay.cancel(result.id, app=app) is True

    assert redis_client.zcard(DUE) == 0
    assert _release_within_the_hour(app) == 0


def test_rescheduling_a_chain_by_its_result_id_moves_its_first_task(
    app: Celery, redis_client: redis.Redis
) -> None:
    record = app.tasks["tests.record"]
    result = celery_zdelay.apply_delayed(
        chain(record.si("a"), record.si("b")), countdown=600, app=app
    )
    eta = datetime.now(timezone.utc) + timedelta(hours=5)

    assert celery_zdelay.reschedule(result.id, eta=eta, app=app) is True

    assert _due_ms(redis_client, result.parent.id) == -(-int(eta.timestamp() * 1e6) // 1000)


def test_cancel_and_reschedule_default_to_celerys_current_app(
    current: Celery, redis_client: redis.Redis
) -> None:
    record = current.tasks["tests.record"]
    first = record.apply_delayed(("a",), countdown=600)
    second = record.apply_delayed(("b",), countdown=600)

    assert celery_zdelay.reschedule(first.id, countdown=7200) is True
    assert celery_zdelay.cancel(second.id) is True
    assert celery_zdelay.lookup(first.id) is not None
    assert redis_client.zcard(DUE) == 1


# -- lookup -----------------------------------------------------------------------


def test_lookup_tells_parked_in_flight_and_dead_apart(app: Celery) -> None:
    record = app.tasks["tests.record"]
    eta = datetime.now(timezone.utc) + timedelta(minutes=30)
    waiting = record.apply_delayed(("w",), eta=eta, queue="orders")
    claimed = record.apply_delayed(("c",), countdown=0)
    doomed = record.apply_delayed(("d",), countdown=0)
    store = store_for(app)
    claim = store.claim(0, limit=10, lease_ms=60_000)
    assert sorted(e.task_id for e in claim.entries) == sorted([claimed.id, doomed.id])
    store.dead_letter(
        0,
        claim.token,
        [
            (
                doomed.id,
                DeadReason("a reason of 60 characters, not cut" * 2, due_ms=1, companion="test"),
            )
        ],
    )

    parked = celery_zdelay.lookup(waiting.id, app=app)
    in_flight = celery_zdelay.lookup(claimed.id, app=app)
    dead = celery_zdelay.lookup(doomed.id, app=app)

    assert parked is not None
    assert parked.state == "parked"
    assert parked.task == "tests.record"
    assert parked.queue == "orders"
    assert parked.due is not None
    assert abs(parked.due - eta) < timedelta(milliseconds=2)
    assert in_flight is not None
    assert in_flight.state == "in_flight"
    assert dead is not None
    assert dead.state == "dead"
    assert dead.reason == "a reason of 60 characters, not cut" * 2
    assert celery_zdelay.lookup("no-such-id", app=app) is None


def test_lookup_of_a_chain_result_id_describes_its_parked_first_task(app: Celery) -> None:
    record = app.tasks["tests.record"]
    result = celery_zdelay.apply_delayed(
        chain(record.si("a"), record.si("b")), countdown=600, app=app
    )

    found = celery_zdelay.lookup(result.id, app=app)

    assert found is not None
    assert (found.task_id, found.state) == (result.parent.id, "parked")


# -- bulk, by filter ---------------------------------------------------------------


def test_bulk_cancel_acts_on_exactly_the_matching_tasks(
    app: Celery, redis_client: redis.Redis
) -> None:
    record, add = app.tasks["tests.record"], app.tasks["tests.add"]
    soon = [record.apply_delayed((i,), countdown=600) for i in range(3)]
    late = [record.apply_delayed((i,), countdown=7200) for i in range(2)]
    other = [add.apply_delayed((i, i), countdown=600) for i in range(2)]

    would = celery_zdelay.cancel_matching(
        task="tests.rec*", due_before=timedelta(hours=1), dry_run=True, app=app
    )
    assert would == 3
    assert redis_client.zcard(DUE) == 7

    cancelled = celery_zdelay.cancel_matching(
        task="tests.rec*", due_before=timedelta(hours=1), app=app
    )

    assert cancelled == 3
    left = {m.decode() for m in redis_client.zrange(DUE, 0, -1)}
    assert left == {r.id for r in late + other}
    assert not left & {r.id for r in soon}


def test_bulk_reschedule_by_queue_moves_each_match_once(
    app: Celery, redis_client: redis.Redis
) -> None:
    record = app.tasks["tests.record"]
    orders = [record.apply_delayed((i,), countdown=600, queue="orders") for i in range(3)]
    mail = record.apply_delayed(("m",), countdown=600, queue="mail")

    moved = celery_zdelay.reschedule_matching(queue="orders", countdown=3 * 3600, app=app)

    assert moved == 3
    now_ms = int(datetime.now(timezone.utc).timestamp() * 1000)
    for result in orders:
        assert _due_ms(redis_client, result.id) >= now_ms + 3 * HOUR_MS - 60_000
    assert _due_ms(redis_client, mail.id) < now_ms + HOUR_MS


def test_bulk_operations_need_a_filter(app: Celery) -> None:
    with pytest.raises(ConfigurationError, match='task="\\*"'):
        celery_zdelay.cancel_matching(app=app)


def test_the_audit_trail_logs_each_cancelled_and_rescheduled_id(
    make_test_app, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_test_app(conf={"zdelay_audit_log": True})
    record = app.tasks["tests.record"]
    first = record.apply_delayed(("a",), countdown=600)
    second = record.apply_delayed(("b",), countdown=600)

    with caplog.at_level(logging.INFO, logger="celery_zdelay.audit"):
        celery_zdelay.cancel(first.id, app=app)
        celery_zdelay.reschedule(second.id, countdown=60, app=app)

    assert f"Cancelled {first.id}" in caplog.text
    assert f"Rescheduled {second.id}: due " in caplog.text


def test_without_the_audit_setting_nothing_is_logged_per_task(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    result = app.tasks["tests.record"].apply_delayed(("a",), countdown=600)

    with caplog.at_level(logging.INFO, logger="celery_zdelay.audit"):
        celery_zdelay.cancel(result.id, app=app)

    assert result.id not in caplog.text


def test_in_transparent_mode_a_group_and_a_chain_are_cancelled_by_the_ids_held(
    make_test_app, redis_client: redis.Redis
) -> None:
    app = make_test_app(conf={"zdelay_threshold": 60})
    record, add = app.tasks["tests.record"], app.tasks["tests.add"]
    grouped = group(add.s(i, i) for i in range(3)).apply_async(countdown=600)
    chained = chain(record.si("a"), record.si("b"), record.si("c")).apply_async(countdown=600)
    assert redis_client.zcard(DUE) == 4

    assert celery_zdelay.cancel(grouped.id, app=app) is True
    assert redis_client.zcard(DUE) == 1
    assert celery_zdelay.reschedule(chained.id, countdown=7200, app=app) is True
    assert celery_zdelay.cancel(chained.parent.id, app=app) is True

    assert redis_client.zcard(DUE) == 0
    assert _release_within_the_hour(app) == 0
