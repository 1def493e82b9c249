"""adopt_once.lua: a message ``zdelay adopt`` took from a broker queue is parked once.

``zdelay adopt`` parks a message, then acknowledges it to the broker; a run
killed between the two leaves it in the queue, and the next run reads it
again, maybe after its parked copy was released and ran. The script
remembers each adopted message (id and fingerprint) in the step that parks
it, so the copy is not parked twice; it neither replaces nor remembers an
entry parked under the id by other means; everything it checks is checked
before its first write. On a real Redis, through the store's own calls.
Its argument check and its key type check are pinned against the mutants
that survived the first tests (docs/mutation.rst, ``adopt_once.lua``).
"""

from __future__ import annotations

import pytest
import redis
from celery import Celery

import celery_zdelay
from celery_zdelay.app_state import store_for
from celery_zdelay.errors import ZDelayError
from celery_zdelay.schedule import Due
from celery_zdelay.store import ParkRequest, Store
from celery_zdelay.store import adopted as adopted_module
from celery_zdelay.store.adopted import (
    ADOPTED,
    ADOPTED_BEFORE,
    ID_TAKEN,
    Adoption,
    adopt_once,
    adopted_among,
)
from celery_zdelay.testing import RedisServer
from tests.conftest import AppFactory
from tests.helpers import wait_for
from tests.servers import LocalCluster
from tests.support.keys import SHARD0
from tests.support.store import PAYLOAD

pytestmark = pytest.mark.timeout(60)


def _adoption(store: Store, task_id: str, fingerprint: str, ahead_ms: int = 60_000) -> Adoption:
    due = Due("a", store.time_ms() + ahead_ms)
    return Adoption(ParkRequest(task_id, due, PAYLOAD), fingerprint)


def _parked(redis_client: redis.Redis) -> list[str]:
    return [member.decode() for member in redis_client.zrange(SHARD0.due, 0, -1)]


def test_a_message_adopted_again_is_not_parked_again_even_once_its_entry_is_gone(
    store: Store, redis_client: redis.Redis
) -> None:
    # Given a message adopted once
    assert adopt_once(store, [_adoption(store, "t1", "f1")]) == [ADOPTED]
    assert _parked(redis_client) == ["t1"]

    # When the same message is adopted again, while parked and after its entry left
    again_parked = adopt_once(store, [_adoption(store, "t1", "f1")])
    store.cancel(["t1"])
    again_gone = adopt_once(store, [_adoption(store, "t1", "f1")])

    # Then both times it is a copy of one adopted before: nothing parked again
    # (breaks if adopt_once.lua no longer looks for its record)
    assert again_parked == again_gone == [ADOPTED_BEFORE]
    assert _parked(redis_client) == []


def test_a_retry_of_an_adopted_task_has_another_fingerprint_and_is_adopted(
    store: Store, redis_client: redis.Redis
) -> None:
    adopt_once(store, [_adoption(store, "t1", "f1")])
    store.cancel(["t1"])  # released and ran; the task retried, natively

    assert adopt_once(store, [_adoption(store, "t1", "f2")]) == [ADOPTED]
    assert _parked(redis_client) == ["t1"]


def test_an_entry_parked_under_the_id_by_other_means_is_neither_replaced_nor_remembered(
    store: Store, redis_client: redis.Redis
) -> None:
    # Given an entry parked under t1 by apply_delayed (another payload)
    other = b'{"v":1}\nother'
    store.park([ParkRequest("t1", Due("a", store.time_ms() + 5_000), other)])

    # When a message of that id is adopted
    outcome = adopt_once(store, [_adoption(store, "t1", "f1")])

    # Then the entry stays as it was, and the message is not remembered: once
    # that entry is gone, adopting the message parks it
    # (breaks if adopt_once.lua no longer checks the id's payload)
    assert outcome == [ID_TAKEN]
    assert redis_client.hget(SHARD0.msg, "t1").endswith(b"\nother")
    assert redis_client.zcard(SHARD0.adopted) == 0
    store.cancel(["t1"])
    assert adopt_once(store, [_adoption(store, "t1", "f1")]) == [ADOPTED]


