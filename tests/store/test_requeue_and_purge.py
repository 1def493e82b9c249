"""A dead letter is requeued due now with its payload and marks, or purged with its template count.

Pins the lines of ``store/lua/requeue.lua`` and ``store/lua/purge.lua``
(see docs/mutation.rst) through :func:`admin.requeue_dead`,
:func:`admin.purge_dead` and :meth:`Store.purge_dead` on a private Redis, no
worker or companion.

A requeue parks each dead-lettered id again, due at Redis-now (score
``now * 1024``), with the payload after its record's first newline, takes
it out of the dead set and hash, and wakes the companions once when it took
any; it gives the entry its tags back (scored 0) and its key unless another
entry owns the key (parked, or released and running with a max run not over
yet), in which case its record keeps the tags only. It answers one flag per
id: 0 for an id not dead-lettered, without a payload, or parked again since
(waiting or in flight, whose new entry it leaves alone).

A purge deletes the dead letters of the given ids (each id once) and their
``d:`` records, also for over a thousand ids in one call, gives back one
template count per entry (a template whose count reaches 0 is deleted), and
answers how many were dead-lettered; a call with no ids answers 0.

Both refuse a key of another type before anything moves.
"""

from __future__ import annotations

import re

import pytest
import redis
from celery import Celery

from celery_zdelay.parking import store_for
from celery_zdelay.schedule import Due
from celery_zdelay.store import ParkRequest, Store, admin
from celery_zdelay.store.dead_reason import DeadReason
from celery_zdelay.store.marks import check_marks, key_owner, tagged_ids
from tests.support.clock import redis_ms
from tests.support.keys import SHARD0, refused_while_written_over
from tests.support.wake import wake_ups

pytestmark = pytest.mark.timeout(60)

HOUR = 3_600_000
REASON = DeadReason(reason="bad signature", due_ms=1_700_000_000_000, companion="c-test")


def _dead(
    app: Celery, calls: list[dict[str, object]], *, task: str = "tests.record"
) -> tuple[Store, list[str]]:
    """Park one call of *task* per item of *calls* (its options), claim them, dead-letter them."""
    call = app.tasks[task]
    ids = [call.apply_delayed((n, n), countdown=0, **options).id for n, options in enumerate(calls)]
    store = store_for(app)
    claimed = store.claim(0, limit=len(ids), lease_ms=HOUR)
    assert sorted(e.task_id for e in claimed.entries) == sorted(ids)
    assert store.dead_letter(0, claimed.token, [(i, REASON) for i in ids]) == len(ids)
    return store, ids


def _template_of(payload: bytes) -> str:
    """The template id an entry's metadata line names."""
    found = re.match(rb'\{[^\n]*"t":"([0-9a-f]+)"', payload)
    assert found is not None, payload[:80]
    return found.group(1).decode()


def _count(client: redis.Redis, template: str) -> int | None:
    """The reference count of *template*; None when the template is gone."""
    count = client.hget(SHARD0.templates, f"#{template}")
    assert (count is None) == (not client.hexists(SHARD0.templates, template))
    return None if count is None else int(count)


def _requeue_reply(store: Store, ids: list[str]) -> list[int]:
    """The flags requeue.lua answers, called as :func:`admin.requeue_dead` calls it."""
    keys = store.keys(0)
    return list(
        store.scripts.requeue(
            keys=[
                keys.dead,
                keys.dead_msg,
                keys.due,
                keys.msg,
                keys.lease,
                keys.marks,
                keys.tagged,
            ],
            args=[keys.wake, *ids],
        )
    )


def _by_hand(client: redis.Redis, task_id: str, record: bytes) -> None:
    """Write a dead letter as a hand edit (or an older release) could have."""
    client.zadd(SHARD0.dead, {task_id: 1_000})
    client.hset(SHARD0.dead_msg, task_id, record)


# -- requeue ------------------------------------------------------------------------


