"""Leased entries are pushed into the Redis broker's lists as the companion verified them, once.

Pins the lines of ``store/lua/push.lua`` (see docs/mutation.rst) through
:meth:`Store.push` on a private Redis, no worker or companion: each id the
claim still owns is pushed (LPUSH) into the list its route names, as the
envelope given followed by a delivery tag no push had before (the tags
counter moves by the number pushed), and forgotten from the lease set, the
leased hash and the message hash in the same step; an id repeated is
pushed once; ids leased by another claim or not leased are neither pushed
nor refused, and a push that owns nothing writes nothing; a list key of
another type refuses its entries with the fix and leaves them leased; the
template counts, keys and tags follow what was pushed; over a thousand
entries go in one call; and a key of another type, or a tags counter that
is not a count, refuses the call before anything moves.
"""

from __future__ import annotations

import pytest
import redis
from celery import Celery

from celery_zdelay.capture import capture
from celery_zdelay.entry import expand_entry
from celery_zdelay.errors import StoreRefusedError
from celery_zdelay.parking import park_requests, store_for
from celery_zdelay.schedule import Due
from celery_zdelay.store import ParkRequest, Store
from celery_zdelay.store.marks import Mark, key_owner, tagged_ids
from tests.support.clock import redis_ms
from tests.support.keys import SHARD0

pytestmark = pytest.mark.timeout(60)

HOUR = 3_600_000
QUEUE = "celery"  # the default queue's list key
OTHER = "other-queue"
PREFIX = SHARD0.tag_prefix.encode()


def _request(app: Celery, task_id: str, due_ms: int, queue: str = QUEUE) -> ParkRequest:
    """A tests.record call as Celery would send it, to park with its template."""
    call = app.tasks["tests.record"]
    _, messages = capture(
        app, lambda p: call.apply_async((1, 2), producer=p, task_id=task_id, queue=queue)
    )
    (request,) = park_requests(app, messages, [Due("a", due_ms)])
    return request


def _claim(store: Store, n: int) -> int:
    claimed = store.claim(0, limit=n, lease_ms=HOUR)
    assert len(claimed.entries) == n
    return claimed.token


def _head(store: Store, task_id: str) -> bytes:
    """The envelope of a parked entry, up to its delivery tag's opening quote (as release.py)."""
    payload = store.client.hget(SHARD0.msg, task_id)
    assert isinstance(payload, bytes)
    return expand_entry(payload, store.templates(0)).partition(b"\n")[2]


def _pushed(client: redis.Redis, key: str = QUEUE) -> list[bytes]:
    """The list's messages in the order a worker takes them (kombu pops from the tail)."""
    return list(reversed(client.lrange(key, 0, -1)))


def _template_refs(client: redis.Redis) -> dict[str, int]:
    fields = client.hgetall(SHARD0.templates)
    return {k.decode()[1:]: int(v) for k, v in fields.items() if k.startswith(b"#")}


def _in_flight(client: redis.Redis, task_id: str) -> bool:
    return (
        client.zscore(SHARD0.lease, task_id) is not None
        and client.hexists(SHARD0.leased, task_id)
        and client.hexists(SHARD0.msg, task_id)
    )


# -- what is pushed ----------------------------------------------------------------------


