"""One entry per key, as its mode says, and an exact key and tag index, in one step.

Pins the lines of ``store/lua/park_keyed.lua`` (see docs/mutation.rst)
through :meth:`Store.park` on a private Redis, no worker or companion:
``keep`` and ``until_finished`` park nothing while the key is taken and
answer the owner's id and due time; ``replace`` and ``debounce`` take the
parked owner out (its message, its marks, its template count) but never
one being released; within one batch the last call of a key decides; a
run that ended frees the key; an id parked again gives up its old key and
tags; only a marked entry gets a record; a retried call answers what the
first one did and parks nothing again; a malformed call or a marks key of
another type is refused before anything is written.
"""

from __future__ import annotations

import dataclasses

import pytest
import redis
from celery import Celery

from celery_zdelay import StoreRefusedError
from celery_zdelay.capture import capture
from celery_zdelay.parking import park_requests, store_for
from celery_zdelay.schedule import Due
from celery_zdelay.store import Parked, ParkRequest, Store
from celery_zdelay.store.marks import Mark, check_marks, key_owner, tagged_ids
from celery_zdelay.store.store import HISTORY_SENTINEL
from tests.support.clock import redis_ms
from tests.support.keys import SHARD0
from tests.support.store import marked_request
from tests.support.wake import wake_ups

pytestmark = pytest.mark.timeout(60)

HOUR = 3_600_000


def _call(app: Celery, task: str, task_id: str, ms: int, key: str, on_key: str) -> ParkRequest:
    """The request that parks a call of *task* (with its template) under *key*."""
    call = app.tasks[task]
    _, messages = capture(app, lambda p: call.apply_async((1, 2), producer=p, task_id=task_id))
    (request,) = park_requests(app, messages, [Due("a", ms)])
    assert request.template is not None
    return dataclasses.replace(request, mark=Mark(key, on_key, (), 0))


def _parked(client: redis.Redis) -> dict[str, int]:
    return {m.decode(): int(s) for m, s in client.zrange(SHARD0.due, 0, -1, withscores=True)}


def _marks(client: redis.Redis) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in client.hgetall(SHARD0.marks).items()}


def _template_refs(client: redis.Redis) -> dict[str, int]:
    fields = client.hgetall(SHARD0.templates)
    return {k.decode()[1:]: int(v) for k, v in fields.items() if k.startswith(b"#")}


@pytest.fixture
def store(app: Celery) -> Store:
    return store_for(app)


