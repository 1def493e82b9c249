"""A stale entry dropped leaves the store whole: its template's count, once, and nothing forged.

Pins ``store/lua/drop_stale.lua`` (see docs/mutation.rst) through
:meth:`Store.drop_stale` on a private Redis, no companion: the template a
dropped entry referred to counts one reference less (in the templates
hash, nowhere else), an id given twice is dropped and counted once, a
dropped entry's key and tags leave with it (and another entry's stay), and
a key of another type refuses the call before anything is written.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
import redis
from celery import Celery

from celery_zdelay.errors import StoreRefusedError
from celery_zdelay.store import Store
from celery_zdelay.store.marks import key_owner, tagged_ids
from tests.support.keys import SHARD0

pytestmark = pytest.mark.timeout(60)


def _ago(seconds: float) -> datetime:
    return datetime.now(timezone.utc) - timedelta(seconds=seconds)


def _counts(client: redis.Redis) -> dict[str, int]:
    """The templates' reference counts: the "#<id>" fields of the templates hash."""
    return {
        field.decode(): int(value)
        for field, value in client.hgetall(SHARD0.templates).items()
        if field.startswith(b"#")
    }


def test_a_dropped_entry_counts_one_reference_less_once_even_when_named_twice(
    app: Celery, store: Store, redis_client: redis.Redis
) -> None:
    # Given three stale calls of one task, sharing one template
    record = app.tasks["tests.record"]
    parked = [record.apply_delayed((i,), eta=_ago(120), max_late=60) for i in range(3)]
    before = _counts(redis_client)
    ((template, count),) = before.items()
    assert count == 3
    marks_before = redis_client.hgetall(SHARD0.marks)
    claim = store.claim(0, limit=10, lease_ms=30_000)

    # When one is dropped, named twice in the call
    assert store.drop_stale(0, claim.token, [parked[0].id, parked[0].id]) == [parked[0].id]

    # Then its template counts one less, and nothing else was written beside it
    assert _counts(redis_client) == {template: 2}
    assert redis_client.hgetall(SHARD0.marks) == marks_before
    # And the two others are still in flight under the claim
    assert redis_client.zcard(SHARD0.lease) == 2


def test_a_dropped_entry_takes_its_key_and_tags_with_it_and_leaves_the_others(
    app: Celery, store: Store, redis_client: redis.Redis
) -> None:
    # Given two stale calls in flight, each with a key and a tag
    record = app.tasks["tests.record"]
    dropped = record.apply_delayed((1,), eta=_ago(120), max_late=60, key="k1", tags=["t1"])
    kept = record.apply_delayed((2,), eta=_ago(120), max_late=60, key="k2", tags=["t2"])
    claim = store.claim(0, limit=10, lease_ms=30_000)

    # When the first alone is dropped (mutant: the ids read from the second on)
    assert store.drop_stale(0, claim.token, [dropped.id]) == [dropped.id]

    # Then its key and tag are gone, and the other's are where they were
    # (mutants: the marks or tag index read from another key)
    assert key_owner(store, "k1") is None
    assert tagged_ids(store, "t1") == []
    assert key_owner(store, "k2") == (kept.id, None)
    assert tagged_ids(store, "t2") == [kept.id]


def test_a_key_of_another_type_refuses_the_drop_before_any_write(
    app: Celery, store: Store, redis_client: redis.Redis
) -> None:
    parked = app.tasks["tests.record"].apply_delayed((1,), eta=_ago(120), max_late=60)
    claim = store.claim(0, limit=10, lease_ms=30_000)
    redis_client.delete(SHARD0.templates)
    redis_client.set(SHARD0.templates, "someone else's")

    # (the guard's words, which say what to do; not Redis's own WRONGTYPE)
    with pytest.raises(StoreRefusedError, match="something else wrote it"):
        store.drop_stale(0, claim.token, [parked.id])
    assert redis_client.zscore(SHARD0.lease, parked.id) is not None
    assert redis_client.hexists(SHARD0.msg, parked.id)
