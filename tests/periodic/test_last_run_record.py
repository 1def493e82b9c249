"""The last run of a schedule is recorded once, and only over an older one.

Pins the lines of ``periodic/lua/record_runs.lua`` (see docs/mutation.rst)
through :meth:`PeriodicStore.record_runs` on a private Redis, no worker or
companion: a run is recorded when none is, when the one stored cannot be
read (not JSON, not an object, no time), or when it is older; never over
one as new or newer, so a run two companions record counts once; every
pair of one call is read; and a key of another type refuses the call
before anything is written.
"""

from __future__ import annotations

import json

import pytest
import redis
from celery import Celery

from celery_zdelay.errors import StoreRefusedError
from celery_zdelay.parking import store_for
from celery_zdelay.periodic.store import PeriodicStore

pytestmark = pytest.mark.timeout(60)


def _run(ms: int, by: str = "c1") -> str:
    return json.dumps({"ms": ms, "lateness_ms": 3, "id": f"periodic:a:{ms}", "by": by})


@pytest.fixture
def periodic(app: Celery) -> PeriodicStore:
    return PeriodicStore(store_for(app))


def _stored(periodic: PeriodicStore, redis_client: redis.Redis) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in redis_client.hgetall(periodic.keys.runs).items()}


def test_a_run_is_recorded_only_over_an_older_one_and_once(
    periodic: PeriodicStore, redis_client: redis.Redis
) -> None:
    assert periodic.record_runs({"a": _run(1000), "b": _run(500)}) == ["a", "b"]

    # Another companion records the same runs: not again; newer ones: yes
    assert periodic.record_runs({"a": _run(1000, by="c2"), "b": _run(501)}) == ["b"]
    assert periodic.record_runs({"a": _run(999), "c": _run(7), "b": _run(501, by="c2")}) == ["c"]

    assert _stored(periodic, redis_client) == {"a": _run(1000), "b": _run(501), "c": _run(7)}


@pytest.mark.parametrize(
    "stored",
    ["not json", "5", '"text"', '{"lateness_ms": 3}', '{"ms": "soon"}', "[1, 2]"],
)
def test_a_run_is_recorded_over_one_that_cannot_be_read(
    periodic: PeriodicStore, redis_client: redis.Redis, stored: str
) -> None:
    redis_client.hset(periodic.keys.runs, "a", stored)

    assert periodic.record_runs({"a": _run(1)}) == ["a"]

    assert _stored(periodic, redis_client) == {"a": _run(1)}


def test_a_key_of_another_type_refuses_the_record_and_writes_nothing(
    periodic: PeriodicStore, redis_client: redis.Redis
) -> None:
    redis_client.set(periodic.keys.runs, "something else wrote this")

    with pytest.raises(StoreRefusedError, match=r"holds a string, not a hash: something else"):
        periodic.record_runs({"a": _run(1)})

    assert redis_client.get(periodic.keys.runs) == b"something else wrote this"