def test_each_entry_is_pushed_as_its_envelope_with_the_next_delivery_tags_and_forgotten(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    now = redis_ms(redis_client)
    later = _request(app, "later", now + HOUR)
    c = _request(app, "c", now - 10, queue=OTHER)
    store.park([_request(app, "a", now - 30), _request(app, "b", now - 20), c, later])
    assert later.template is not None
    assert c.template is not None
    assert _template_refs(redis_client) == {later.template.id: 3, c.template.id: 1}
    token = _claim(store, 3)
    heads = {i: _head(store, i) for i in ("a", "b", "c")}
    redis_client.lpush(OTHER, b"already there")

    pushed, refused = store.push(
        0, token, [("a", QUEUE, heads["a"]), ("b", QUEUE, heads["b"]), ("c", OTHER, heads["c"])]
    )

    assert (pushed, refused) == (["a", "b", "c"], [])
    tag = token  # the claim took its token from the same counter
    assert _pushed(redis_client) == [
        heads["a"] + PREFIX + f'{tag + 1}"}}}}'.encode(),
        heads["b"] + PREFIX + f'{tag + 2}"}}}}'.encode(),
    ]
    assert _pushed(redis_client, OTHER) == [
        b"already there",
        heads["c"] + PREFIX + f'{tag + 3}"}}}}'.encode(),
    ]
    assert int(redis_client.get(SHARD0.tags) or 0) == tag + 3
    assert redis_client.zcard(SHARD0.lease) == redis_client.hlen(SHARD0.leased) == 0
    assert redis_client.hkeys(SHARD0.msg) == [b"later"]
    # The template "later" still uses stays, counted once; the other goes with its last entry
    assert _template_refs(redis_client) == {later.template.id: 1}
    assert redis_client.hget(SHARD0.templates, later.template.id) == later.template.record
    assert not redis_client.hexists(SHARD0.templates, c.template.id)


def test_the_envelope_given_is_pushed_not_what_the_store_holds_by_then(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Someone rewrote the entry after the companion read and verified it
    store = store_for(app)
    store.park([_request(app, "a", redis_ms(redis_client) - 10)])
    token = _claim(store, 1)
    head = _head(store, "a")
    redis_client.hset(SHARD0.msg, "a", b'{"v":1}\nrewritten')

    assert store.push(0, token, [("a", QUEUE, head)]) == (["a"], [])

    assert _pushed(redis_client) == [head + PREFIX + f'{token + 1}"}}}}'.encode()]
    assert not redis_client.hexists(SHARD0.msg, "a")


def test_one_entry_named_twice_is_pushed_once(app: Celery, redis_client: redis.Redis) -> None:
    store = store_for(app)
    store.park([_request(app, "a", redis_ms(redis_client) - 10)])
    token = _claim(store, 1)
    head = _head(store, "a")

    assert store.push(0, token, [("a", QUEUE, head), ("a", QUEUE, head)]) == (["a"], [])

    assert _pushed(redis_client) == [head + PREFIX + f'{token + 1}"}}}}'.encode()]
    assert int(redis_client.get(SHARD0.tags) or 0) == token + 1
    assert redis_client.zcard(SHARD0.lease) == redis_client.hlen(SHARD0.msg) == 0
    assert redis_client.hlen(SHARD0.templates) == 0


def test_ids_this_claim_does_not_own_are_neither_pushed_nor_refused(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    now = redis_ms(redis_client)
    store.park([_request(app, "mine", now - 20)])
    token = _claim(store, 1)
    store.park([_request(app, "theirs", now - 10)])
    other_token = _claim(store, 1)
    heads = {i: _head(store, i) for i in ("mine", "theirs")}

    assert store.push(0, token, [("theirs", QUEUE, heads["theirs"])]) == ([], [])
    assert store.push(0, token + 1_000, [("mine", QUEUE, heads["mine"])]) == ([], [])
    assert not redis_client.exists(QUEUE)

    pushed = store.push(
        0,
        token,
        [
            ("theirs", QUEUE, heads["theirs"]),
            ("nowhere", QUEUE, b"{"),
            ("mine", QUEUE, heads["mine"]),
        ],
    )

    assert pushed == (["mine"], [])
    assert _pushed(redis_client) == [heads["mine"] + PREFIX + f'{other_token + 1}"}}}}'.encode()]
    assert _in_flight(redis_client, "theirs")


def test_a_push_that_owns_nothing_writes_nothing(app: Celery, redis_client: redis.Redis) -> None:
    # Not even the delivery tag counter: a store emptied under a stalled claim
    assert store_for(app).push(0, 7, [("gone", QUEUE, b'{"x":"')]) == ([], [])
    assert redis_client.dbsize() == 0


def test_a_queue_list_key_of_another_type_refuses_its_entries_with_the_fix(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    now = redis_ms(redis_client)
    store.park(
        [
            _request(app, "a", now - 30, queue=OTHER),
            _request(app, "b", now - 20),
            _request(app, "c", now - 10, queue=OTHER),
        ]
    )
    token = _claim(store, 3)
    heads = {i: _head(store, i) for i in ("a", "b", "c")}
    redis_client.hset(OTHER, "not", "a list")
    fix = (
        f"queue list {OTHER} is a hash key, not a list, so the Redis broker cannot deliver "
        "to it: delete or rename that key, then requeue this entry"
    )

    pushed, refused = store.push(
        0, token, [("a", OTHER, heads["a"]), ("b", QUEUE, heads["b"]), ("c", OTHER, heads["c"])]
    )

    assert (pushed, refused) == (["b"], [("a", fix), ("c", fix)])
    assert _pushed(redis_client) == [heads["b"] + PREFIX + f'{token + 1}"}}}}'.encode()]
    assert redis_client.hgetall(OTHER) == {b"not": b"a list"}
    # Refused entries stay leased, for the companion to dead-letter
    assert _in_flight(redis_client, "a")
    assert _in_flight(redis_client, "c")
    assert not redis_client.hexists(SHARD0.msg, "b")


def test_over_a_thousand_entries_are_pushed_and_forgotten_in_one_call(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    now = redis_ms(redis_client)
    ids = [f"e{n:04d}" for n in range(1001)]
    store.park([ParkRequest(i, Due("a", now - 10), b'{"v":1}\nbody') for i in ids])
    token = _claim(store, len(ids))

    pushed, refused = store.push(
        0, token, [(i, QUEUE, f'{{"id":"{i}","t":"'.encode()) for i in ids]
    )

    assert (pushed, refused) == (ids, [])
    assert redis_client.llen(QUEUE) == 1001
    assert redis_client.zcard(SHARD0.lease) == redis_client.hlen(SHARD0.leased) == 0
    assert redis_client.hlen(SHARD0.msg) == 0


def test_a_pushed_entry_frees_its_key_or_holds_it_until_finished_and_leaves_its_tags(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    now = redis_ms(redis_client)

    def keyed(task_id: str, key: str, on_key: str) -> ParkRequest:
        r = _request(app, task_id, now - 10)
        return ParkRequest(
            task_id, r.due, r.payload, QUEUE, r.template, Mark(key, on_key, ("t",), 5000)
        )

    store.park([keyed("kept", "k1", "keep"), keyed("held", "k2", "until_finished")])
    token = _claim(store, 2)
    routes = [(i, QUEUE, _head(store, i)) for i in ("kept", "held")]
    before = redis_ms(redis_client)

    assert store.push(0, token, routes) == (["kept", "held"], [])

    after = redis_ms(redis_client)
    assert key_owner(store, "k1") is None
    owner = key_owner(store, "k2")
    assert owner is not None
    assert owner[0] == "held"
    assert owner[1] is not None
    assert before + 5000 <= owner[1] <= after + 5000
    assert tagged_ids(store, "t") == []
    assert redis_client.hkeys(SHARD0.marks) == [b"k:k2"]


# -- refusals ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "kind"),
    [("lease", "zset"), ("leased", "hash"), ("msg", "hash"), ("templates", "hash")],
)
def test_a_key_of_another_type_refuses_the_push_before_anything_moves(
    app: Celery, redis_client: redis.Redis, name: str, kind: str
) -> None:
    store = store_for(app)
    store.park([_request(app, "a", redis_ms(redis_client) - 10)])
    token = _claim(store, 1)
    head = _head(store, "a")
    key = getattr(SHARD0, name)
    saved = f"saved-{name}"
    redis_client.rename(key, saved)
    redis_client.set(key, "something else wrote this")
    tags = redis_client.get(SHARD0.tags)

    with pytest.raises(StoreRefusedError, match=rf"holds a string, not a {kind}: something else"):
        store.push(0, token, [("a", QUEUE, head)])

    assert not redis_client.exists(QUEUE)
    assert redis_client.get(SHARD0.tags) == tags
    redis_client.delete(key)
    redis_client.rename(saved, key)
    assert _in_flight(redis_client, "a")


@pytest.mark.parametrize(
    ("value", "why"),
    [("not a number", "holds not a number, not a count"), ({"a": "hash"}, "not a string")],
    ids=["not-a-number", "hash"],
)
def test_a_tags_counter_that_is_not_a_count_refuses_the_push_before_anything_moves(
    app: Celery, redis_client: redis.Redis, value: str | dict[str, str], why: str
) -> None:
    store = store_for(app)
    store.park([_request(app, "a", redis_ms(redis_client) - 10)])
    token = _claim(store, 1)
    head = _head(store, "a")
    redis_client.delete(SHARD0.tags)
    if isinstance(value, dict):
        redis_client.hset(SHARD0.tags, mapping=value)
    else:
        redis_client.set(SHARD0.tags, value)

    with pytest.raises(StoreRefusedError, match=why):
        store.push(0, token, [("a", QUEUE, head)])

    assert not redis_client.exists(QUEUE)
    assert _in_flight(redis_client, "a")