def test_a_requeued_entry_is_due_now_with_its_payload_and_marks_and_the_others_stay_dead(
    app: Celery, redis_client: redis.Redis
) -> None:
    record = app.tasks["tests.record"]
    calls = [{"key": "order:1", "tags": ["shop", "eu"]}, {"tags": ["eu"]}, {}, {}]
    ids = [record.apply_delayed((n,), countdown=0, **o).id for n, o in enumerate(calls)]
    keyed, tagged, plain, gone = ids
    payloads = {i: redis_client.hget(SHARD0.msg, i) for i in ids}
    records = {i: redis_client.hget(SHARD0.marks, f"i:{i}") for i in (keyed, tagged)}
    store = store_for(app)
    token = store.claim(0, limit=4, lease_ms=HOUR).token
    redis_client.hdel(SHARD0.msg, gone)  # died because its message was missing
    assert store.dead_letter(0, token, [(i, REASON) for i in ids]) == 4

    before = redis_ms(redis_client)
    with wake_ups(redis_client) as woken:
        flags = admin.requeue_dead(store, ["unknown", keyed, gone, tagged, plain])
    after = redis_ms(redis_client)

    assert flags == [False, True, False, True, True]
    due = {m.decode(): int(s) for m, s in redis_client.zrange(SHARD0.due, 0, -1, withscores=True)}
    assert sorted(due) == sorted([keyed, tagged, plain])
    assert all(s % 1024 == 0 and before <= s // 1024 <= after for s in due.values()), due
    assert {i: redis_client.hget(SHARD0.msg, i) for i in due} == {i: payloads[i] for i in due}
    assert not redis_client.hexists(SHARD0.msg, gone)
    # The one without a message stays dead, with its record
    assert [m.decode() for m in redis_client.zrange(SHARD0.dead, 0, -1)] == [gone]
    assert [f.decode() for f in redis_client.hkeys(SHARD0.dead_msg)] == [gone]
    # Marks back as they were: records, the key, the tags (scored 0)
    assert redis_client.hgetall(SHARD0.marks) == {
        f"i:{keyed}".encode(): records[keyed],
        f"i:{tagged}".encode(): records[tagged],
        b"k:order:1": keyed.encode(),
    }
    members = [f"eu\n{keyed}", f"eu\n{tagged}", f"shop\n{keyed}"]
    assert redis_client.zrange(SHARD0.tagged, 0, -1, withscores=True) == sorted(
        (member.encode(), 0.0) for member in members
    )
    assert check_marks(store) == []
    # One wake-up, with the due time
    assert len(woken) == 1
    assert before <= int(woken[0]) <= after


def test_the_reply_has_one_flag_per_id_and_only_a_requeue_that_took_one_wakes(
    app: Celery, redis_client: redis.Redis
) -> None:
    store, (entry,) = _dead(app, [{}])

    with wake_ups(redis_client) as woken:
        assert _requeue_reply(store, ["unknown", entry]) == [0, 1]
    assert len(woken) == 1

    with wake_ups(redis_client) as woken:
        assert _requeue_reply(store, [entry, "unknown"]) == [0, 0]
    assert woken == []
    assert redis_client.zscore(SHARD0.due, entry) is not None


@pytest.mark.parametrize("state", ["waiting", "in flight"])
def test_an_id_parked_again_since_it_died_keeps_its_new_entry(
    app: Celery, redis_client: redis.Redis, state: str
) -> None:
    store, (entry,) = _dead(app, [{}])
    died = redis_client.hget(SHARD0.dead_msg, entry)
    now = redis_ms(redis_client)
    due_ms = now + HOUR if state == "waiting" else now - 100
    store.park([ParkRequest(entry, Due("a", due_ms), b'{"v":1}\nparked again')])
    if state == "in flight":
        assert [e.task_id for e in store.claim(0, limit=1, lease_ms=HOUR).entries] == [entry]
    score = redis_client.zscore(SHARD0.due, entry)
    payload = redis_client.hget(SHARD0.msg, entry)
    assert payload is not None
    assert payload.endswith(b"\nparked again")

    assert admin.requeue_dead(store, [entry]) == [False]

    assert redis_client.hget(SHARD0.msg, entry) == payload
    assert redis_client.zscore(SHARD0.due, entry) == score
    assert (redis_client.zscore(SHARD0.lease, entry) is not None) == (state == "in flight")
    assert redis_client.zscore(SHARD0.dead, entry) is not None
    assert redis_client.hget(SHARD0.dead_msg, entry) == died


@pytest.mark.parametrize(
    ("owner", "takes_key"),
    [("parked", False), ("running", False), ("run over", True)],
)
def test_a_requeued_entry_gets_its_key_back_only_when_no_one_owns_it(
    app: Celery, redis_client: redis.Redis, owner: str, takes_key: bool
) -> None:
    store, (entry,) = _dead(app, [{"key": "order:1", "tags": ["shop"]}])
    record = redis_client.hget(SHARD0.marks, f"d:{entry}")
    assert record is not None
    assert b"\norder:1\n" in record
    now = redis_ms(redis_client)
    if owner == "parked":
        call = app.tasks["tests.record"]
        value = call.apply_delayed(("other",), countdown=600, key="order:1").id
    else:
        until = now + HOUR if owner == "running" else now - 1_000
        value = f"other-id\n{until}"
        redis_client.hset(SHARD0.marks, "k:order:1", value)

    assert admin.requeue_dead(store, [entry]) == [True]

    if takes_key:
        assert key_owner(store, "order:1") == (entry, None)
        assert redis_client.hget(SHARD0.marks, f"i:{entry}") == record
    else:
        assert redis_client.hget(SHARD0.marks, "k:order:1") == value.encode()
        # Parked without the key: a record of its tags only
        assert redis_client.hget(SHARD0.marks, f"i:{entry}") == b"-0\n\nshop"
    assert not redis_client.hexists(SHARD0.marks, f"d:{entry}")
    assert entry in tagged_ids(store, "shop")
    assert check_marks(store) == []


def test_the_payload_requeued_is_everything_after_the_first_newline(
    app: Celery, redis_client: redis.Redis
) -> None:
    # A record whose reason line is empty, and a payload with newlines of its own
    store = store_for(app)
    _by_hand(redis_client, "hand-1", b"\n" + b'{"v":1}\nline two\nline three')

    assert admin.requeue_dead(store, ["hand-1"]) == [True]

    assert redis_client.hget(SHARD0.msg, "hand-1") == b'{"v":1}\nline two\nline three'


@pytest.mark.parametrize(
    ("key", "kind"),
    [
        (SHARD0.dead, "zset"),
        (SHARD0.dead_msg, "hash"),
        (SHARD0.due, "zset"),
        (SHARD0.msg, "hash"),
        (SHARD0.lease, "zset"),
        (SHARD0.marks, "hash"),
        (SHARD0.tagged, "zset"),
    ],
    ids=["dead", "dead_msg", "due", "msg", "lease", "marks", "tagged"],
)
def test_a_key_of_another_type_refuses_the_requeue_before_anything_moves(
    app: Celery, redis_client: redis.Redis, key: str, kind: str
) -> None:
    store, (entry,) = _dead(app, [{"tags": ["shop"]}])
    died = redis_client.hget(SHARD0.dead_msg, entry)
    with refused_while_written_over(redis_client, key, kind):
        admin.requeue_dead(store, [entry])

    assert redis_client.zscore(SHARD0.dead, entry) is not None
    assert redis_client.hget(SHARD0.dead_msg, entry) == died
    assert redis_client.hexists(SHARD0.marks, f"d:{entry}")
    assert not redis_client.exists(SHARD0.due, SHARD0.msg, SHARD0.tagged)


# -- purge --------------------------------------------------------------------------


def test_a_purge_deletes_each_dead_letter_once_with_its_record_and_template_count(
    app: Celery, redis_client: redis.Redis
) -> None:
    record = app.tasks["tests.record"]
    kept = record.apply_delayed((9, 9), countdown=3600, tags=["shop"]).id
    store, (first, second) = _dead(app, [{"tags": ["shop"]}, {"tags": ["shop"]}])
    _, (added,) = _dead(app, [{}], task="tests.add")
    shared = _template_of(redis_client.hget(SHARD0.msg, kept))
    own = _template_of(redis_client.hget(SHARD0.dead_msg, added).partition(b"\n")[2])
    assert shared != own
    assert (_count(redis_client, shared), _count(redis_client, own)) == (3, 1)

    assert admin.purge_dead(store, [first, first, "unknown", added]) == 2

    assert (_count(redis_client, shared), _count(redis_client, own)) == (2, None)
    assert [m.decode() for m in redis_client.zrange(SHARD0.dead, 0, -1)] == [second]
    assert [f.decode() for f in redis_client.hkeys(SHARD0.dead_msg)] == [second]
    assert sorted(f.decode() for f in redis_client.hkeys(SHARD0.marks)) == [
        f"d:{second}",
        f"i:{kept}",
    ]

    assert admin.purge_dead(store) == 1

    assert _count(redis_client, shared) == 1  # the parked entry still uses it
    assert not redis_client.exists(SHARD0.dead, SHARD0.dead_msg)
    assert [f.decode() for f in redis_client.hkeys(SHARD0.marks)] == [f"i:{kept}"]
    assert check_marks(store) == []


def test_the_template_given_back_is_the_one_after_the_first_newline(
    app: Celery, redis_client: redis.Redis
) -> None:
    # A dead letter written by hand with an empty reason line
    parked = app.tasks["tests.record"].apply_delayed((1,), countdown=3600).id
    payload = redis_client.hget(SHARD0.msg, parked)
    template = _template_of(payload)
    redis_client.zrem(SHARD0.due, parked)
    redis_client.hdel(SHARD0.msg, parked)
    _by_hand(redis_client, parked, b"\n" + payload)

    assert admin.purge_dead(store_for(app), [parked]) == 1

    assert _count(redis_client, template) is None


def test_one_purge_call_of_over_a_thousand_ids_forgets_every_record(
    app: Celery, redis_client: redis.Redis
) -> None:
    ids = [f"dead-{n}" for n in range(1_003)]
    with redis_client.pipeline(transaction=False) as pipe:
        for task_id in ids:
            pipe.zadd(SHARD0.dead, {task_id: 1_000})
            pipe.hset(SHARD0.dead_msg, task_id, b'{"reason":"r"}\n')
            pipe.hset(SHARD0.marks, f"d:{task_id}", b"-0\n\nshop")
        pipe.execute()

    assert store_for(app).purge_dead(0, ids) == 1_003

    assert not redis_client.exists(SHARD0.dead, SHARD0.dead_msg, SHARD0.marks)


def test_a_purge_of_no_ids_answers_zero(app: Celery, redis_client: redis.Redis) -> None:
    store, (entry,) = _dead(app, [{}])
    keys = store.keys(0)

    assert store.scripts.purge(keys=[keys.dead, keys.dead_msg, keys.templates, keys.marks]) == 0

    assert redis_client.zscore(SHARD0.dead, entry) is not None


@pytest.mark.parametrize(
    ("key", "kind"),
    [
        (SHARD0.dead, "zset"),
        (SHARD0.dead_msg, "hash"),
        (SHARD0.templates, "hash"),
        (SHARD0.marks, "hash"),
    ],
    ids=["dead", "dead_msg", "templates", "marks"],
)
def test_a_key_of_another_type_refuses_the_purge_before_anything_moves(
    app: Celery, redis_client: redis.Redis, key: str, kind: str
) -> None:
    store, (entry,) = _dead(app, [{"tags": ["shop"]}])
    died = redis_client.hget(SHARD0.dead_msg, entry)
    template = _template_of(died.partition(b"\n")[2])
    with refused_while_written_over(redis_client, key, kind):
        admin.purge_dead(store, [entry])

    assert redis_client.zscore(SHARD0.dead, entry) is not None
    assert redis_client.hget(SHARD0.dead_msg, entry) == died
    assert redis_client.hexists(SHARD0.marks, f"d:{entry}")
    assert _count(redis_client, template) == 1


def test_two_dead_letters_of_one_key_requeued_together_leave_one_owner(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given two entries of one key that died in turn (the key was free again
    # once the first died, so the second parked under it)
    store, (first,) = _dead(app, [{"key": "order:1", "tags": ["shop"]}])
    _, (second,) = _dead(app, [{"key": "order:1"}])
    assert {f.decode() for f in redis_client.hkeys(SHARD0.marks)} == {f"d:{first}", f"d:{second}"}
    first_record = redis_client.hget(SHARD0.marks, f"d:{first}")

    # When both are requeued in one call
    assert admin.requeue_dead(store, [first, second]) == [True, True]

    # Then the first takes the key back and the second is parked without it,
    # as if they had been requeued one after the other: one entry per key;
    # left with neither key nor tags, the second has no record at all
    assert key_owner(store, "order:1") == (first, None)
    assert redis_client.hget(SHARD0.marks, f"i:{first}") == first_record
    assert {f.decode() for f in redis_client.hkeys(SHARD0.marks)} == {
        f"i:{first}",
        "k:order:1",
    }
    assert check_marks(store) == []
    third = app.tasks["tests.record"].apply_delayed(("third",), countdown=600, key="order:1").id
    assert third == first  # a keep call finds the key owned by the first


def test_an_id_named_twice_in_one_requeue_is_requeued_once_with_its_key(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given a dead letter that had a key and a tag
    store, (dead,) = _dead(app, [{"key": "order:1", "tags": ["shop"]}])
    record = redis_client.hget(SHARD0.marks, f"d:{dead}")

    # When one call names it twice (zdelay requeue X X)
    assert admin.requeue_dead(store, [dead, dead]) == [True, False]

    # Then it is parked once, its key and tags back, and the index is exact
    assert [m.decode() for m in redis_client.zrange(SHARD0.due, 0, -1)] == [dead]
    assert redis_client.zcard(SHARD0.dead) == 0
    assert key_owner(store, "order:1") == (dead, None)
    assert redis_client.hget(SHARD0.marks, f"i:{dead}") == record
    assert tagged_ids(store, "shop") == [dead]
    assert check_marks(store) == []
