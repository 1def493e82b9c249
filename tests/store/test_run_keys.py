"""A finished run frees only its own key; a periodic run takes its schedule's key, waits or skips.

Pins the lines of ``store/lua/finish_key.lua`` and ``store/lua/start_run.lua``
(see docs/mutation.rst) through :func:`finish_key` and :func:`start_run` on a
private Redis, no worker or companion.

``finish_key``: a worker that ran an ``until_finished`` task frees the key
its released entry owns, and nothing else: not a key another entry owns,
not the key its own id owns again once parked again (a retry), and when it
finished before the companion acknowledged the release it leaves
``"<id>\\n0"`` (a run that ended) for the ack to remove.

``start_run``: the first run takes the schedule's key for its max run ms, on the
Redis clock; while it owns it, ``skip`` skips the next run and
``buffer_one`` lets one run wait and skips the others; the waiting run
takes the key once the run before it finished, and only then gives up its
wait; a key whose run ended, or the run's own, blocks nothing; an entry parked
under the key owns it too. Both refuse a marks key of another type before
writing.

The scripts' replies are read as their headers document them too (1 and
0), where the store's functions turn them into a bool.
"""

from __future__ import annotations

import pytest
import redis
from celery import Celery

from celery_zdelay.parking import store_for
from celery_zdelay.periodic.overlap import overlap_key
from celery_zdelay.schedule import Due
from celery_zdelay.store import ParkRequest, Store
from celery_zdelay.store.marks import (
    Mark,
    check_marks,
    finish_key,
    key_owner,
    start_run,
)
from tests.support.clock import redis_ms
from tests.support.keys import SHARD0, refused_while_written_over
from tests.support.store import is_parked

pytestmark = pytest.mark.timeout(60)

PAYLOAD = b'{"v":1}\nbody'
HOUR = 3_600_000
#: A periodic schedule's key, as an overlap policy takes it.
SCHEDULE = overlap_key("nightly")


@pytest.fixture
def store(app: Celery) -> Store:
    return store_for(app)


def _park(
    store: Store, task_id: str, due_ms: int, key: str, on_key: str = "until_finished"
) -> None:
    mark = Mark(key, on_key, (), HOUR)
    store.park([ParkRequest(task_id, Due("a", due_ms), PAYLOAD, mark=mark)])


def _released(store: Store, task_id: str, key: str, *, acked: bool = True) -> None:
    """Park *task_id* owning *key* until finished, due now, and release it (generic path).

    *acked*: the companion's ack came (the key stays taken for its max run ms),
    else the entry is still leased, its key owned as parked.
    """
    _park(store, task_id, redis_ms(store.client) - 1000, key)
    claimed = store.claim(0, limit=10, lease_ms=HOUR)
    assert [e.task_id for e in claimed.entries] == [task_id]
    if acked:
        assert store.ack(0, claimed.token, [task_id]) == 1


def _finish_reply(store: Store, key: str, task_id: str) -> object:
    """finish_key.lua's reply itself (:func:`finish_key` makes it a bool)."""
    keys = store.keys(store.shard_of(key))
    return store.scripts.finish_key(
        keys=[keys.marks, keys.due, keys.lease, keys.msg], args=[key, task_id]
    )


def _marks(client: redis.Redis) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in client.hgetall(SHARD0.marks).items()}


# -- finish_key.lua ---------------------------------------------------------------------


def test_a_finished_run_frees_its_own_running_key_and_answers_1(
    store: Store, redis_client: redis.Redis
) -> None:
    # Breaks if: redis.call('HDEL', marks, 'k:' .. key) is deleted, `return 1`
    # (line 15) is deleted (the key would be left as "<id>\n0") or made 2,
    # or ARGV[1] / ARGV[2] is read one further.
    _released(store, "runs", "import:7")
    _released(store, "other", "import:8")
    before = key_owner(store, "import:8")

    assert _finish_reply(store, "import:7", "runs") == 1

    assert key_owner(store, "import:7") is None
    assert key_owner(store, "import:8") == before
    assert check_marks(store) == []
    # The key is free: the next call under it parks its own entry
    _park(store, "next", redis_ms(redis_client) + HOUR, "import:7")
    assert key_owner(store, "import:7") == ("next", None)


def test_a_run_frees_no_key_another_entry_owns_running_or_parked(
    store: Store, redis_client: redis.Redis
) -> None:
    # Breaks if: `owner ~= id` is made `==`, or its `return 0` made 1.
    _released(store, "runs", "import:7")
    _park(store, "parked", redis_ms(redis_client) + HOUR, "import:8")
    before = _marks(redis_client)

    assert _finish_reply(store, "import:7", "someone-else") == 0
    assert finish_key(store, "import:8", "someone-else") is False
    assert finish_key(store, "nobody:owns", "someone-else") is False

    assert _marks(redis_client) == before


