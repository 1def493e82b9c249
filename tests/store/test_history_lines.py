"""Each history line exact: how late a release was, and one line per id of a big call.

``store/lua/_history.lua`` (loaded in front of every script that moves an
entry) writes one line per event. ``tests/store/test_history.py`` reads the
events back through the API; these pin what it let mutants change (see
docs/mutation.rst): how late a release was, to the millisecond where a
release ahead of due bounds it (``zdelay_release_ahead_seconds``); one line
for each id of a call of over a thousand ids (ids read in chunks of 1,000,
written in chunks of 500, the leased due times read in chunks of 1,000);
and an id a purge is given twice, purged once. Through the store on a
private Redis; no worker or companion is needed.
"""

from __future__ import annotations

import pytest
from celery import Celery

from celery_zdelay.parking import store_for
from celery_zdelay.redis_layout import RedisLayout
from celery_zdelay.store import Store
from celery_zdelay.store.dead_reason import DeadReason
from celery_zdelay.store.history import HistoryLine, read_history
from tests.helpers import wait_for
from tests.support.store import ids_on_shard, marked_request

pytestmark = pytest.mark.timeout(60)

HOUR = 3_600_000
LEASE_MS = 60_000
#: What a loaded test machine may take between two calls of one test.
SLACK_MS = 10_000
#: Over 2 chunks of 1,000 ids read and 4 chunks of 500 written.
MANY = 2_100


def _events(store: Store, task_id: str) -> list[str]:
    return [line.event for line in read_history(store, task_id)]


def _released(store: Store, task_id: str) -> HistoryLine:
    *_, last = read_history(store, task_id)
    assert last.event == "released", read_history(store, task_id)
    return last


def _late_ms(store: Store, task_id: str) -> int:
    """How late its release was, as recorded: ``R <at> <by> <late ms>``."""
    by, late = _released(store, task_id).fields
    assert by == "c-test"
    return int(late)


def test_an_acknowledged_release_records_how_late_it_was_and_one_ahead_of_due_how_early(
    store: Store,
) -> None:
    # Given one entry due a second ago and three due in an hour, all claimed
    # at once (the claim fast-forwarded past the hour, as a release ahead does)
    now = store.time_ms()
    late_one, *early = ids_on_shard(store, 0, 4)
    store.park([marked_request(late_one, now - 1_000)])
    store.park([marked_request(i, now + HOUR) for i in early])
    claimed = store.claim(0, limit=4, lease_ms=LEASE_MS, advance_ms=2 * HOUR)
    assert len(claimed.entries) == 4
    far_ahead, one_ms_ahead, none_ahead = early

    # When each is acknowledged released, with how far ahead its call may release
    for task_id, ahead_ms in ((late_one, 0), (far_ahead, 2 * HOUR), (one_ms_ahead, 1)):
        assert store.ack(0, claimed.token, [task_id], by="c-test", ahead_ms=ahead_ms) == 1
    assert store.ack(0, claimed.token, [none_ahead], by="c-test") == 1

    # Then the overdue one was a second late (its due time read from the lease)
    assert 1_000 <= _late_ms(store, late_one) < 1_000 + SLACK_MS
    # and one released an hour early says so, down to minus what its call allowed
    assert -HOUR <= _late_ms(store, far_ahead) < -HOUR + SLACK_MS
    assert _late_ms(store, one_ms_ahead) == -1
    # and one a test released early, with no release ahead, is not late: 0
    assert _late_ms(store, none_ahead) == 0


def test_a_handed_off_release_records_how_late_it_was(app: Celery) -> None:
    # Given a task due at once, handed off into its broker list at least 50
    # ms after (the handoff gives the due times it read, not the lease's)
    store = store_for(app)
    result = app.tasks["tests.record"].apply_delayed((1,), countdown=0)
    (parked,) = read_history(store, result.id)
    due_ms = int(parked.fields[0])
    wait_for(lambda: store.time_ms() > due_ms + 50, timeout=5)
    layout = RedisLayout(app.conf.broker_transport_options or {}).fingerprint
    handed = store.handoff(
        store.shard_of(result.id),
        dests=("celery",),
        layout=layout,
        limit=10,
        lease_ms=LEASE_MS,
        fresh=False,
        companion_id="c-test",
    )
    assert handed.handed_due_ms == [due_ms]

    # Then its release is recorded that late, by that companion
    assert 50 < _late_ms(store, result.id) < SLACK_MS


def test_a_release_of_over_two_thousand_ids_records_each_once_with_how_late(
    store: Store,
) -> None:
    # Given 2,100 entries due a second ago, claimed and acknowledged in one call
    ids = ids_on_shard(store, 0, MANY)
    now = store.time_ms()
    store.park([marked_request(i, now - 1_000) for i in ids])
    claimed = store.claim(0, limit=MANY, lease_ms=LEASE_MS)
    assert store.ack(0, claimed.token, ids, by="c-test") == MANY

    # Then each has one parked and one released line, with its lateness
    for task_id in ids:
        assert _events(store, task_id) == ["parked", "released"], task_id
        assert 1_000 <= _late_ms(store, task_id) < 1_000 + SLACK_MS, task_id


def test_a_cancel_of_over_two_thousand_ids_records_each_once(store: Store) -> None:
    ids = ids_on_shard(store, 0, MANY)
    store.park([marked_request(i, store.time_ms() + HOUR) for i in ids])

    assert all(store.cancel(ids, by="alice"))

    for task_id in ids:
        lines = read_history(store, task_id)
        assert [line.event for line in lines] == ["parked", "cancelled"], task_id
        assert lines[-1].fields == ("id", "alice")


def test_an_id_a_purge_is_given_twice_is_purged_once(store: Store) -> None:
    (task_id,) = ids_on_shard(store, 0, 1)
    store.park([marked_request(task_id, store.time_ms() - 1_000)])
    claimed = store.claim(0, limit=1, lease_ms=LEASE_MS)
    reason = DeadReason(reason="bad signature", due_ms=store.time_ms(), companion="c-test")
    assert store.dead_letter(0, claimed.token, [(task_id, reason)]) == 1

    assert store.purge_dead(0, [task_id, task_id]) == 1

    assert _events(store, task_id) == ["parked", "dead", "purged"]
