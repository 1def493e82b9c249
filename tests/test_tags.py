"""Tags: find and steer parked work by business key, exactly, whatever happens to it."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

import pytest
import redis
from celery import Celery

import celery_zdelay
from celery_zdelay.cli import EXIT_OK
from celery_zdelay.companion import Companion
from celery_zdelay.parking import store_for
from celery_zdelay.store import admin
from celery_zdelay.store.dead_reason import DeadReason
from celery_zdelay.store.marks import (
    check_marks,
    key_owner,
    repair_marks,
    tag_count,
    tagged_ids,
)
from celery_zdelay.testing import RedisServer
from tests.helpers import CeleryProcess, Runs, wait_for
from tests.servers import LocalCluster
from tests.support.cli import run
from tests.support.keys import SHARD0, forged_tag, keys_of

pytestmark = pytest.mark.timeout(180)


def _index_empty(client: redis.Redis, shards: int) -> bool:
    return all(client.exists(keys_of(s).marks, keys_of(s).tagged) == 0 for s in range(shards))


def _park_orders(app: Celery, n: int) -> dict[int, list[str]]:
    """Park *n* tasks, task i tagged order:<i % 3> and (even i) 'even'; return ids per order."""
    record = app.tasks["tests.record"]
    by_order: dict[int, list[str]] = {0: [], 1: [], 2: []}
    for i in range(n):
        tags = [f"order:{i % 3}", *(["even"] if i % 2 == 0 else [])]
        by_order[i % 3].append(record.apply_delayed((i,), countdown=3600, tags=tags).id)
    return by_order


def test_tag_operations_are_exact_across_four_shards(
    make_test_app: Callable[..., Celery], redis_client: redis.Redis
) -> None:
    # Given 90 tasks over 4 shards, tagged by order (and some 'even')
    app = make_test_app(conf={"zdelay_shards": 4})
    by_order = _park_orders(app, 90)
    store = store_for(app)
    assert sorted(tagged_ids(store, "order:1")) == sorted(by_order[1])
    assert [tag_count(store, t) for t in ("order:1", "even", "order:9")] == [30, 45, 0]
    found = celery_zdelay.lookup(by_order[0][0], app=app)
    assert found is not None
    assert found.tags == ("order:0", "even")

    # When order 1 is cancelled and order 2 made due now
    assert celery_zdelay.cancel_matching(tag="order:1", app=app) == 30
    assert celery_zdelay.reschedule_matching(tag="order:2", countdown=0, app=app) == 30

    # Then exactly those moved, and the index follows every change
    assert tagged_ids(store, "order:1") == []
    assert tag_count(store, "order:1") == 0
    assert all(celery_zdelay.lookup(i, app=app) is None for i in by_order[1])
    with Companion(app) as companion:
        assert companion.release_due().released == 30
    assert tagged_ids(store, "order:2") == []
    assert sorted(tagged_ids(store, "order:0")) == sorted(by_order[0])
    assert celery_zdelay.cancel_matching(tag="even", dry_run=True, app=app) == 15
    assert check_marks(store) == []
    assert celery_zdelay.cancel_matching(tag="order:0", app=app) == 30
    assert _index_empty(redis_client, 4)


def test_the_cli_lists_and_cancels_by_tag_and_json_shows_tags_and_key(app: Celery) -> None:
    record = app.tasks["tests.record"]
    tagged = record.apply_delayed((1,), countdown=3600, key="pay:42", tags=["order:42"])
    record.apply_delayed((2,), countdown=3600, tags=["order:43"])

    listed = run(app, "list", "--tag", "order:42", "--json")
    assert listed.exit_code == EXIT_OK, listed.output
    (entry,) = json.loads(listed.stdout)["entries"]
    assert (entry["id"], entry["key"], entry["tags"]) == (tagged.id, "pay:42", ["order:42"])

    cancelled = run(app, "cancel", "--tag", "order:42")
    assert cancelled.exit_code == EXIT_OK
    assert "cancelled 1 parked task" in cancelled.output
    assert [e.tags for e in admin.list_parked(store_for(app)).entries] == [("order:43",)]


def test_the_cli_counts_and_reschedules_by_tag_and_refuses_a_tag_no_task_can_carry(
    app: Celery,
) -> None:
    # Given three tasks of order 42 and one of order 43, due in an hour
    record = app.tasks["tests.record"]
    ids = [record.apply_delayed((i,), countdown=3600, tags=["order:42"]).id for i in range(3)]
    other = record.apply_delayed((9,), countdown=3600, tags=["order:43"])

    # When counted, then moved to a minute from now by tag
    counted = run(app, "reschedule", "--tag", "order:42", "--countdown", "1m", "--dry-run")
    assert "would reschedule 3 parked tasks (dry run)" in counted.output
    assert (
        "would cancel 3 parked tasks" in run(app, "cancel", "--tag", "order:42", "--dry-run").output
    )
    before_ms = store_for(app).time_ms()
    moved = run(app, "reschedule", "--tag", "order:42", "--countdown", "1m")

    # Then exactly those moved, and the other order kept its time
    assert moved.exit_code == EXIT_OK, moved.output
    assert "rescheduled 3 parked tasks" in moved.output
    for task_id in ids:
        found = celery_zdelay.lookup(task_id, app=app)
        assert found is not None
        assert found.due_ms is not None
        assert before_ms + 60_000 <= found.due_ms <= store_for(app).time_ms() + 60_000
    kept = celery_zdelay.lookup(other.id, app=app)
    assert kept is not None
    assert kept.due_ms is not None
    assert kept.due_ms > before_ms + 3_000_000
    assert check_marks(store_for(app)) == []

    # And a tag no task can carry is an error, for list as for cancel
    for command in ("list", "cancel"):
        refused = run(app, command, "--tag", "")
        assert refused.exit_code != EXIT_OK
        assert "tag= is empty" in refused.output


def test_dead_letter_requeue_and_purge_keep_the_index_exact(
    app: Celery, redis_client: redis.Redis
) -> None:
    store = store_for(app)
    record = app.tasks["tests.record"]
    doomed = record.apply_delayed((1,), countdown=0, key="k", tags=["t"])
    claim = store.claim(0, limit=10, lease_ms=30_000)
    assert [e.task_id for e in claim.entries] == [doomed.id]

    # Dead-lettered: neither its key nor its tag points at it any more
    assert (
        store.dead_letter(
            0, claim.token, [(doomed.id, DeadReason("test", due_ms=0, companion="test"))]
        )
        == 1
    )
    assert tagged_ids(store, "t") == []
    assert record.apply_delayed((2,), countdown=3600, key="k").id != doomed.id
    assert check_marks(store) == []

    # Requeued: its tag is back; its key stays with the task that took it
    assert admin.requeue_dead(store, [doomed.id]) == [True]
    assert tagged_ids(store, "t") == [doomed.id]
    found = celery_zdelay.lookup(doomed.id, app=app)
    assert found is not None
    assert found.state == "parked"
    assert found.key is None
    assert found.tags == ("t",)
    assert check_marks(store) == []

    # Dead again and purged: nothing of it is left in the index
    claim = store.claim(0, limit=10, lease_ms=30_000)
    assert (
        store.dead_letter(
            0, claim.token, [(doomed.id, DeadReason("again", due_ms=0, companion="test"))]
        )
        == 1
    )
    found = celery_zdelay.lookup(doomed.id, app=app)
    assert found is not None
    assert found.state == "dead"
    assert found.tags == ("t",)
    assert admin.purge_dead(store, [doomed.id]) == 1
    assert not redis_client.hexists(SHARD0.marks, f"d:{doomed.id}")
    assert tagged_ids(store, "t") == []
    assert check_marks(store) == []


def test_status_check_finds_a_drifted_index_and_repair_fixes_it(
    app: Celery, redis_client: redis.Redis
) -> None:
    record = app.tasks["tests.record"]
    kept = record.apply_delayed((1,), countdown=3600, key="k", tags=["t"])
    # Someone else writes into the index: a stale key, a stale tag, a lost tag
    redis_client.hset(SHARD0.marks, "k:ghost", "no-such-id")
    redis_client.zadd(SHARD0.tagged, {"t\nno-such-id": 0})
    redis_client.zrem(SHARD0.tagged, f"t\n{kept.id}")

    checked = run(app, "status", "--check")
    assert checked.exit_code != EXIT_OK
    assert "key 'ghost'" in checked.output
    assert "missing from tag 't'" in checked.output

    assert repair_marks(store_for(app)) == 3
    assert check_marks(store_for(app)) == []
    assert tagged_ids(store_for(app), "t") == [kept.id]
    repaired = run(app, "repair")
    assert repaired.exit_code == EXIT_OK
    assert "repaired 0" in repaired.output


def test_tag_and_key_operations_on_a_three_master_cluster(
    make_test_app: Callable[..., Celery], cluster: LocalCluster, broker_server: RedisServer
) -> None:
    app = make_test_app(
        broker=f"{broker_server.url}/0",
        conf={"zdelay_redis_url": cluster.url, "zdelay_shards": 6},
    )
    store = store_for(app)
    assert store.cluster
    by_order = _park_orders(app, 60)
    record = app.tasks["tests.record"]
    keyed = [record.apply_delayed((k,), countdown=3600, key=f"k{k}") for k in range(12)]
    assert [record.apply_delayed((0,), countdown=1, key=f"k{k}").id for k in range(12)] == [
        r.id for r in keyed
    ]
    many = record.apply_delayed_many([(1,), (2,)], countdown=3600, keys=["k1", "fresh"])
    assert many[0].id == keyed[1].id
    # 8 threads replacing and debouncing one key leave one entry, on its key's node
    start = threading.Barrier(8)

    def produce(n: int) -> None:
        start.wait()
        for i in range(10):
            mode = "replace" if (n + i) % 2 else "debounce"
            record.apply_delayed((n, i), countdown=3600, key="hot", on_key=mode, tags=["hot"])

    threads = [threading.Thread(target=produce, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    owner = key_owner(store, "hot")
    assert owner is not None
    assert tagged_ids(store, "hot") == [owner[0]]
    assert celery_zdelay.cancel_matching(tag="hot", app=app) == 1

    assert tag_count(store, "order:1") == 20
    assert celery_zdelay.cancel_matching(tag="order:1", app=app) == 20
    assert celery_zdelay.reschedule_matching(tag="order:2", countdown=0, app=app) == 20
    with Companion(app) as companion:
        wait_for(lambda: companion.release_due().released == 0 and not tagged_ids(store, "order:2"))
    assert sorted(tagged_ids(store, "order:0")) == sorted(by_order[0])
    assert check_marks(store) == []


@pytest.mark.parametrize("path", ["handoff", "generic"])
def test_the_index_is_exact_after_companions_are_killed_mid_release(
    make_test_app: Callable[..., Celery],
    broker_server: RedisServer,
    redis_server: RedisServer,
    companion: Callable[..., CeleryProcess],
    worker: Callable[..., CeleryProcess],
    runs: Runs,
    path: str,
) -> None:
    # Given 1,200 keyed, tagged tasks over 2 shards, due over the next seconds
    broker = f"{broker_server.url}/0" if path == "generic" else None
    app = make_test_app(
        broker=broker, conf={"zdelay_shards": 2, "zdelay_lease_seconds": 2, "zdelay_batch_size": 50}
    )
    record = app.tasks["tests.record"]
    ids = {
        record.apply_delayed(
            (i,), countdown=1 + (i % 40) / 10, key=f"job:{i}", tags=[f"batch:{i % 7}", "all"]
        ).id
        for i in range(1200)
    }
    store = store_for(app)
    client = redis_server.client(0)

    # When companions are SIGKILLed mid-release, again and again
    for _ in range(3):
        doomed = companion(app)
        wait_for(
            lambda: len(tagged_ids(store, "all")) < len(ids) - 50,
            timeout=60,
            message="a companion releasing",
        )
        doomed.kill()
        # Then, with nobody releasing, every key and tag points at a parked
        # (or in-flight) entry and every parked entry is in its tags
        assert check_marks(store) == []

    # And once everything is released, the index is empty
    worker(app)
    companion(app)
    runs.wait_for_ids(ids, stall_timeout=90)
    wait_for(lambda: _index_empty(client, 2), timeout=60, message="an empty index")
    assert check_marks(store) == []


def test_a_forged_tag_cannot_cancel_a_signed_entry_tagged_otherwise(
    make_test_app: Callable[..., Celery], redis_client: redis.Redis
) -> None:
    app, signed, honest = forged_tag(make_test_app, redis_client)

    # Nor does the listing by tag show it, from Python or the CLI
    listed = admin.list_parked(store_for(app), tag="order:9")
    assert [entry.task_id for entry in listed.entries] == [honest.id]
    cli = json.loads(run(app, "list", "--tag", "order:9", "--json").stdout)
    assert [entry["id"] for entry in cli["entries"]] == [honest.id]

    assert celery_zdelay.cancel_matching(tag="order:9", app=app) == 1
    assert celery_zdelay.lookup(signed.id, app=app) is not None
    assert celery_zdelay.lookup(honest.id, app=app) is None


def test_a_forged_tag_cannot_reschedule_a_signed_entry_tagged_otherwise(
    make_test_app: Callable[..., Celery], redis_client: redis.Redis
) -> None:
    app, signed, honest = forged_tag(make_test_app, redis_client)
    found = celery_zdelay.lookup(signed.id, app=app)
    assert found is not None
    signed_due_ms = found.due_ms

    # Python and the CLI move the honest entry only
    assert celery_zdelay.reschedule_matching(tag="order:9", countdown=10, app=app) == 1
    moved = run(app, "reschedule", "--tag", "order:9", "--countdown", "20")
    assert "rescheduled 1 parked task" in moved.output
    found = celery_zdelay.lookup(signed.id, app=app)
    assert found is not None
    assert found.due_ms == signed_due_ms
    honest_found = celery_zdelay.lookup(honest.id, app=app)
    assert honest_found is not None
    assert honest_found.due_ms is not None
    assert honest_found.due_ms < signed_due_ms - 3_000_000
