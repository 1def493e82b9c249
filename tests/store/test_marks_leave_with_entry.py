"""An entry's key and tags leave with it; a forged key owner is forgotten only as checked.

Pins the lines of ``store/lua/_marks.lua`` and ``store/lua/drop_key.lua``
(see docs/mutation.rst) that the kill tests of the scripts loading them left
unguarded, on a private Redis with real parking and no worker or companion.

``_marks.lua`` runs in every script that removes entries (handoff, push,
ack, cancel, dead-letter, park_keyed's replace): the entry's record, its
key's owner and its tag members go in the same step, however many entries
leave at once; an ``until_finished`` key released stays taken for the entry's
own max run from the release; a shard without marks pays one ``EXISTS`` and
reads no record; and a marks or tag key of another type refuses the call
before anything moves.

``drop_key.lua`` forgets a key owner a producer found forged (its signed
message does not carry the key) only if the owner is still the value
checked, answers 1 when it dropped it and 0 when not, and refuses a marks
key of another type with the fix.
"""

from __future__ import annotations

import pytest
import redis
from celery import Celery

from celery_zdelay import StoreRefusedError
from celery_zdelay.parking import store_for
from celery_zdelay.schedule import Due
from celery_zdelay.store import ParkRequest, Store
from celery_zdelay.store.client import store_errors
from celery_zdelay.store.dead_reason import DeadReason
from celery_zdelay.store.marks import check_marks, key_owner, tagged_ids
from tests.conftest import AppFactory
from tests.support.clock import redis_ms
from tests.support.keys import FOREIGN, SHARD0, refused_while_written_over
from tests.support.store import PAYLOAD, marked_request

pytestmark = pytest.mark.timeout(60)

HOUR = 3_600_000


def _marks(client: redis.Redis) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in client.hgetall(SHARD0.marks).items()}


@pytest.fixture
def store(app: Celery) -> Store:
    return store_for(app)


# -- _marks.lua: until_finished keys ---------------------------------------------------


def test_an_until_finished_key_released_stays_taken_for_the_entrys_max_run_from_the_ack(
    store: Store, redis_client: redis.Redis
) -> None:
    # Breaks if: the max run ms is read from the record's third character on
    # (string.sub(head, 3)), read as 0 (``and 0``), or subtracted from now.
    max_run_ms = 7 * HOUR
    now = redis_ms(redis_client)
    store.park([marked_request("runs", now - 1000, "k", "until_finished", max_run_ms=max_run_ms)])
    claimed = store.claim(0, limit=10, lease_ms=HOUR)

    before = redis_ms(redis_client)
    assert store.ack(0, claimed.token, ["runs"]) == 1
    after = redis_ms(redis_client)

    owner = key_owner(store, "k")
    assert owner is not None
    assert owner[0] == "runs"
    assert owner[1] is not None
    assert before + max_run_ms <= owner[1] <= after + max_run_ms
    assert _marks(redis_client) == {"k:k": f"runs\n{owner[1]}"}


# -- _marks.lua: a dead letter replaced --------------------------------------------------


def test_an_unmarked_entry_dead_lettered_over_a_marked_dead_letter_leaves_no_record(
    store: Store, redis_client: redis.Redis
) -> None:
    # Breaks if: a dead-lettered entry without a record keeps the "d:" record
    # of the dead letter of its id it replaces (found by the model test: a
    # requeue then gave the new entry the old one's key).
    now = redis_ms(redis_client)
    reason = DeadReason(reason="test", due_ms=now, companion="c-test")
    store.park([marked_request("id-1", now - 1000, "k1", tags=("t1",))])
    first = store.claim(0, limit=10, lease_ms=HOUR)
    assert store.dead_letter(0, first.token, [("id-1", reason)]) == 1
    assert "d:id-1" in _marks(redis_client)

    store.park([ParkRequest("id-1", Due("a", now - 500), PAYLOAD)])
    again = store.claim(0, limit=10, lease_ms=HOUR)
    assert store.dead_letter(0, again.token, [("id-1", reason)]) == 1

    assert _marks(redis_client) == {}
    assert check_marks(store) == []


# -- _marks.lua: what an unmarked shard pays --------------------------------------------


