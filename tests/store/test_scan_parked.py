"""The one way to read parked entries: :func:`celery_zdelay.store.reading.scan_parked`.

The listing, bulk selection, the dashboard and the testing plugin read
through it, so what it promises here holds for all of them: every entry
once, each shard in due order, pages hidden, a due window, a resume
position, and one handling of an entry released between the two reads.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_zdelay.config import get_config
from celery_zdelay.due_score import (
    MAX_DUE_MS,
    SEQUENCE_SLOTS,
    due_ms_of,
    last_score_of,
    score_of,
    score_range,
)
from celery_zdelay.store import Store, admin
from celery_zdelay.store.reading import Position, scan_parked
from celery_zdelay.web.queries import Filters, parked_page
from tests.conftest import AppFactory
from tests.support.store import ids_on_shard, put_raw

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def store(app: Celery) -> Iterator[Store]:
    opened = Store(get_config(app))
    yield opened
    opened.close()


@pytest.fixture
def sharded(make_test_app: AppFactory) -> Iterator[Store]:
    opened = Store(get_config(make_test_app(conf={"zdelay_shards": 3})))
    yield opened
    opened.close()


def _park(store: Store, task_id: str, score: int, payload: bytes | None = b"x") -> None:
    keys = store.keys(store.shard_of(task_id))
    if payload is not None:
        store.client.hset(keys.msg, task_id, payload)
    store.client.zadd(keys.due, {task_id: score})


def test_the_score_encoding_round_trips_and_bounds_a_due_window() -> None:
    # Every entry due in one millisecond scores within [score_of(ms), last_score_of(ms)]
    assert due_ms_of(score_of(1_000, 0)) == due_ms_of(last_score_of(1_000)) == 1_000
    assert last_score_of(1_000) + 1 == score_of(1_001)
    assert SEQUENCE_SLOTS == 1024
    # The latest due time still scores below 2**53, where doubles stop being exact
    assert last_score_of(MAX_DUE_MS) < 2**53 <= last_score_of(MAX_DUE_MS + 1)
    # A due window [after, before) is a ZRANGEBYSCORE range: before is exclusive
    assert score_range(2, 3) == (str(2 * 1024), f"({3 * 1024}")
    assert score_range(None, None) == ("-inf", "+inf")


def test_every_entry_is_read_once_shard_by_shard_in_due_order(sharded: Store) -> None:
    # Given 30 entries on three shards, due in an order unlike their ids
    for i in range(30):
        _park(sharded, f"t-{i}", score_of(1_000_000 + (i * 7) % 30))

    # When they are scanned a page of one at a time (the pages growing from there)
    scanned = list(scan_parked(sharded, first_page=1))

    # Then each comes once, shard after shard, each shard in due order
    assert sorted(e.task_id for e in scanned) == sorted(f"t-{i}" for i in range(30))
    assert [e.shard for e in scanned] == sorted(e.shard for e in scanned)
    for shard in sharded.shards:
        scores = [e.score for e in scanned if e.shard == shard]
        assert scores == sorted(scores)
    assert all(e.payload == b"x" and e.due_ms == due_ms_of(e.score) for e in scanned)


def test_a_due_window_and_a_cap_per_shard_select_what_is_read(store: Store) -> None:
    for i in range(10):
        _park(store, f"w-{i}", score_of(5_000 + i))

    window = [e.task_id for e in scan_parked(store, due_after_ms=5_002, due_before_ms=5_005)]
    capped = [e.task_id for e in scan_parked(store, first_page=2, per_shard=5)]

    assert window == ["w-2", "w-3", "w-4"]
    assert capped == [f"w-{i}" for i in range(5)]


def test_a_scan_resumes_after_a_position_in_score_shard_id_order(sharded: Store) -> None:
    # Given 12 entries sharing one score on each of the three shards
    score = score_of(7_000)
    ids = {shard: ids_on_shard(sharded, shard, 12, prefix="same") for shard in sharded.shards}
    for shard_ids in ids.values():
        for task_id in shard_ids:
            _park(sharded, task_id, score)
    everything = [(e.score, e.shard, e.task_id) for e in scan_parked(sharded)]
    assert everything == sorted(everything)

    # When a scan resumes after the fifth entry of the middle shard
    middle = sorted(ids[1])[4]
    rest = [
        (e.score, e.shard, e.task_id)
        for e in scan_parked(sharded, after=Position(score, 1, middle), first_page=2)
    ]

    # Then it reads exactly what comes after it: the rest of its shard, then the later shard
    assert rest == [place for place in everything if place > (score, 1, middle)]


def test_an_entry_parked_without_a_message_is_read_with_none(store: Store) -> None:
    # Given an id in the due set whose message is missing (a bug, or a hand edit)
    put_raw(store, "no-message-1", None, due_in_ms=1_000)

    # Then the scan reads it with no payload, and the listing and the dashboard
    # both show it (the companion will dead-letter it: it is counted as parked)
    (scanned,) = scan_parked(store)
    page = parked_page(store, Filters())
    listing = admin.list_parked(store)

    assert (scanned.task_id, scanned.payload) == ("no-message-1", None)
    assert [e.task_id for e in page.entries] == [e.task_id for e in listing.entries]
    assert "payload missing" in (page.entries[0].error or "")


def test_an_entry_released_between_the_two_reads_is_skipped(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given three parked entries
    for i in range(3):
        _park(store, f"r-{i}", score_of(9_000 + i))
    keys = store.keys(0)
    hmget = store.client.hmget

    def released_first(name: Any, members: Any, *args: Any) -> Any:
        # A companion releases r-1 after the page of ids was read, before its message is
        if name == keys.msg:
            store.client.zrem(keys.due, "r-1")
            store.client.hdel(keys.msg, "r-1")
        return hmget(name, members, *args)

    monkeypatch.setattr(store.client, "hmget", released_first)

    # When they are scanned
    scanned = [e.task_id for e in scan_parked(store)]

    # Then the released one is not read as an entry parked without a message
    assert scanned == ["r-0", "r-2"]
