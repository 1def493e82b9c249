"""Store inspection and administration against a real Redis: counts, listings,
dead letters, companions and the server's safety settings.

The stocked store and the hand-written entries live in
:mod:`tests.support.store`, which the CLI, metrics and dashboard tests share.
"""

from __future__ import annotations

import json
import logging

import pytest
import redis
from celery import Celery

from celery_zdelay.companion import Companion
from celery_zdelay.config import get_config
from celery_zdelay.errors import StoreUnavailableError
from celery_zdelay.store import Store, admin
from celery_zdelay.store.redis_keys import companions_key
from celery_zdelay.testing import RedisServer
from tests.conftest import AppFactory
from tests.support.deadletters import make_dead_letter
from tests.support.keys import keys_of
from tests.support.store import due_ms, put_raw, stock, write_heartbeat

pytestmark = pytest.mark.timeout(60)


# -- counts ---------------------------------------------------------------------


def test_counts_see_parked_overdue_in_flight_and_dead(app: Celery, store: Store) -> None:
    # Given one entry in each state (5 parked, of which 1 overdue; 1 in flight; 1 dead)
    stocked = stock(app)

    # When they are counted
    counted = admin.counts(store)

    # Then each state has its count; the entry in flight past its due time
    # is overdue too (one story with list and status --check), and the
    # oldest overdue age is measured from its due time (10 s ago, before the
    # waiting overdue entry's 5 s); the next due time is the "soon" entry's
    assert (counted.parked, counted.overdue, counted.in_flight, counted.dead) == (5, 2, 1, 1)
    assert counted.overdue_in_flight == 1
    assert counted.oldest_overdue_age_ms is not None
    assert counted.oldest_overdue_age_ms > counted.now_ms - due_ms(store, stocked.overdue)
    assert counted.oldest_overdue_age_ms >= 10_000
    assert counted.next_due_ms == due_ms(store, stocked.soon)
    assert 0 < counted.next_due_ms - counted.now_ms <= 60_000


def test_an_empty_store_counts_nothing(store: Store) -> None:
    counted = admin.counts(store)

    assert (counted.parked, counted.overdue, counted.in_flight, counted.dead) == (0, 0, 0, 0)
    assert counted.oldest_overdue_age_ms is None
    assert counted.next_due_ms is None


