"""The handoff pushes each due entry into its queue list once, as Celery would, in one step.

Pins the lines of ``store/lua/handoff.lua`` (see docs/mutation.rst) through
:meth:`Store.handoff` on a private Redis, no worker or companion: every
entry due by Redis-now (to the last sequence number of its millisecond)
and none after, at most *limit*, the earliest first; each of the three
stored forms (a template's values, a single-part envelope, a message
stored whole) pushed as the envelope it stands for, with a delivery tag
no push had before; entries that cannot be handed off (no destination,
another layout, a held queue, a list key not given) leased under a new
token instead, or left parked at a list key not yet read; a queue list
key of another type dead-letters its entry with the fix; the template
counts, keys and tags follow what left; batches over a thousand entries;
and a key of another type refuses the call before anything moves.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import redis
from celery import Celery

from celery_zdelay.capture import capture
from celery_zdelay.entry import expand_entry
from celery_zdelay.errors import StoreRefusedError
from celery_zdelay.parking import park_requests, store_for
from celery_zdelay.redis_layout import RedisLayout
from celery_zdelay.schedule import Due
from celery_zdelay.store import ClaimResult, ParkRequest, Store
from celery_zdelay.store.marks import Mark, key_owner, tagged_ids
from tests.conftest import AppFactory
from tests.support.clock import redis_ms
from tests.support.keys import SHARD0

pytestmark = pytest.mark.timeout(60)

HOUR = 3_600_000
QUEUE = "celery"  # the default queue's list key: no prefix, no priority step


def _requests(
    app: Celery, task_id: str, due_ms: int, task: str = "tests.record", queue: str = QUEUE
) -> ParkRequest:
    call = app.tasks[task]
    _, messages = capture(
        app, lambda p: call.apply_async((1, 2), producer=p, task_id=task_id, queue=queue)
    )
    (request,) = park_requests(app, messages, [Due("a", due_ms)])
    assert request.dest == queue
    return request


def _handoff(
    app: Celery,
    *,
    dests: tuple[str, ...] = (QUEUE,),
    layout: str | None = None,
    limit: int = 100,
    fresh: bool = False,
    advance_ms: int = 0,
    with_ids: bool = True,
    held: tuple[str, ...] = (),
) -> ClaimResult:
    fingerprint = RedisLayout(app.conf.broker_transport_options or {}).fingerprint
    return store_for(app).handoff(
        0,
        dests=dests,
        layout=layout or fingerprint,
        limit=limit,
        lease_ms=HOUR,
        fresh=fresh,
        advance_ms=advance_ms,
        companion_id="companion-7",
        with_ids=with_ids,
        held_dests=held,
    )


def _pushed(client: redis.Redis, key: str = QUEUE) -> list[bytes]:
    """The list's messages in the order a worker takes them (kombu pops from the tail)."""
    return list(reversed(client.lrange(key, 0, -1)))


def _head(store: Store, payload: bytes) -> bytes:
    """The envelope a payload stands for, up to its delivery tag's opening quote."""
    return expand_entry(payload, store.templates(0)).partition(b"\n")[2]


def _template_refs(client: redis.Redis) -> dict[str, int]:
    fields = client.hgetall(SHARD0.templates)
    return {k.decode()[1:]: int(v) for k, v in fields.items() if k.startswith(b"#")}


# -- what is pushed ----------------------------------------------------------------