@pytest.fixture
def calls(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[tuple[object, ...]]:
    """Every EVALSHA the store's client sends: (sha, number of keys, keys and args)."""
    seen: list[tuple[object, ...]] = []
    original = store.client.evalsha

    def spy(sha: str, numkeys: int, *keys_and_args: object) -> object:
        seen.append((sha, numkeys, *keys_and_args))
        return original(sha, numkeys, *keys_and_args)

    monkeypatch.setattr(store.client, "evalsha", spy)
    return seen


# -- a taken key ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["keep", "until_finished"])
def test_keep_parks_nothing_while_the_key_is_taken_and_answers_the_owners_due_time(
    store: Store, redis_client: redis.Redis, mode: str
) -> None:
    at = redis_ms(redis_client) + HOUR
    # The owner takes the second slot of its millisecond: its due ms is the score // 1024
    store.park([marked_request("first-of-ms", at)])
    assert store.park([marked_request("owner", at, "k", mode, ("t",))]) == [
        Parked("owner", at, True)
    ]

    again = store.park([marked_request("second", at + 5000, "k", mode, ("u",))])

    assert again == [Parked("owner", at, False)]
    assert set(_parked(redis_client)) == {"first-of-ms", "owner"}
    assert _marks(redis_client) == {"i:owner": f"{mode[0]}0\nk\nt", "k:k": "owner"}
    assert tagged_ids(store, "u") == []
    assert check_marks(store) == []


@pytest.mark.parametrize("mode", ["replace", "debounce"])
def test_replace_takes_the_parked_owner_out_with_its_marks_and_template_count(
    app: Celery, store: Store, redis_client: redis.Redis, mode: str
) -> None:
    at = redis_ms(redis_client) + HOUR
    owner = dataclasses.replace(
        _call(app, "tests.record", "owner", at, "k", mode),
        mark=Mark("k", mode, ("old",), 0),
    )
    store.park([owner, _call(app, "tests.record", "other", at, "j", mode)])
    assert list(_template_refs(redis_client).values()) == [2]

    reply = store.park([_call(app, "tests.add", "new", at + 1000, "k", mode)])

    assert reply == [Parked("new", at + 1000, True)]
    assert set(_parked(redis_client)) == {"other", "new"}
    assert not redis_client.hexists(SHARD0.msg, "owner")
    assert key_owner(store, "k") == ("new", None)
    assert tagged_ids(store, "old") == []
    assert "i:owner" not in _marks(redis_client)
    assert sorted(_template_refs(redis_client).values()) == [1, 1]
    assert check_marks(store) == []


def test_within_one_batch_keep_parks_the_first_and_answers_its_due_time_for_the_rest(
    app: Celery, store: Store, redis_client: redis.Redis
) -> None:
    at = redis_ms(redis_client) + HOUR
    first = _call(app, "tests.record", "first", at, "k", "keep")
    # The second's template (another task) is used by no entry parked: not stored
    second = _call(app, "tests.add", "second", at + 1000, "k", "keep")

    assert store.park([first, second]) == [
        Parked("first", at, True),
        Parked("first", at, False),
    ]

    assert set(_parked(redis_client)) == {"first"}
    assert first.template is not None
    assert second.template is not None
    assert _template_refs(redis_client) == {first.template.id: 1}
    assert redis_client.hget(SHARD0.templates, first.template.id) == first.template.record
    assert not redis_client.hexists(SHARD0.templates, second.template.id)


def test_within_one_batch_replace_parks_only_the_last_call_of_a_key(
    app: Celery, store: Store, redis_client: redis.Redis
) -> None:
    at = redis_ms(redis_client) + HOUR
    store.park([marked_request("parked-before", at, "k", "replace", ("t",))])
    first = _call(app, "tests.add", "first", at + 1000, "k", "replace")
    last = _call(app, "tests.record", "last", at + 2000, "k", "replace")

    assert store.park([first, last]) == [
        Parked("last", at + 2000, False),
        Parked("last", at + 2000, True),
    ]

    assert set(_parked(redis_client)) == {"last"}
    assert key_owner(store, "k") == ("last", None)
    assert tagged_ids(store, "t") == []
    assert first.template is not None
    assert last.template is not None
    assert _template_refs(redis_client) == {last.template.id: 1}
    assert redis_client.hget(SHARD0.templates, last.template.id) == last.template.record
    assert check_marks(store) == []


def test_a_call_under_the_owners_own_id_keeps_its_record_or_moves_it_in_place(
    store: Store, redis_client: redis.Redis
) -> None:
    at = redis_ms(redis_client) + HOUR
    store.park([marked_request("owner", at, "k", "keep", ("t",))])

    # keep: nothing parked, the owner keeps its key and tags, and the
    # reply says when it is due (regression: it said -1, "not parked")
    (kept,) = store.park([marked_request("owner", at + 1000, "k", "keep", ("u",))])
    assert kept == Parked("owner", at, False)
    assert _parked(redis_client) == {"owner": at * 1024}
    assert _marks(redis_client) == {"i:owner": "k0\nk\nt", "k:k": "owner"}
    assert tagged_ids(store, "t") == ["owner"]

    # replace: re-parked where it is, not taken out first: the earliest due
    # time does not move earlier, so the companions are not woken
    with wake_ups(redis_client) as seen:
        assert store.park([marked_request("owner", at, "k", "replace")]) == [
            Parked("owner", at, True)
        ]
    assert seen == []
    assert _marks(redis_client) == {"i:owner": "r0\nk", "k:k": "owner"}


# -- an owner being released ----------------------------------------------------------


def test_replace_never_takes_out_an_owner_being_released(
    store: Store, redis_client: redis.Redis
) -> None:
    now = redis_ms(redis_client)
    store.park([marked_request("in-flight", now - 1000, "k", "replace", ("t",))])
    claimed = store.claim(0, limit=10, lease_ms=HOUR)
    assert [e.task_id for e in claimed.entries] == ["in-flight"]

    # keep: the owner is no longer parked, so no due time
    assert store.park([marked_request("kept-out", now + HOUR, "k", "keep")]) == [
        Parked("in-flight", None, False)
    ]
    reply = store.park([marked_request("new", now + HOUR, "k", "replace")])

    assert reply == [Parked("new", now + HOUR, True)]
    assert (redis_client.hget(SHARD0.msg, "in-flight") or b"").endswith(b'"v":1}\nbody')
    assert redis_client.zscore(SHARD0.lease, "in-flight") is not None
    assert _marks(redis_client)["i:in-flight"] == "r0\nk\nt"
    assert tagged_ids(store, "t") == ["in-flight"]
    assert key_owner(store, "k") == ("new", None)


def test_until_finished_keeps_the_key_after_the_release_until_its_max_run_ends(
    store: Store, redis_client: redis.Redis
) -> None:
    now = redis_ms(redis_client)
    store.park([marked_request("runs", now - 1000, "k", "until_finished", max_run_ms=HOUR)])
    store.park([marked_request("ends", now - 1000, "e", "until_finished", max_run_ms=0)])
    claimed = store.claim(0, limit=10, lease_ms=HOUR)
    assert store.ack(0, claimed.token, ["runs", "ends"]) == 2
    owner = key_owner(store, "k")
    assert owner is not None
    assert owner[0] == "runs"
    assert owner[1] is not None

    # Released and running: kept, and a replace cannot stop it
    assert store.park([marked_request("waits", now + HOUR, "k", "until_finished")]) == [
        Parked("runs", None, False)
    ]
    assert store.park([marked_request("replaces", now + HOUR, "k", "replace")]) == [
        Parked("replaces", now + HOUR, True)
    ]
    # A key whose run ended is free
    assert store.park([marked_request("after", now + HOUR, "e", "until_finished")]) == [
        Parked("after", now + HOUR, True)
    ]
    assert set(_parked(redis_client)) == {"replaces", "after"}
    assert key_owner(store, "e") == ("after", None)


def _released_and_running(store: Store, now: int, task_id: str, key: str) -> None:
    """Park *task_id* owning *key* until finished, then release it: it runs, owning the key."""
    store.park([marked_request(task_id, now - 1000, key, "until_finished", max_run_ms=HOUR)])
    claimed = store.claim(0, limit=10, lease_ms=HOUR)
    assert store.ack(0, claimed.token, [task_id]) == 1


def test_replace_leaves_parked_the_retry_of_an_owner_that_runs(
    store: Store, redis_client: redis.Redis
) -> None:
    now = redis_ms(redis_client)
    _released_and_running(store, now, "runs", "k")
    # The running task parks itself again under its id (a retry), without the key
    store.park([marked_request("runs", now + HOUR)])

    assert store.park([marked_request("new", now + HOUR, "k", "replace")]) == [
        Parked("new", now + HOUR, True)
    ]

    assert set(_parked(redis_client)) == {"runs", "new"}
    assert redis_client.hexists(SHARD0.msg, "runs")


def test_a_running_owner_parks_its_own_retry_under_its_key_and_no_one_else_does(
    store: Store, redis_client: redis.Redis
) -> None:
    now = redis_ms(redis_client)
    _released_and_running(store, now, "runs", "k")

    # The running task retries under its own id with its key (transparent
    # mode's retry(countdown=)): parked, and owning the key as parked
    assert store.park([marked_request("runs", now + HOUR, "k", "until_finished")]) == [
        Parked("runs", now + HOUR, True)
    ]
    assert set(_parked(redis_client)) == {"runs"}
    assert key_owner(store, "k") == ("runs", None)
    # while another id with the key is still kept out
    assert store.park([marked_request("other", now + HOUR, "k", "keep")]) == [
        Parked("runs", now + HOUR, False)
    ]
    assert set(_parked(redis_client)) == {"runs"}


# -- the index -----------------------------------------------------------------------


def test_an_id_parked_again_gives_up_its_old_key_and_tags(
    store: Store, redis_client: redis.Redis
) -> None:
    at = redis_ms(redis_client) + HOUR
    store.park(
        [
            marked_request("a", at, "old", "keep", ("t1", "t2")),
            marked_request("b", at, "b", "keep"),
        ],
    )

    assert store.park([marked_request("a", at + 1, "new", "replace", ("t2", "t3"))]) == [
        Parked("a", at + 1, True)
    ]
    assert key_owner(store, "old") is None
    assert key_owner(store, "new") == ("a", None)
    assert (tagged_ids(store, "t1"), tagged_ids(store, "t2"), tagged_ids(store, "t3")) == (
        [],
        ["a"],
        ["a"],
    )

    # Parked again under its id with no mark at all: no record left, nor key, nor tags
    assert store.park(
        [marked_request("a", at + 2), marked_request("b", at + 2, "b", "replace")]
    ) == [
        Parked("a", at + 2, True),
        Parked("b", at + 2, True),
    ]
    assert _marks(redis_client) == {"i:b": "r0\nb", "k:b": "b"}
    assert redis_client.zcard(SHARD0.tagged) == 0
    assert _parked(redis_client) == {"a": (at + 2) * 1024, "b": (at + 2) * 1024 + 1}
    assert check_marks(store) == []


def test_only_a_marked_entry_gets_a_record_and_each_tag_lists_it(
    store: Store, redis_client: redis.Redis
) -> None:
    at = redis_ms(redis_client) + HOUR
    reply = store.park(
        [
            marked_request("plain", at),
            marked_request("tagged", at, tags=("x", "y")),
            marked_request("one-tag", at, tags=("z",)),
            marked_request("keyed", at, "k"),
        ],
    )

    assert [p.parked for p in reply] == [True, True, True, True]
    assert _marks(redis_client) == {
        "i:tagged": "-0\n\nx\ny",
        "i:one-tag": "-0\n\nz",
        "i:keyed": "k0\nk",
        "k:k": "keyed",
    }
    # All scored 0: a tag's members are read by lexical range
    assert redis_client.zrange(SHARD0.tagged, 0, -1, withscores=True) == [
        (b"x\ntagged", 0),
        (b"y\ntagged", 0),
        (b"z\none-tag", 0),
    ]


def test_a_keyed_park_wakes_the_companions_when_the_earliest_due_time_moves_earlier(
    store: Store, redis_client: redis.Redis
) -> None:
    at = redis_ms(redis_client) + HOUR
    with wake_ups(redis_client) as seen:
        store.park([marked_request("later", at + 1000, "k1")])
        store.park(
            [marked_request("held", at, "k1"), marked_request("earlier", at, "k2", tags=("t",))],
        )
    assert seen == [str(at + 1000).encode(), str(at).encode()]


# -- retries and refusals --------------------------------------------------------------


def test_a_retried_call_answers_what_the_first_did_and_parks_nothing_again(
    store: Store, redis_client: redis.Redis, calls: list[tuple[object, ...]]
) -> None:
    at = redis_ms(redis_client) + HOUR
    store.park([marked_request("owner", at, "k")])
    first = store.park(
        [marked_request("a", at + 1, "k", "replace", ("t",)), marked_request("b", at, "k")]
    )
    assert first == [Parked("a", at + 1, True), Parked("a", at + 1, False)]
    # The replace took the owner out: the caller reports it cancelled.
    assert [p.replaced for p in first] == ["owner", None]
    park_call = calls[-1]
    marker = str(park_call[2 + 5])
    assert redis_client.pttl(marker) > 60_000
    # Cancelled meanwhile: the retry must not park it (nor its key, nor its tags) again
    assert store.cancel(["a"]) == [True]

    sha, numkeys, *rest = park_call
    retried = store.client.evalsha(sha, numkeys, *rest)

    assert [x.decode() if isinstance(x, bytes) else x for x in retried] == [
        "a",
        at + 1,
        1,
        "a",
        at + 1,
        0,
        "owner",
        "",
    ]
    assert redis_client.zcard(SHARD0.due) == 0
    assert _marks(redis_client) == {}
    assert redis_client.zcard(SHARD0.tagged) == 0


def test_a_call_without_its_entry_count_or_mark_records_is_refused_before_any_write(
    store: Store, redis_client: redis.Redis, calls: list[tuple[object, ...]]
) -> None:
    at = redis_ms(redis_client) + HOUR
    store.park([marked_request("a", at, "k", tags=("t",)), marked_request("b", at, "j")])
    sha, numkeys, *rest = calls[-1]
    store.cancel(["a", "b"])
    keys, args = rest[: int(numkeys)], rest[int(numkeys) :]
    if str(args[-1]).startswith(HISTORY_SENTINEL):
        # The history's key and argument ride last (lua/_history.lua takes
        # them off first): this test lays out the call without them.
        numkeys, keys, args = int(numkeys) - 1, keys[:-1], args[:-1]
    keys[5] = str(keys[5]) + ":again"  # a new call, not a retry

    with pytest.raises(redis.ResponseError, match="park_keyed: no entry count"):
        store.client.evalsha(sha, numkeys, *keys, *args[:-1], "two")
    # One mark record short: the last entry's fields would be read as records
    # (the call names no held set: 0 before the entry count)
    assert args[-2] == 0
    with pytest.raises(redis.ResponseError, match="park_keyed: 1 mark records for"):
        store.client.evalsha(sha, numkeys, *keys, *args[:-3], 0, 1)
    with pytest.raises(redis.ResponseError, match="park_keyed: no held set count"):
        store.client.evalsha(sha, numkeys, *keys, *args[:-2], 2)
    with pytest.raises(redis.ResponseError, match="park_keyed: 3 mark records for"):
        store.client.evalsha(sha, numkeys, *keys, *args[:-1], 3)

    assert redis_client.zcard(SHARD0.due) == redis_client.hlen(SHARD0.msg) == 0
    assert _marks(redis_client) == {}
    assert not redis_client.exists(keys[5])


@pytest.mark.parametrize(("key", "kind"), [(SHARD0.marks, "hash"), (SHARD0.tagged, "zset")])
def test_a_marks_key_of_another_type_refuses_the_park_with_the_fix_and_writes_nothing(
    store: Store, redis_client: redis.Redis, key: str, kind: str
) -> None:
    at = redis_ms(redis_client) + HOUR
    redis_client.set(key, "something else wrote this")

    with pytest.raises(StoreRefusedError, match=rf"holds a string, not a {kind}: something else"):
        store.park([marked_request("a", at, "k", tags=("t",))])

    assert redis_client.get(key) == b"something else wrote this"
    assert redis_client.zcard(SHARD0.due) == redis_client.hlen(SHARD0.msg) == 0


def test_a_due_key_of_another_type_refuses_the_park_before_the_marks_are_written(
    store: Store, redis_client: redis.Redis
) -> None:
    at = redis_ms(redis_client) + HOUR
    store.park([marked_request("owner", at, "k", "keep", ("t",))])
    redis_client.rename(SHARD0.due, "saved-due")
    redis_client.set(SHARD0.due, "something else wrote this")

    with pytest.raises(StoreRefusedError, match=r"holds a string, not a zset: something else"):
        store.park([marked_request("owner", at, "new", "replace", ("u",))])

    assert _marks(redis_client) == {"i:owner": "k0\nk\nt", "k:k": "owner"}