def test_a_shard_without_marks_reads_no_record_when_its_entries_leave(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Breaks if: the early return needs both no ids and no marks hash
    # (``and`` for ``or``): every removal would read records that cannot exist.
    # (With no history recorded: its own reads are test_history.py's.)
    store = store_for(make_test_app(conf={"zdelay_history_seconds": 0}))
    now = redis_ms(redis_client)
    store.park([ParkRequest(f"e{n}", Due("a", now - 1000 + n), PAYLOAD) for n in range(3)])
    claimed = store.claim(0, limit=2, lease_ms=HOUR)
    assert redis_client.exists(SHARD0.marks) == 0

    redis_client.config_resetstat()
    assert store.ack(0, claimed.token, [e.task_id for e in claimed.entries]) == 2
    assert store.cancel(["e2"]) == [True]

    stats = redis_client.info("commandstats")
    assert "cmdstat_hmget" not in stats
    assert int(stats["cmdstat_exists"]["calls"]) == 2
    assert redis_client.exists(SHARD0.marks, SHARD0.tagged) == 0


# -- _marks.lua: over a thousand at once ------------------------------------------------


def test_over_a_thousand_keyed_tagged_entries_cancelled_in_one_call_leave_no_mark(
    store: Store, redis_client: redis.Redis
) -> None:
    # Breaks if: the records, the fields deleted or the tag members removed
    # are walked in steps of 1001 (the 1001st of each would stay).
    at = redis_ms(redis_client) + HOUR
    ids = [f"e{n:04}" for n in range(1001)]
    store.park([marked_request(i, at, f"k{i}", "keep", ("shop",)) for i in ids])
    assert redis_client.hlen(SHARD0.marks) == 2002
    assert redis_client.zcard(SHARD0.tagged) == 1001

    assert store.cancel(ids) == [True] * 1001

    assert redis_client.exists(SHARD0.marks, SHARD0.tagged) == 0
    assert tagged_ids(store, "shop") == []
    assert check_marks(store) == []


# -- _marks.lua: a key of another type --------------------------------------------------


def test_a_tag_index_of_another_type_refuses_the_ack_before_anything_moves(
    store: Store, redis_client: redis.Redis
) -> None:
    # Breaks if: the type check of the marks and tag keys is deleted: the
    # ack would forget the entry, then fail on ZREM with the index half written.
    now = redis_ms(redis_client)
    store.park([marked_request("sent", now - 1000, "k", "keep", ("t",))])
    claimed = store.claim(0, limit=10, lease_ms=HOUR)

    with refused_while_written_over(redis_client, SHARD0.tagged, "zset"):
        store.ack(0, claimed.token, ["sent"])

    assert redis_client.zscore(SHARD0.lease, "sent") is not None
    assert redis_client.hexists(SHARD0.msg, "sent")
    assert _marks(redis_client) == {"i:sent": "k0\nk\nt", "k:k": "sent"}
    assert tagged_ids(store, "t") == ["sent"]


# -- drop_key.lua -------------------------------------------------------------------------


def _drop(store: Store, key: str, checked: str) -> object:
    """Call drop_key.lua as the producer's forged-owner check does (see store/marks.py)."""
    with store_errors(store.url):
        return store.scripts.drop_key(keys=[SHARD0.marks], args=[key, checked])


def test_a_forged_owner_is_dropped_only_while_it_is_the_value_checked(
    store: Store, redis_client: redis.Redis
) -> None:
    # Breaks if: the comparison is inverted (an owner written meanwhile
    # would be dropped), or the reply says 1 for a drop not made, or 2, or nothing.
    redis_client.hset(SHARD0.marks, mapping={"k:promo": "victim", "k:other": "kept"})

    assert _drop(store, "promo", "someone-else") == 0
    assert _drop(store, "promo", "victim\n99") == 0
    assert _marks(redis_client) == {"k:promo": "victim", "k:other": "kept"}

    assert _drop(store, "promo", "victim") == 1
    assert _marks(redis_client) == {"k:other": "kept"}
    assert _drop(store, "promo", "victim") == 0
    assert _drop(store, "gone", "victim") == 0
    assert _marks(redis_client) == {"k:other": "kept"}


def test_a_marks_key_of_another_type_refuses_the_drop_with_the_fix(
    store: Store, redis_client: redis.Redis
) -> None:
    # Breaks if: drop_key's type check is deleted (Redis's own WRONGTYPE
    # reply would not say which key, nor the fix).
    redis_client.set(SHARD0.marks, FOREIGN)
    with pytest.raises(StoreRefusedError, match=r"holds a string, not a hash: something else"):
        _drop(store, "promo", "victim")
    assert redis_client.get(SHARD0.marks) == FOREIGN.encode()