def test_a_retry_parked_again_under_its_id_keeps_the_key_when_the_first_run_finishes(
    store: Store, redis_client: redis.Redis
) -> None:
    # Breaks if: the ZSCORE check's `return 0` is made 1.
    # Given a released run that parks itself again under its id and key (a retry)
    _released(store, "runs", "import:7")
    _park(store, "runs", redis_ms(redis_client) + HOUR, "import:7")
    assert key_owner(store, "import:7") == ("runs", None)

    # When the first run finishes, the parked retry still owns the key
    assert _finish_reply(store, "import:7", "runs") == 0

    assert key_owner(store, "import:7") == ("runs", None)
    assert is_parked(store, "runs")
    assert check_marks(store) == []


def test_a_run_finished_before_its_release_is_acknowledged_frees_the_key_for_the_ack_to_forget(
    store: Store, redis_client: redis.Redis
) -> None:
    # Breaks if: redis.call('HSET', marks, 'k:' .. key, id .. '\n0') is
    # deleted, or the `return 1` after it deleted or made 2, or KEYS[1] read
    # as KEYS[2].
    # Given an entry released through the generic path, run by a worker
    # before the companion acknowledged the release
    _released(store, "runs", "import:7", acked=False)
    assert key_owner(store, "import:7") == ("runs", None)

    # When the worker finishes it, its key's run ended at 0: free
    assert _finish_reply(store, "import:7", "runs") == 1
    assert redis_client.hget(SHARD0.marks, "k:import:7") == b"runs\n0"
    assert key_owner(store, "import:7") == ("runs", 0)

    # and the ack removes it, rather than keeping the key for its max run ms
    (token,) = {int(v.split()[1]) for v in redis_client.hvals(SHARD0.leased)}
    assert store.ack(0, token, ["runs"]) == 1
    assert key_owner(store, "import:7") is None
    assert _marks(redis_client) == {}


@pytest.mark.parametrize(("key", "kind"), [(SHARD0.marks, "hash"), (SHARD0.due, "zset")])
def test_a_marks_or_due_key_of_another_type_refuses_finish_before_writing(
    store: Store, redis_client: redis.Redis, key: str, kind: str
) -> None:
    # Breaks if: zdelay_expect(marks, 'hash', due, 'zset') is deleted.
    _released(store, "runs", "import:7", acked=False)
    before = _marks(redis_client)

    with refused_while_written_over(redis_client, key, kind):
        finish_key(store, "import:7", "runs")

    assert _marks(redis_client) == before


# -- start_run.lua -----------------------------------------------------------------------


def _start(store: Store, task_id: str, policy: str = "skip", max_run_ms: int = HOUR) -> object:
    return start_run(store, SCHEDULE, task_id, max_run_ms=max_run_ms, policy=policy)


def _ends(redis_client: redis.Redis, field: str, task_id: str) -> int:
    """When the run (or wait) recorded in marks *field* for *task_id* ends."""
    value = redis_client.hget(SHARD0.marks, field)
    assert value is not None, f"no {field!r}"
    owner, _, until = value.decode().partition("\n")
    assert owner == task_id
    return int(until)


def test_the_first_run_takes_the_schedules_key_for_its_max_run_on_the_redis_clock(
    store: Store, redis_client: redis.Redis
) -> None:
    # Breaks if: the key's HSET is deleted, `return {'run'}` is deleted,
    # `not owner` loses its `not`, `now_ms + max_run_ms` is made `-`, or
    # ARGV[1], ARGV[2] or ARGV[3] is read one further.
    before = redis_ms(redis_client)
    assert _start(store, "run-1", max_run_ms=90_000) == ("run", None)
    after = redis_ms(redis_client)

    assert set(_marks(redis_client)) == {"k:" + SCHEDULE}
    assert before + 90_000 <= _ends(redis_client, "k:" + SCHEDULE, "run-1") <= after + 90_000


def test_skip_skips_a_run_starting_while_another_owns_the_key_and_writes_nothing(
    store: Store, redis_client: redis.Redis
) -> None:
    # Breaks if: `owner ~= id` is made `==`, the policy test `==` made `~=`
    # or its `and` made `or`, or `return {'skip', owner}` is deleted.
    assert _start(store, "run-1") == ("run", None)
    before = _marks(redis_client)

    assert _start(store, "run-2") == ("skip", "run-1")
    assert _start(store, "run-3") == ("skip", "run-1")

    assert _marks(redis_client) == before


def test_buffer_one_lets_one_run_wait_for_the_key_and_skips_the_others(
    store: Store, redis_client: redis.Redis
) -> None:
    # Breaks if: the buffered slot's HSET is deleted, `return {'wait',
    # owner}` is deleted, the `not` of `not live(...)` dropped, or ARGV[4]
    # read as ARGV[5].
    assert _start(store, "run-1", "buffer_one") == ("run", None)

    before = redis_ms(redis_client)
    assert _start(store, "run-2", "buffer_one", max_run_ms=60_000) == ("wait", "run-1")
    after = redis_ms(redis_client)
    assert before + 60_000 <= _ends(redis_client, "b:" + SCHEDULE, "run-2") <= after + 60_000
    # The waiting run asks again (as it polls): still the one waiting
    assert _start(store, "run-2", "buffer_one") == ("wait", "run-1")
    # A third is skipped: one run waits at most
    assert _start(store, "run-3", "buffer_one") == ("skip", "run-1")
    _ends(redis_client, "b:" + SCHEDULE, "run-2")