def test_a_record_is_forgotten_once_its_time_has_passed(
    store: Store, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given records kept 1 ms after the due time, and a message adopted due in 50 ms
    monkeypatch.setattr(adopted_module, "REMEMBER_MS", 1)
    adopt_once(store, [_adoption(store, "t1", "f1", ahead_ms=50)])
    store.cancel(["t1"])
    (score,) = [s for _, s in redis_client.zrange(SHARD0.adopted, 0, -1, withscores=True)]
    wait_for(lambda: store.time_ms() > score, message="the record's time to pass")

    # Then it is forgotten: the reading says so, and adopting it parks it
    # (breaks if adopt_once.lua stops dropping records past their time)
    assert adopted_among(store, [("t1", "f1")]) == [None]
    assert adopt_once(store, [_adoption(store, "t1", "f1")]) == [ADOPTED]


def test_the_dry_run_reading_agrees_with_the_script(store: Store) -> None:
    store.park([ParkRequest("other", Due("a", store.time_ms() + 5_000), PAYLOAD)])
    adopt_once(store, [_adoption(store, "t1", "f1")])

    found = adopted_among(store, [("t1", "f1"), ("t1", "f2"), ("other", "f1"), ("t3", "f1")])

    assert found == [ADOPTED_BEFORE, ID_TAKEN, ID_TAKEN, None]


def test_nothing_is_remembered_when_the_park_would_fail_and_nothing_parked_when_the_record_would(
    store: Store, redis_client: redis.Redis
) -> None:
    # Given the due set made a string by someone else
    redis_client.set(SHARD0.due, "not a zset")

    # When a message is adopted, it is refused before anything is written
    # (breaks if adopt_once.lua writes its record before checking park.lua's keys)
    with pytest.raises(ZDelayError):
        adopt_once(store, [_adoption(store, "t1", "f1")])
    assert redis_client.exists(SHARD0.adopted, SHARD0.msg) == 0

    # Given the record set made a string instead
    redis_client.delete(SHARD0.due)
    redis_client.set(SHARD0.adopted, "not a zset")
    # (the error names the key and what to do: breaks if its type is not checked)
    with pytest.raises(ZDelayError, match="holds a string, not a zset"):
        adopt_once(store, [_adoption(store, "t1", "f1")])
    assert redis_client.exists(SHARD0.due, SHARD0.msg) == 0


def test_its_history_says_it_was_parked_by_an_adopt(store: Store, app: Celery) -> None:
    adopt_once(store, [_adoption(store, "t1", "f1")])

    (event,) = celery_zdelay.history("t1", app=app)

    assert (event.event, event.call) == ("parked", "adopted")


def test_many_messages_over_shards_are_adopted_in_one_call(make_test_app: AppFactory) -> None:
    app = make_test_app(conf={"zdelay_shards": 4})
    store = store_for(app)
    adoptions = [_adoption(store, f"t{n}", "f") for n in range(40)]

    assert adopt_once(store, adoptions) == [ADOPTED] * 40
    assert adopt_once(store, adoptions) == [ADOPTED_BEFORE] * 40
    assert sorted(store.shard_of(a.request.task_id) for a in adoptions) != [0] * 40


def test_on_a_redis_cluster_each_message_is_adopted_once_on_its_shards_node(
    make_test_app: AppFactory, cluster: LocalCluster, broker_server: RedisServer
) -> None:
    app = make_test_app(
        broker=f"{broker_server.url}/0",
        conf={"zdelay_redis_url": cluster.url, "zdelay_shards": 6},
    )
    store = store_for(app)
    assert store.cluster
    adoptions = [_adoption(store, f"t{n}", "f") for n in range(12)]

    assert adopted_among(store, [("t0", "f"), ("t5", "f")]) == [None, None]
    assert adopt_once(store, adoptions) == [ADOPTED] * 12
    assert adopt_once(store, adoptions) == [ADOPTED_BEFORE] * 12
    assert adopted_among(store, [("t0", "f"), ("t5", "g")]) == [ADOPTED_BEFORE, ID_TAKEN]
    assert len({store.shard_of(a.request.task_id) for a in adoptions}) > 1


def test_a_call_without_exactly_one_entry_its_fingerprint_and_keep_time_writes_nothing(
    store: Store, redis_client: redis.Redis
) -> None:
    # Given the arguments of one adoption, as adopt_once builds them
    keys, args = store.park_arguments(0, [_adoption(store, "t1", "f1").request])
    keys = [*keys, store.keys(0).adopted]
    two_entries = [*args, *args[-5:]]

    # When the script is called with two entries, without the fingerprint or
    # the time to keep it, with a time that is no number or a relative due
    # time, then it refuses
    # and writes nothing (breaks if the argument check is removed, or an "or"
    # of it made "and")
    relative = store.park_arguments(0, [ParkRequest("t1", Due("r", 60_000), PAYLOAD)])[1]
    for bad in (
        [*two_entries, "f1", "60000"],
        [*args, "60000"],
        [*args],
        [*args, "f1", "soon"],
        [*relative, "f1", "60000"],  # adopt parks at the message's eta, never relative
    ):
        with pytest.raises(redis.ResponseError, match="one entry at an absolute due time"):
            store.scripts.adopt_once(keys=keys, args=bad)
    assert _parked(redis_client) == []
    assert redis_client.zcard(store.keys(0).adopted) == 0
