"""Parking stores each entry once, at its due time on the Redis clock, in parking order.

Pins the lines of ``store/lua/park.lua`` (see docs/mutation.rst) through
:meth:`Store.park` on a private Redis, no worker: a due time is absolute or
Redis-now + countdown, as returned; entries of one millisecond keep their
parking order in its 1024 sequence slots (the last one shared once full);
each payload is stamped with when it was parked, once; a retried call
(same marker) returns the first call's due times and parks nothing again;
a re-park takes over an id being released; template counts follow what is
parked; handoff destinations are listed once, however many entries of
one call name them; the leased hash is needed (and checked) only by a
re-park of an id being released; an id parked again without a key or
tags forgets those it had (waiting or being released), the marks read only
for an id stored already; the companions wake only
when the earliest due time moves earlier; and a key of another type
refuses the park with the fix, before anything is written.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
from celery import Celery

from celery_zdelay import StoreRefusedError
from celery_zdelay.capture import capture
from celery_zdelay.parking import park_requests, store_for
from celery_zdelay.schedule import Due
from celery_zdelay.store import ParkRequest
from celery_zdelay.store.marks import check_marks, key_owner, tagged_ids
from tests.conftest import AppFactory
from tests.support.clock import redis_ms
from tests.support.keys import SHARD0
from tests.support.store import ids_on_shard, marked_request
from tests.support.wake import wake_ups

pytestmark = pytest.mark.timeout(60)

PAYLOAD = b'{"v":1}\nbody'
HOUR = 3_600_000


def _at(task_id: str, ms: int, payload: bytes = PAYLOAD, dest: str | None = None) -> ParkRequest:
    return ParkRequest(task_id, Due("a", ms), payload, dest)


def _score(client: redis.Redis, task_id: str) -> int:
    score = client.zscore(SHARD0.due, task_id)
    assert score is not None, f"{task_id} is not parked"
    return int(score)


def _requests(app: Celery, task: str, task_id: str, due: Due) -> list[ParkRequest]:
    """The requests that park a call of *task*, as apply_delayed builds them."""
    call = app.tasks[task]
    _, messages = capture(app, lambda p: call.apply_async((1, 2), producer=p, task_id=task_id))
    return park_requests(app, messages, [due] * len(messages))


def _template_refs(client: redis.Redis) -> dict[bytes, bytes]:
    fields: dict[bytes, bytes] = client.hgetall(SHARD0.templates)
    return {k: v for k, v in fields.items() if k.startswith(b"#")}


def test_due_times_are_absolute_or_redis_now_plus_the_countdown_in_argument_order(
    app: Celery, redis_client: redis.Redis
) -> None:
    at = redis_ms(redis_client) + HOUR
    before = redis_ms(redis_client)
    parked = store_for(app).park([_at("abs", at), ParkRequest("rel", Due("r", 5000), PAYLOAD)])
    due = [p.due_ms or 0 for p in parked]
    after = redis_ms(redis_client)
    assert due[0] == at
    assert before + 5000 <= due[1] <= after + 5000
    assert _score(redis_client, "abs") == at * 1024
    assert _score(redis_client, "rel") // 1024 == due[1]


def test_entries_of_one_millisecond_keep_parking_order_and_share_its_last_slot_once_full(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    at = redis_ms(redis_client) + HOUR
    # Entries in the last slot of the millisecond before and in the first
    # of the one after are not in this one
    redis_client.zadd(SHARD0.due, {"before": (at - 1) * 1024 + 1023, "after": (at + 1) * 1024})
    store.park([_at("first", at)])
    store.park([_at("second", at), _at("third", at)])
    assert [_score(redis_client, i) - at * 1024 for i in ("first", "second", "third")] == [0, 1, 2]

    # A millisecond whose last slot is taken: the rest share it
    full = at + 1000
    redis_client.zadd(SHARD0.due, {"in-the-last-slot": full * 1024 + 1023})
    store.park([_at("shares", full), _at("shares-too", full)])
    assert {_score(redis_client, i) - full * 1024 for i in ("shares", "shares-too")} == {1023}
    # One before the last slot: the next takes the last, the one after shares it
    nearly = at + 2000
    redis_client.zadd(SHARD0.due, {"next-to-last": nearly * 1024 + 1022})
    store.park([_at("last", nearly), _at("shares-last", nearly)])
    assert [_score(redis_client, i) - nearly * 1024 for i in ("last", "shares-last")] == [
        1023,
        1023,
    ]


def test_each_payload_is_stamped_once_with_when_it_was_parked(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    at = redis_ms(redis_client) + HOUR
    whole = b'{"body":"x"}'
    before = redis_ms(redis_client)
    store.park([_at("plain", at), _at("restamped", at, b'{"p":17,"v":1}\nbody')])
    store.park([_at("whole", at, whole), _at("other", at, b"not json")])
    store.park([_at("unquoted", at, b"{not quoted}")])
    after = redis_ms(redis_client)

    stored = {i: redis_client.hget(SHARD0.msg, i) or b"" for i in ("plain", "restamped")}
    for payload in stored.values():
        stamp, _, rest = payload.partition(b",")
        assert before <= int(stamp.removeprefix(b'{"p":')) <= after
        assert rest == b'"v":1}\nbody'
    assert redis_client.hget(SHARD0.msg, "whole") == whole
    # Only a metadata line ({"...) is stamped: anything else is kept as it is
    for task_id, payload in {"other": b"not json", "unquoted": b"{not quoted}"}.items():
        assert redis_client.hget(SHARD0.msg, task_id) == payload


def test_a_retried_call_returns_the_first_calls_due_times_and_parks_nothing_again(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    at = redis_ms(redis_client) + HOUR
    keys, args = store.park_arguments(0, [_at("a", at), _at("b", at + 1)])
    assert store.scripts.park(keys=keys, args=args) == [at, at + 1]
    # Released meanwhile: the retry must not park it again
    assert store.cancel(["a", "b"]) == [True, True]

    assert store.scripts.park(keys=keys, args=args) == [at, at + 1]

    assert redis_client.zcard(SHARD0.due) == redis_client.hlen(SHARD0.msg) == 0


def test_a_re_park_takes_over_an_id_being_released(app: Celery, redis_client: redis.Redis) -> None:
    store = store_for(app)
    now = redis_ms(redis_client)
    store.park([_at("a", now - 1000)])
    assert [e.task_id for e in store.claim(0, limit=1, lease_ms=HOUR).entries] == ["a"]

    store.park([_at("a", now + HOUR, b'{"v":2}\nbody')])

    assert redis_client.zscore(SHARD0.lease, "a") is None
    assert not redis_client.hexists(SHARD0.leased, "a")
    assert _score(redis_client, "a") == (now + HOUR) * 1024
    assert (redis_client.hget(SHARD0.msg, "a") or b"").endswith(b'"v":2}\nbody')


def test_template_counts_follow_what_is_parked_an_id_parked_again_counting_once(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    later = Due("r", HOUR)
    store.park(_requests(app, "tests.record", "a", later))
    store.park(_requests(app, "tests.record", "b", later))
    (record_ref,) = _template_refs(redis_client)
    assert redis_client.hexists(SHARD0.templates, record_ref[1:])
    assert _template_refs(redis_client) == {record_ref: b"2"}

    # "a" parked again as a call of another task, twice in one call: it
    # gives its old template back once and holds the new one once
    again = [*_requests(app, "tests.add", "a", later), *_requests(app, "tests.add", "a", later)]
    store.park(again)
    refs = _template_refs(redis_client)
    assert refs.pop(record_ref) == b"1"
    assert list(refs.values()) == [b"1"]

    store.park(_requests(app, "tests.add", "b", later))
    assert list(_template_refs(redis_client).values()) == [b"2"]
    assert not redis_client.hexists(SHARD0.templates, record_ref[1:])


def test_every_new_template_of_one_call_is_stored_and_counted(
    app: Celery, redis_client: redis.Redis
) -> None:
    later = Due("r", HOUR)
    requests = [
        *_requests(app, "tests.record", "a", later),
        *_requests(app, "tests.add", "b", later),
        *_requests(app, "tests.record", "c", later),
    ]
    store_for(app).park(requests)
    assert sorted(_template_refs(redis_client).values()) == [b"1", b"2"]
    records = {r.template.id: r.template.record for r in requests if r.template}
    assert len(records) == 2
    for template_id, record in records.items():
        assert redis_client.hget(SHARD0.templates, template_id) == record


def test_handoff_destinations_are_listed_once(app: Celery, redis_client: redis.Redis) -> None:
    at = redis_ms(redis_client) + HOUR
    store_for(app).park([_at("a", at, dest="q1"), _at("b", at, dest="q1"), _at("c", at, dest="q2")])
    store_for(app).park([_at("d", at)])
    assert redis_client.smembers(SHARD0.dests) == {b"q1", b"q2"}


def test_the_companions_wake_only_when_the_earliest_due_time_moves_earlier(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    t = redis_ms(redis_client) + HOUR
    with wake_ups(redis_client) as seen:
        store.park([_at("first", t + 60_000)])  # nothing parked before: wake
        store.park([_at("later", t + 120_000)])  # an earlier one waits: no wake
        store.park([_at("z", t + 90_000), _at("earlier", t + 30_000)])  # wake for the lowest
        store.park([_at("same-ms", t + 30_000)])  # not earlier than what waits
    assert seen == [str(t + 60_000).encode(), str(t + 30_000).encode()]


def _string_at(key: str) -> Callable[[redis.Redis], None]:
    def write(client: redis.Redis) -> None:
        client.delete(key)
        client.set(key, "something else wrote this")

    return write


@pytest.mark.parametrize(
    ("key", "kind"),
    [(SHARD0.due, "zset"), (SHARD0.msg, "hash"), (SHARD0.dests, "set")],
    ids=["due", "msg", "dests"],
)
def test_a_key_of_another_type_refuses_the_park_with_the_fix_and_writes_nothing(
    app: Celery, redis_client: redis.Redis, key: str, kind: str
) -> None:
    at = redis_ms(redis_client) + HOUR
    _string_at(key)(redis_client)
    with pytest.raises(StoreRefusedError, match=rf"holds a string, not a {kind}: something else"):
        store_for(app).park([_at("a", at, dest="q1")])
    assert redis_client.get(key) == b"something else wrote this"
    for other in (SHARD0.due, SHARD0.msg, SHARD0.dests, SHARD0.templates):
        assert other == key or not redis_client.exists(other)


def test_a_re_park_of_a_leased_id_checks_the_leased_hash_before_it_writes(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    now = redis_ms(redis_client)
    store.park([_at("a", now - 1000)])
    assert [e.task_id for e in store.claim(0, limit=1, lease_ms=HOUR).entries] == ["a"]
    _string_at(SHARD0.leased)(redis_client)

    with pytest.raises(StoreRefusedError, match="holds a string, not a hash: something else"):
        store.park([_at("a", now + HOUR)])

    assert redis_client.zscore(SHARD0.lease, "a") is not None
    assert redis_client.zcard(SHARD0.due) == 0


def test_a_park_that_takes_over_no_leased_id_does_not_need_the_leased_hash(
    app: Celery, redis_client: redis.Redis
) -> None:
    # A leased hash someone else overwrote stops what needs it (above), not new work
    _string_at(SHARD0.leased)(redis_client)
    at = redis_ms(redis_client) + HOUR

    store_for(app).park([_at("a", at), _at("b", at)])

    assert _score(redis_client, "a") < _score(redis_client, "b")
    assert redis_client.get(SHARD0.leased) == b"something else wrote this"


def test_a_batch_of_ten_thousand_entries_for_one_queue_names_it_once(
    app: Celery, redis_client: redis.Redis
) -> None:
    # One SADD argument per destination: Redis's Lua unpacks at most 8,000
    at = redis_ms(redis_client) + HOUR
    ids = [f"t{n}" for n in range(10_000)]

    store_for(app).park([_at(i, at, dest="q1") for i in ids])

    assert redis_client.smembers(SHARD0.dests) == {b"q1"}
    assert redis_client.zcard(SHARD0.due) == redis_client.hlen(SHARD0.msg) == len(ids)


def test_a_batch_another_shard_cannot_take_is_refused_on_every_shard_before_any_writes(
    make_test_app: AppFactory,
) -> None:
    app = make_test_app(conf={"zdelay_shards": 2})
    store = store_for(app)
    client = store.client
    (on_0,), (on_1,) = (ids_on_shard(store, shard, 1) for shard in (0, 1))
    at = redis_ms(client) + HOUR
    client.set(store.keys(1).due, "something else wrote this")

    with pytest.raises(StoreRefusedError, match="holds a string, not a zset: something else"):
        store.park([_at(on_0, at), _at(on_1, at)])

    assert client.zcard(store.keys(0).due) == client.hlen(store.keys(0).msg) == 0


@pytest.mark.parametrize("where", ["due", "being released"])
def test_an_id_parked_again_plainly_forgets_the_key_and_tags_it_had(
    app: Celery, redis_client: redis.Redis, where: str
) -> None:
    # Given "a" parked with a key (held until it finishes) and two tags, and
    # "b" with another key and one of those tags
    store = store_for(app)
    now = redis_ms(redis_client)
    store.park(
        [
            marked_request("a", now - 1000, "k1", "until_finished", ("t1", "t2"), 60_000),
            marked_request("b", now + HOUR, "k2", "keep", ("t1",)),
        ],
    )
    if where == "being released":
        assert [e.task_id for e in store.claim(0, limit=1, lease_ms=HOUR).entries] == ["a"]

    # When "a" is parked again with neither key nor tags (store.park: park.lua alone)
    store.park([_at("a", now + HOUR, b'{"v":2}\nbody')])

    # Then the new entry has no marks: its key is free, its tags select
    # nothing, and "b" keeps all of its own
    assert redis_client.hget(SHARD0.marks, "i:a") is None
    assert key_owner(store, "k1") is None
    assert tagged_ids(store, "t1") == ["b"]
    assert tagged_ids(store, "t2") == []
    assert key_owner(store, "k2") == ("b", None)
    assert check_marks(store) == []


def test_a_first_park_reads_no_marks_and_a_park_again_checks_them_before_it_writes(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Given "a" parked with a tag, then the marks hash written over by someone else
    store = store_for(app)
    at = redis_ms(redis_client) + HOUR
    store.park([marked_request("a", at, tags=("t1",))])
    before = redis_client.hget(SHARD0.msg, "a")
    _string_at(SHARD0.marks)(redis_client)

    # When a new id is parked, the marks are not read: it is parked
    store.park([_at("new", at)])
    assert _score(redis_client, "new") > 0

    # ...and when "a" is parked again, they are: refused with the fix, nothing written
    with pytest.raises(StoreRefusedError, match="holds a string, not a hash: something else"):
        store.park([_at("a", at + 1, b'{"v":2}\nbody')])
    assert redis_client.hget(SHARD0.msg, "a") == before
    assert _score(redis_client, "a") == at * 1024