def test_the_counts_of_each_shard_are_the_sizes_of_its_sets(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = make_test_app(conf={"zdelay_shards": 4})
    record = app.tasks["tests.record"]
    for i in range(40):
        record.apply_delayed((i,), countdown=0 if i % 4 == 0 else 600)
    store = Store(get_config(app))
    try:
        counted = admin.counts(store)
    finally:
        store.close()

    assert [s.shard for s in counted.shards] == [0, 1, 2, 3]
    for shard in counted.shards:
        due = keys_of(shard.shard).due
        assert shard.parked == redis_client.zcard(due)
    assert counted.parked == 40
    assert counted.overdue == 10


# -- listing ---------------------------------------------------------------------


def test_a_listing_is_in_due_order_across_shards_and_bounded(make_test_app: AppFactory) -> None:
    app = make_test_app(conf={"zdelay_shards": 3})
    record = app.tasks["tests.record"]
    parked = [record.apply_delayed((i,), countdown=100 + i) for i in range(30)]
    store = Store(get_config(app))
    try:
        first = admin.list_parked(store, limit=10)
        everything = admin.list_parked(store, limit=30)
    finally:
        store.close()

    assert [e.task_id for e in first.entries] == [r.id for r in parked[:10]]
    assert first.more is True
    assert [e.task_id for e in everything.entries] == [r.id for r in parked]
    assert everything.more is False
    assert {e.shard for e in everything.entries} == {0, 1, 2}


def test_a_listing_shows_task_queue_and_argsrepr(app: Celery, store: Store) -> None:
    stocked = stock(app)

    listing = admin.list_parked(store)
    by_id = {e.task_id: e for e in listing.entries}

    # The entry in flight is listed too, first (due 10 s ago), marked as such.
    assert list(by_id) == [stocked.in_flight, stocked.overdue, stocked.soon, *stocked.later]
    assert [e.in_flight for e in listing.entries] == [True, False, False, False, False, False]
    late = by_id[stocked.overdue]
    assert (late.task, late.queue, late.argsrepr, late.kwargsrepr) == (
        "tests.record",
        "celery",
        "('late',)",
        "{'x': 1}",
    )
    assert late.due_ms < listing.now_ms
    assert [by_id[i].queue for i in stocked.later] == ["orders"] * 3
    assert by_id[stocked.soon].task == "tests.add"


def test_a_listing_never_shows_the_message_body(app: Celery, store: Store) -> None:
    # Celery's argsrepr hides secrets from monitoring; the listing honours it
    # because it reads headers only, never the (serialized) arguments.
    app.tasks["tests.record"].apply_delayed(("s3cret-token",), countdown=60, argsrepr="(***)")

    (entry,) = admin.list_parked(store).entries

    assert entry.argsrepr == "(***)"
    assert "s3cret-token" not in json.dumps(entry.__dict__)


def test_a_listing_filters_by_task_pattern_and_due_window(app: Celery, store: Store) -> None:
    stocked = stock(app)
    now = store.time_ms()

    def ids(**filters: object) -> list[str]:
        return [e.task_id for e in admin.list_parked(store, **filters).entries]  # type: ignore[arg-type]

    assert ids(task="tests.add") == [stocked.soon]
    assert ids(task="tests.re*") == [stocked.in_flight, stocked.overdue, *stocked.later]
    assert ids(task="nothing.*") == []
    assert ids(due_before_ms=now) == [stocked.in_flight, stocked.overdue]
    assert ids(due_after_ms=now) == [stocked.soon, *stocked.later]
    assert ids(due_after_ms=now, due_before_ms=now + 600_000) == [stocked.soon]
    assert ids(task="tests.record", due_after_ms=now + 1_800_500) == stocked.later[1:]


def test_a_filtered_scan_stops_at_its_bound_and_says_there_may_be_more(
    app: Celery, store: Store
) -> None:
    record, add = app.tasks["tests.record"], app.tasks["tests.add"]
    for i in range(20):
        record.apply_delayed((i,), countdown=100 + i)
    wanted = add.apply_delayed((1, 2), countdown=200)

    cut = admin.list_parked(store, task="tests.add", scan_limit=10)
    whole = admin.list_parked(store, task="tests.add")

    assert (cut.entries, cut.more) == ([], True)
    assert [e.task_id for e in whole.entries] == [wanted.id]
    assert whole.more is False


def test_an_unreadable_entry_is_listed_with_the_reason(store: Store) -> None:
    put_raw(store, "foreign-1", b'{"v":99,"n":0}\n', due_in_ms=1000)
    put_raw(store, "no-message-1", None, due_in_ms=2000)

    listing = admin.list_parked(store)

    assert [(e.task_id, e.task) for e in listing.entries] == [
        ("foreign-1", None),
        ("no-message-1", None),
    ]
    assert "unknown schema version 99" in (listing.entries[0].error or "")
    assert "payload missing" in (listing.entries[1].error or "")


# -- dead letters -------------------------------------------------------------------


def test_a_dead_letter_keeps_its_reason_due_time_and_companion(app: Celery, store: Store) -> None:
    stocked = stock(app)

    (dead,) = admin.list_dead(store).entries

    assert dead.task_id == stocked.dead
    assert dead.reason is not None
    assert dead.reason.startswith("foreign entry")
    assert dead.companion is not None
    assert dead.due_ms is not None
    assert dead.due_ms < dead.died_ms <= store.time_ms()
    assert dead.error is not None  # the message itself is unreadable too


def test_requeued_dead_letters_are_due_now_and_released_again(
    app: Celery, store: Store, redis_client: redis.Redis
) -> None:
    # A message dead-lettered for a reason that has gone away (here: the
    # signing key was missing) is released once requeued.
    result = app.tasks["tests.record"].apply_delayed(("again",), countdown=0)
    make_dead_letter(store, result.id, "bad signature", companion="c1")

    assert admin.requeue_dead(store, [result.id, "unknown-id"]) == [True, False]
    counted = admin.counts(store)
    assert (counted.parked, counted.overdue, counted.dead) == (1, 1, 0)
    with Companion(app, store=store) as companion:
        assert companion.release_due().released == 1
    (raw,) = redis_client.lrange("celery", 0, -1)
    assert json.loads(raw)["headers"]["id"] == result.id


def test_requeue_all_takes_every_entry_that_has_a_message(app: Celery, store: Store) -> None:
    put_raw(store, "no-message-1", None, due_in_ms=-1000)
    for task_id in ("damaged-1", "damaged-2"):
        put_raw(store, task_id, b"damaged", due_in_ms=-1000)
    with Companion(app, store=store) as companion:
        assert companion.release_due().dead_lettered == 3

    requeued, left = admin.requeue_all_dead(store)

    assert (requeued, left) == (2, 1)
    assert [e.task_id for e in admin.list_dead(store).entries] == ["no-message-1"]
    assert {e.task_id for e in admin.list_parked(store).entries} == {"damaged-1", "damaged-2"}


def test_purging_deletes_the_given_ids_or_everything(app: Celery, store: Store) -> None:
    for i in range(5):
        put_raw(store, f"damaged-{i}", b"damaged", due_in_ms=-1000)
    with Companion(app, store=store) as companion:
        assert companion.release_due().dead_lettered == 5

    assert admin.purge_dead(store, ["damaged-0", "damaged-1", "unknown"]) == 2
    assert admin.counts(store).dead == 3
    assert admin.purge_dead(store) == 3
    assert admin.counts(store).dead == 0
    keys = store.keys(0)
    assert store.client.hlen(keys.dead_msg) == 0


def test_a_dead_listing_is_most_recent_first_and_bounded(app: Celery, store: Store) -> None:
    keys = store.keys(0)
    for i in range(5):
        store.client.zadd(keys.dead, {f"dead-{i}": 1_000_000 + i})
        store.client.hset(keys.dead_msg, f"dead-{i}", b'{"reason":"r"}\n')

    listing = admin.list_dead(store, limit=3)

    assert [e.task_id for e in listing.entries] == ["dead-4", "dead-3", "dead-2"]
    assert listing.more is True


# -- companions ---------------------------------------------------------------------


def test_companions_are_read_from_heartbeats_alive_first(store: Store) -> None:
    write_heartbeat(store, "stale-1", seen_ago_ms=120_000)
    write_heartbeat(store, "live-1", seen_ago_ms=1_000)
    store.client.hset(companions_key("zdelay"), "garbage", b"{not json")

    found = admin.companions(store)

    assert [(c.id, c.alive) for c in found] == [("live-1", True), ("stale-1", False)]
    assert (found[0].host, found[0].pid, found[0].shards, found[0].released) == (
        "host-a",
        4242,
        [0],
        7,
    )


def test_the_check_fails_without_a_live_companion_or_with_an_old_overdue_entry(
    make_test_app: AppFactory,
) -> None:
    app = make_test_app(conf={"zdelay_shards": 2})
    store = Store(get_config(app))
    try:
        assert admin.check(admin.status(store), max_overdue_ms=60_000) == ["no companion is alive"]
        write_heartbeat(store, "live-1", seen_ago_ms=0, shards=[0])
        assert admin.check(admin.status(store), max_overdue_ms=60_000) == [
            "no live companion releases shard 1"
        ]
        write_heartbeat(store, "live-2", seen_ago_ms=0, shards=[1])
        assert admin.check(admin.status(store), max_overdue_ms=60_000) == []
        put_raw(store, "late-1", b"x", due_in_ms=-90_000)
        (problem,) = admin.check(admin.status(store), max_overdue_ms=60_000)
        assert problem.startswith("the oldest overdue entry is 1m 30s overdue (limit 1m 0s)")
    finally:
        store.close()


# -- server health -------------------------------------------------------------------


def _health(**config: str) -> admin.ServerHealth:
    """Start a Redis of its own with *config* and judge it."""
    with RedisServer(**config) as server:
        app = Celery("health", broker=f"{server.url}/0")
        store = Store(get_config(app))
        try:
            return admin.server_health(store)
        finally:
            store.close()
            app.close()


def test_a_safe_server_gives_no_warning() -> None:
    health = _health(appendonly="yes", appendfsync="everysec", maxmemory_policy="noeviction")

    assert (health.maxmemory_policy, health.appendonly, health.appendfsync) == (
        "noeviction",
        "yes",
        "everysec",
    )
    assert health.redis_version
    assert health.warnings == []


def test_an_evicting_server_is_named_with_the_fix() -> None:
    health = _health(appendonly="yes", maxmemory_policy="allkeys-lru")

    assert health.warnings == [
        "Redis eviction policy is allkeys-lru; parked tasks can be evicted. "
        "Set maxmemory-policy noeviction or give zdelay its own instance."
    ]


def test_a_volatile_policy_cannot_evict_parked_tasks() -> None:
    # Parked keys carry no TTL, and volatile-* policies only evict keys with one.
    assert _health(appendonly="yes", maxmemory_policy="volatile-lru").warnings == []


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"appendonly": "no", "save": ""}, "Redis persistence is off"),
        ({"appendonly": "no", "save": "900 1"}, 'RDB snapshots only (appendonly no, save "900 1")'),
        ({"appendonly": "yes", "appendfsync": "no"}, "Redis appendfsync is no"),
    ],
)
def test_weak_persistence_is_warned_about(config: dict[str, str], expected: str) -> None:
    (warning,) = _health(**config).warnings

    assert expected in warning
    assert "appendfsync everysec" in warning