def test_each_stored_form_is_pushed_as_its_envelope_with_a_delivery_tag_never_used_before(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    now = redis_ms(redis_client)
    two_part = _requests(app, "two-part", now - 30)
    other = _requests(app, "other", now - 20)
    store.park([two_part, other])
    single = _requests(app, "single", now - 10)
    expanded = expand_entry(single.payload, store.templates(0))
    store.park([ParkRequest("single", single.due, expanded, QUEUE)])
    payloads = {i: redis_client.hget(SHARD0.msg, i) or b"" for i in ("two-part", "other", "single")}
    heads = {i: _head(store, p) for i, p in payloads.items()}

    result = _handoff(app)

    prefix = SHARD0.tag_prefix.encode()
    assert _pushed(redis_client) == [
        heads["two-part"] + prefix + b'1"}}',
        heads["other"] + prefix + b'2"}}',
        heads["single"] + prefix + b'3"}}',
    ]
    assert json.loads(_pushed(redis_client)[0])["headers"]["id"] == "two-part"
    assert result.handed_ids == ["two-part", "other", "single"]
    assert result.handed_due_ms == [now - 30, now - 20, now - 10]
    assert (result.entries, result.dead, result.token, result.needs_dests) == ([], [], 0, False)
    # Nothing parked or leased is left: nothing to wake for
    assert (result.next_due_ms, result.next_lease_ms) == (None, None)
    assert redis_client.zcard(SHARD0.due) == redis_client.hlen(SHARD0.msg) == 0

    # The next call goes on from the tags pushed, and only names ids when asked
    store.park([_requests(app, "next", redis_ms(redis_client) - 1)])
    again = _handoff(app, with_ids=False)
    assert _pushed(redis_client)[-1].endswith(prefix + b'4"}}')
    assert (again.handed_ids, len(again.handed_due_ms)) == ([], 1)


def test_a_message_stored_whole_is_pushed_byte_for_byte(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = make_test_app(conf={"zdelay_whole_messages": True})
    store = store_for(app)
    now = redis_ms(redis_client)
    store.park([_requests(app, "whole", now - 10), _requests(app, "too", now - 5)])
    payloads = [redis_client.hget(SHARD0.msg, i) for i in ("whole", "too")]
    assert all(p and p.startswith(b'{"b') for p in payloads)

    result = _handoff(app)

    assert _pushed(redis_client) == payloads
    assert result.handed_ids == ["whole", "too"]
    # Its route record names another layout, or is gone, or it is not ours
    # at all: leased instead (the generic path says what is wrong with it)
    store.park([_requests(app, "elsewhere", now - 3)])
    assert [e.task_id for e in _handoff(app, layout="another layout").entries] == ["elsewhere"]
    store.park([_requests(app, "route-gone", now - 2)])
    redis_client.delete(SHARD0.templates)
    store.park([ParkRequest("not-ours", Due("a", now - 1), b'{"body":"x"}')])
    leased = _handoff(app)
    assert [e.task_id for e in leased.entries] == ["route-gone", "not-ours"]
    assert _pushed(redis_client) == payloads


def test_entries_for_two_queues_in_turn_each_go_to_their_own_list_in_due_order(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    now = redis_ms(redis_client)
    queues = [QUEUE, "second", QUEUE, "second"]
    store.park([_requests(app, f"e{n}", now - 10 + n, queue=q) for n, q in enumerate(queues)])

    result = _handoff(app, dests=(QUEUE, "second"))

    assert result.handed_ids == ["e0", "e1", "e2", "e3"]
    ids = {
        key: [json.loads(m)["headers"]["id"] for m in _pushed(redis_client, key)]
        for key in (QUEUE, "second")
    }
    assert ids == {QUEUE: ["e0", "e2"], "second": ["e1", "e3"]}


def test_every_entry_due_by_redis_now_leaves_to_the_last_sequence_and_none_after(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    start = redis_ms(redis_client)
    request = _requests(app, "model", start)
    store.park([request])
    payload = redis_client.hget(SHARD0.msg, "model") or b""
    scores = {}
    for ms in range(start - 20, start + 2000):
        scores[f"{ms}-first"] = ms * 1024
        scores[f"{ms}-last"] = ms * 1024 + 1023
    redis_client.delete(SHARD0.due, SHARD0.msg)
    redis_client.zadd(SHARD0.due, scores)  # type: ignore[arg-type]
    redis_client.hset(SHARD0.msg, mapping=dict.fromkeys(scores, payload))
    assert request.template is not None
    redis_client.hset(SHARD0.templates, "#" + request.template.id, len(scores))

    result = _handoff(app, limit=len(scores))

    due = {i for i, s in scores.items() if s // 1024 <= result.now_ms}
    assert set(result.handed_ids) == due
    assert redis_client.llen(QUEUE) == len(due)
    left = {m.decode() for m in redis_client.zrange(SHARD0.due, 0, -1)}
    assert left == set(scores) - due
    assert result.next_due_ms == min(scores[i] for i in left) // 1024

    # advance_ms moves "now" forward by as much
    ahead = _handoff(app, limit=len(scores), advance_ms=1000)
    assert set(ahead.handed_ids) == {i for i in left if scores[i] // 1024 <= ahead.now_ms + 1000}


def test_at_most_limit_entries_leave_the_earliest_first(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    now = redis_ms(redis_client)
    store.park([_requests(app, f"e{n}", now - 100 + n) for n in (3, 1, 4, 2, 5)])

    result = _handoff(app, limit=2)

    assert result.handed_ids == ["e1", "e2"]
    assert [m.decode() for m in redis_client.zrange(SHARD0.due, 0, -1)] == ["e3", "e4", "e5"]
    assert result.next_due_ms == now - 97


def test_over_a_thousand_entries_are_pushed_and_forgotten_in_one_call(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    now = redis_ms(redis_client)
    model = _requests(app, "model", now - 5000)
    count = 2005
    store.park(
        [
            ParkRequest(f"e{n}", Due("a", now - 5000 + n), model.payload, QUEUE, model.template)
            for n in range(count)
        ]
    )

    result = _handoff(app, limit=5000)

    assert len(result.handed_ids) == count
    pushed = _pushed(redis_client)
    assert len(pushed) == count
    tags = [json.loads(m)["properties"]["delivery_tag"] for m in pushed]
    assert tags == [f"{SHARD0.tag_prefix}{n}" for n in range(1, count + 1)]
    assert redis_client.hlen(SHARD0.msg) == 0
    assert redis_client.get(SHARD0.tags) == str(count).encode()


# -- what is leased, left or dead-lettered -----------------------------------------------


def test_entries_that_cannot_be_handed_off_are_leased_under_a_new_token(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    now = redis_ms(redis_client)
    handed = _requests(app, "handed", now - 40)
    no_dest = ParkRequest("no-dest", Due("a", now - 30), b'{"v":1}\nbody')
    unread = _requests(app, "not-given", now - 20, queue="elsewhere")
    held = _requests(app, "held", now - 10, queue="paused-queue")
    store.park([handed, no_dest, unread, held])
    scores = {
        m.decode(): int(s) for m, s in redis_client.zrange(SHARD0.due, 0, -1, withscores=True)
    }
    payloads = {i: redis_client.hget(SHARD0.msg, i) for i in scores}
    redis_client.set(SHARD0.tags, 41)

    result = _handoff(app, dests=(QUEUE, "paused-queue"), fresh=True, held=("paused-queue",))

    assert result.handed_ids == ["handed"]
    assert _pushed(redis_client)[0].endswith(f'{SHARD0.tag_prefix}42"}}}}'.encode())
    assert result.token == 43
    leased = ["no-dest", "not-given", "held"]
    assert [(e.task_id, e.score, e.payload) for e in result.entries] == [
        (i, scores[i], payloads[i]) for i in leased
    ]
    for task_id in leased:
        assert redis_client.hget(SHARD0.leased, task_id) == f"{scores[task_id]} 43".encode()
        assert redis_client.zscore(SHARD0.lease, task_id) == result.now_ms + HOUR
        assert redis_client.hget(SHARD0.msg, task_id) == payloads[task_id]
    assert result.next_lease_ms == result.now_ms + HOUR
    assert redis_client.zcard(SHARD0.due) == 0

    # One entry leased alone has a token of its own too
    store.park([ParkRequest("alone", Due("a", now - 5), b'{"v":1}\nbody')])
    alone = _handoff(app)
    assert ([e.task_id for e in alone.entries], alone.token) == (["alone"], 44)
    assert redis_client.hget(SHARD0.leased, "alone") == f"{alone.entries[0].score} 44".encode()


def test_entries_parked_under_another_layout_or_signed_are_leased_in_either_form(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    now = redis_ms(redis_client)
    two_part = _requests(app, "two-part", now - 30)
    store.park([two_part])
    single = _requests(app, "single", now - 20)
    expanded = expand_entry(single.payload, store.templates(0))
    store.park([ParkRequest("single", single.due, expanded, QUEUE)])

    moved = _handoff(app, layout="another layout")
    assert [e.task_id for e in moved.entries] == ["two-part", "single"]
    assert redis_client.llen(QUEUE) == 0

    # A signature only the companion can check: handoff.lua never pushes it
    line, _, head = expanded.partition(b"\n")
    signed = json.dumps({**json.loads(line), "s": "a signature"}, separators=(",", ":"))
    store.park([ParkRequest("signed", Due("a", now - 10), signed.encode() + b"\n" + head, QUEUE)])
    assert [e.task_id for e in _handoff(app).entries] == ["signed"]
    assert redis_client.llen(QUEUE) == 0


def test_an_entry_for_a_list_key_not_given_stops_the_call_where_it_stands(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    now = redis_ms(redis_client)
    first = ParkRequest("generic-first", Due("a", now - 30), b'{"v":1}\nbody')
    store.park([first, _requests(app, "for-celery", now - 20), _requests(app, "after", now - 10)])

    result = _handoff(app, dests=())

    assert result.needs_dests is True
    assert [e.task_id for e in result.entries] == ["generic-first"]
    assert [m.decode() for m in redis_client.zrange(SHARD0.due, 0, -1)] == ["for-celery", "after"]
    assert result.next_due_ms == now - 20
    assert redis_client.llen(QUEUE) == 0

    # The first entry due needs it: nothing moves
    again = _handoff(app, dests=())
    assert (again.needs_dests, again.entries, again.handed_ids) == (True, [], [])
    assert redis_client.zcard(SHARD0.due) == 2

    # Read again with the list key: both go on
    assert _handoff(app).handed_ids == ["for-celery", "after"]


def test_a_handoff_with_nothing_due_moves_nothing_and_says_when_the_next_is_due(
    app: Celery, redis_client: redis.Redis
) -> None:
    at = redis_ms(redis_client) + HOUR
    store_for(app).park([_requests(app, "later", at)])

    result = _handoff(app)

    assert (result.handed_ids, result.entries, result.dead) == ([], [], [])
    assert (result.next_due_ms, result.next_lease_ms, result.needs_dests) == (at, None, False)
    assert redis_client.zscore(SHARD0.due, "later") == at * 1024


def test_an_entry_whose_list_key_holds_another_type_is_dead_lettered_with_the_fix(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    now = redis_ms(redis_client)
    request = _requests(app, "stuck", now - 10)
    marked = ParkRequest(
        "stuck", request.due, request.payload, QUEUE, request.template, Mark("k", "keep", ("t",), 0)
    )
    store.park([marked, _requests(app, "other-parked", now + HOUR)])
    payload = redis_client.hget(SHARD0.msg, "stuck") or b""
    redis_client.set(QUEUE, "something else wrote this")
    refs = _template_refs(redis_client)

    result = _handoff(app)

    ((task_id, reason),) = result.dead
    assert task_id == "stuck"
    assert "queue list celery is a string key, not a list" in reason.reason
    assert "delete or rename that key, then requeue this entry" in reason.reason
    assert (reason.due_ms, reason.companion) == (now - 10, "companion-7")
    assert redis_client.zscore(SHARD0.dead, "stuck") == result.now_ms
    stored_reason, _, stored_payload = (
        redis_client.hget(SHARD0.dead_msg, "stuck") or b""
    ).partition(b"\n")
    assert json.loads(stored_reason) == json.loads(reason.to_json())
    assert stored_payload == payload
    assert not redis_client.hexists(SHARD0.msg, "stuck")
    assert redis_client.zcard(SHARD0.due) == 1
    # It still refers to its template (a requeue restores it); its key and tags
    # leave with it, and its record is kept for the requeue
    assert _template_refs(redis_client) == refs
    assert key_owner(store, "k") is None
    assert tagged_ids(store, "t") == []
    assert redis_client.hget(SHARD0.marks, "d:stuck") == b"k0\nk\nt"
    assert redis_client.get(QUEUE) == b"something else wrote this"


# -- what the entries leave behind ------------------------------------------------------


def test_template_counts_follow_what_was_handed_off(app: Celery, redis_client: redis.Redis) -> None:
    store = store_for(app)
    now = redis_ms(redis_client)
    a, c = _requests(app, "a", now - 20), _requests(app, "c", now - 5, task="tests.add")
    b = _requests(app, "b", now - 10, queue="paused-queue")
    b2 = _requests(app, "b2", now - 10, queue="paused-queue")
    a_later = _requests(app, "a-later", now + HOUR)
    store.park([a, b, b2, c, a_later])
    assert a.template is not None
    assert b.template is not None
    assert c.template is not None
    assert _template_refs(redis_client) == {a.template.id: 2, b.template.id: 2, c.template.id: 1}

    # "b" and "b2" are leased (their queue is held): their template stays, counted
    _handoff(app, dests=(QUEUE, "paused-queue"), held=("paused-queue",))

    assert _template_refs(redis_client) == {a.template.id: 1, b.template.id: 2}
    assert redis_client.hexists(SHARD0.templates, b.template.id)
    assert not redis_client.hexists(SHARD0.templates, c.template.id)

    # The last entry of a template released: the template goes
    redis_client.zadd(SHARD0.due, {"a-later": 0})
    _handoff(app)
    assert _template_refs(redis_client) == {b.template.id: 2}
    assert not redis_client.hexists(SHARD0.templates, a.template.id)


def test_a_template_an_entry_leased_still_refers_to_stays_though_its_count_says_none(
    app: Celery, redis_client: redis.Redis
) -> None:
    # A signed entry is leased, an unsigned one of the same template pushed;
    # the count (from a release that did not count the signed one) says 1
    store = store_for(app)
    now = redis_ms(redis_client)
    plain, signed = _requests(app, "plain", now - 20), _requests(app, "signed", now - 10)
    assert plain.template is not None
    assert signed.template == plain.template
    line, _, values = signed.payload.partition(b"\n")
    line = json.dumps({**json.loads(line), "s": "a signature"}, separators=(",", ":")).encode()
    store.park([plain, dataclasses.replace(signed, payload=line + b"\n" + values)])
    redis_client.hset(SHARD0.templates, "#" + plain.template.id, 1)

    result = _handoff(app)

    assert (result.handed_ids, [e.task_id for e in result.entries]) == (["plain"], ["signed"])
    assert redis_client.hget(SHARD0.templates, plain.template.id) == plain.template.record
    assert _template_refs(redis_client) == {plain.template.id: 1}


def test_an_entry_of_an_earlier_release_is_pushed_and_gives_its_template_back(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Its values are only separated, not each ended by a NUL: read the slow way
    store = store_for(app)
    request = _requests(app, "older", redis_ms(redis_client) - 10)
    assert request.template is not None
    line, _, values = request.payload.partition(b"\n")
    assert values.endswith(b"\x00")
    meta = {**json.loads(line), "n": len(values) - 1}
    older = json.dumps(meta, separators=(",", ":")).encode() + b"\n" + values[:-1]
    store.park([dataclasses.replace(request, payload=older)])
    assert _template_refs(redis_client) == {request.template.id: 1}
    head = _head(store, redis_client.hget(SHARD0.msg, "older") or b"")

    assert _handoff(app).handed_ids == ["older"]

    assert _pushed(redis_client) == [head + SHARD0.tag_prefix.encode() + b'1"}}']
    assert redis_client.hlen(SHARD0.templates) == 0


def test_a_handed_off_entry_frees_its_key_or_holds_it_until_finished_and_leaves_its_tags(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    now = redis_ms(redis_client)

    def keyed(task_id: str, key: str, on_key: str) -> ParkRequest:
        r = _requests(app, task_id, now - 10)
        return ParkRequest(
            task_id, r.due, r.payload, QUEUE, r.template, Mark(key, on_key, ("t",), 5000)
        )

    store.park([keyed("kept", "k1", "keep"), keyed("held", "k2", "until_finished")])

    result = _handoff(app)

    assert key_owner(store, "k1") is None
    assert key_owner(store, "k2") == ("held", result.now_ms + 5000)
    assert tagged_ids(store, "t") == []
    assert redis_client.hkeys(SHARD0.marks) == [b"k:k2"]


# -- refusals ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("due", "zset"),
        ("msg", "hash"),
        ("lease", "zset"),
        ("leased", "hash"),
        ("templates", "hash"),
        ("dead", "zset"),
        ("dead_msg", "hash"),
    ],
)
def test_a_key_of_another_type_refuses_the_handoff_before_anything_moves(
    app: Celery, redis_client: redis.Redis, name: str, kind: str
) -> None:
    store = store_for(app)
    now = redis_ms(redis_client)
    store.park([_requests(app, "a", now - 10)])
    key = getattr(SHARD0, name)
    saved = f"saved-{name}"
    if redis_client.exists(key):
        redis_client.rename(key, saved)
    redis_client.set(key, "something else wrote this")

    with pytest.raises(StoreRefusedError, match=rf"holds a string, not a {kind}: something else"):
        _handoff(app)

    assert redis_client.llen(QUEUE) == 0
    redis_client.delete(key)
    if redis_client.exists(saved):
        redis_client.rename(saved, key)
    assert redis_client.zcard(SHARD0.due) == 1


def test_a_corrupt_tag_counter_refuses_the_handoff_before_anything_moves(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    store.park([_requests(app, "a", redis_ms(redis_client) - 10)])
    redis_client.set(SHARD0.tags, "not a number")

    with pytest.raises(StoreRefusedError, match="not a number"):
        _handoff(app)

    assert redis_client.llen(QUEUE) == 0
    assert redis_client.zcard(SHARD0.due) == 1