def test_the_waiting_run_takes_the_key_once_the_run_before_finished_and_gives_up_its_wait(
    store: Store, redis_client: redis.Redis
) -> None:
    # Breaks if: redis.call('HDEL', marks, buffered) is deleted, or the
    # buffered owner's `== id` made `~=`.
    assert _start(store, "run-1", "buffer_one") == ("run", None)
    assert _start(store, "run-2", "buffer_one") == ("wait", "run-1")
    assert finish_key(store, SCHEDULE, "run-1") is True

    assert _start(store, "run-2", "buffer_one") == ("run", None)

    assert set(_marks(redis_client)) == {"k:" + SCHEDULE}
    _ends(redis_client, "k:" + SCHEDULE, "run-2")
    # The slot is free again: the next run waits for this one
    assert _start(store, "run-3", "buffer_one") == ("wait", "run-2")


def test_another_run_taking_the_freed_key_leaves_the_waiting_run_its_wait(
    store: Store, redis_client: redis.Redis
) -> None:
    # Breaks if: the buffered owner's `== id` is made `~=`.
    assert _start(store, "run-1", "buffer_one") == ("run", None)
    assert _start(store, "run-2", "buffer_one") == ("wait", "run-1")
    waits_until = _ends(redis_client, "b:" + SCHEDULE, "run-2")
    assert finish_key(store, SCHEDULE, "run-1") is True

    # run-3 starts first (another worker) and takes the key
    assert _start(store, "run-3", "buffer_one") == ("run", None)

    assert _ends(redis_client, "b:" + SCHEDULE, "run-2") == waits_until
    assert _start(store, "run-4", "buffer_one") == ("skip", "run-3")


def test_a_key_whose_run_ended_blocks_no_run_and_a_run_started_again_takes_its_own_key(
    store: Store, redis_client: redis.Redis
) -> None:
    # Breaks if: the second `and` of live() is made `or` (an ended run
    # blocks), or its first `and` made `or` (the run's own key blocks it).
    now = redis_ms(redis_client)
    redis_client.hset(SHARD0.marks, "k:" + SCHEDULE, f"crashed\n{now - 1000}")
    redis_client.hset(SHARD0.marks, "b:" + SCHEDULE, f"waited\n{now - 1000}")

    assert _start(store, "run-1", "buffer_one") == ("run", None)
    assert _start(store, "run-2", "buffer_one") == ("wait", "run-1")
    first = _ends(redis_client, "k:" + SCHEDULE, "run-1")

    # The same occurrence delivered again (same id) runs, its end renewed
    assert _start(store, "run-1", "buffer_one") == ("run", None)
    assert _ends(redis_client, "k:" + SCHEDULE, "run-1") >= first


def test_a_run_ending_in_a_ms_no_longer_blocks_a_run_starting_in_that_ms(
    store: Store, redis_client: redis.Redis
) -> None:
    # Breaks if: `until_ms > now_ms` is made `>=`. As park_keyed.lua, a run
    # ending at ms T is over at T. Each attempt calls start_run (max run 0: the
    # run's own key is freed when it starts) until it runs: once a call lands in
    # ms T, the run records T. Under `>=` it never can.
    for _ in range(50):
        end = redis_ms(redis_client) + 2
        redis_client.hset(SHARD0.marks, "k:" + SCHEDULE, f"before\n{end}")
        while _start(store, "run-1", max_run_ms=0) != ("run", None):
            pass  # bounded: the Redis clock passes *end* within a few ms
        ran_at = _ends(redis_client, "k:" + SCHEDULE, "run-1")
        assert ran_at >= end
        if ran_at == end:
            return
    pytest.fail("no run started in the ms its predecessor's run ended, in 50 attempts")


def test_an_entry_parked_under_the_key_owns_it_against_a_run(
    store: Store, redis_client: redis.Redis
) -> None:
    # Breaks if: `until_ms == nil` is made `~=`, or the `or` after it made
    # `and` (both compare nil with a number, and the script fails).
    _park(store, "parked", redis_ms(redis_client) + HOUR, SCHEDULE, "keep")
    before = _marks(redis_client)

    assert _start(store, "run-1") == ("skip", "parked")
    assert _start(store, "run-1", "buffer_one") == ("wait", "parked")

    assert _marks(redis_client)["k:" + SCHEDULE] == before["k:" + SCHEDULE]


def test_a_marks_key_of_another_type_refuses_start_before_writing(
    store: Store, redis_client: redis.Redis
) -> None:
    # Breaks if: zdelay_expect(marks, 'hash') is deleted.
    with refused_while_written_over(redis_client, SHARD0.marks, "hash"):
        _start(store, "run-1")