def test_log_store_warnings_logs_each_and_never_raises(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="celery_zdelay")
    warnings = admin.log_store_warnings(store)  # the test server runs without persistence

    assert warnings
    assert [r.getMessage() for r in caplog.records] == warnings

    with RedisServer() as server:
        app = Celery("gone", broker=f"{server.url}/0")
        app.conf.zdelay_retry_policy = {"max_retries": 0}
        gone = Store(get_config(app))
    try:
        with pytest.raises(StoreUnavailableError):
            admin.server_health(gone)
        assert admin.log_store_warnings(gone) == []
    finally:
        gone.close()
        app.close()


# -- Redis Cluster safety ---------------------------------------------------------------


#: The client name of the store whose commands the slow log is read for.
PROBE = "zdelay-one-shard-probe"


def test_every_command_stays_within_one_shard(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    """On a Redis Cluster each shard lives in one slot: no command may span two.

    The slow log, set to record everything, keeps every command the admin
    functions send; COMMAND GETKEYS names the keys of each.
    """
    app = make_test_app(conf={"zdelay_shards": 3})
    stock(app)
    # The slow log is the server's: only this store's commands are checked,
    # not those of other clients (a result backend unsubscribing, say).
    url = get_config(app).redis_url
    store = Store(
        get_config(
            make_test_app(
                conf={"zdelay_shards": 3, "zdelay_redis_url": f"{url}?client_name={PROBE}"}
            )
        )
    )
    previous = redis_client.config_get("slowlog-log-slower-than")["slowlog-log-slower-than"]
    redis_client.config_set("slowlog-log-slower-than", 0)
    redis_client.config_set("slowlog-max-len", 10_000)
    redis_client.slowlog_reset()
    try:
        admin.status(store)
        admin.list_parked(store)
        admin.list_parked(store, task="tests.*")
        admin.list_dead(store)
        admin.requeue_all_dead(store)
        admin.purge_dead(store)
        log = redis_client.slowlog_get(10_000)
    finally:
        redis_client.config_set("slowlog-log-slower-than", previous)
        store.close()

    keyless = {"SLOWLOG", "CONFIG", "INFO", "TIME", "PING", "CLIENT", "HELLO", "SELECT", "SCRIPT"}
    keyless |= {"PUBLISH"}  # requeue.lua wakes companions: a channel, not a key
    seen = set()
    for entry in log:
        if entry.get("client_name") != PROBE.encode():
            continue
        command = entry["command"]
        args = (command if isinstance(command, bytes) else command.encode()).split()
        name = args[0].decode().upper()
        seen.add(name)
        # Whole-keyspace or whole-set commands would not scale, or not run on a cluster.
        assert name not in {"KEYS", "SCAN", "DEL", "UNLINK", "FLUSHDB"}, name
        if name in {"ZRANGEBYSCORE", "ZREVRANGEBYSCORE"}:
            assert b"LIMIT" in [a.upper() for a in args], args
        if name in {"ZRANGE", "ZREVRANGE"}:
            assert args[3] != b"-1", args  # a bounded rank range
        if name in keyless:
            continue
        try:
            keys = redis_client.command_getkeys(*args)
        except redis.exceptions.ResponseError as exc:
            raise AssertionError(f"{args!r}: {exc}") from exc
        tags = {_hash_tag(k) for k in keys}
        assert len(tags) == 1, f"{name} spans {tags}"
    assert {"ZCARD", "ZCOUNT", "ZRANGEBYSCORE", "HMGET", "EVALSHA", "HGETALL"} <= seen


def _hash_tag(key: str | bytes) -> str:
    key = key.decode() if isinstance(key, bytes) else key
    start = key.find("{")
    end = key.find("}", start + 1)
    return key[start + 1 : end] if start >= 0 and end > start + 1 else key
