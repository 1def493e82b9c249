"""Parking costs the caller no more than it must (P5): one park of one task
runs ten Redis commands inside park.lua, none of them a type check or a read
of the retry marker or of a template already counted, and
still refuses a key of another type with the fix before it writes anything,
and still wakes a companion only when the earliest due time moved earlier."""

from __future__ import annotations

import base64
import logging
import time
from typing import Any

import pytest
from celery import Celery

import celery_zdelay
from celery_zdelay.errors import StoreRefusedError
from celery_zdelay.parking import store_for
from celery_zdelay.store import Store
from celery_zdelay.store.counts import counts
from celery_zdelay.store.scripts import script_commands
from tests.conftest import AppFactory

pytestmark = pytest.mark.timeout(120)


def _commands_of_one_park(store: Store, task: Any, countdown: float) -> dict[str, int]:
    """The calls of EVALSHA and of each command park.lua may run, in one park."""
    may_run = {"evalsha", *(command.lower() for command in script_commands("park"))}
    client = store.client
    client.config_resetstat()
    task.apply_delayed((1,), countdown=countdown)
    stats = client.info("commandstats")
    calls = {name.removeprefix("cmdstat_"): int(entry["calls"]) for name, entry in stats.items()}
    return {name: n for name, n in calls.items() if name in may_run}


def test_one_park_of_one_task_runs_ten_commands_and_no_type_check(
    make_test_app: AppFactory,
) -> None:
    # Given an app whose store already parked a task (script loaded, ACL and
    # bulk limit asked once, the handoff's destination named), recording no
    # history (its cost is the next test's)
    app = make_test_app(conf={"zdelay_history_seconds": 0})
    record = app.tasks["tests.record"]
    store = store_for(app)
    record.apply_delayed((0,), countdown=600)

    # When it parks one more task, due after the first
    commands = _commands_of_one_park(store, record, 900)

    # Then the client sent one EVALSHA, and park.lua ran at most ten
    # commands (twenty before issue 23: six TYPE checks, the template stored
    # again, the head read for the wake-up; twelve after its first round)
    assert commands.pop("evalsha") == 1
    assert "type" not in commands
    assert "hsetnx" not in commands  # the template is stored already
    assert "hexists" not in commands  # its count says so: one read, not two
    assert "get" not in commands  # the retry marker is set only where absent (SET NX)
    assert commands["set"] == 1
    assert "publish" not in commands  # nothing moved earlier: no wake-up
    assert sum(commands.values()) <= 10, commands


def test_recording_the_history_of_a_park_costs_four_commands_and_no_type_check(
    make_test_app: AppFactory,
) -> None:
    # Given an app recording history (the default) and one recording none,
    # each of whose stores parked a task
    app = make_test_app()
    record = app.tasks["tests.record"]
    store = store_for(app)
    record.apply_delayed((0,), countdown=600)
    off = make_test_app(conf={"zdelay_history_seconds": 0})
    record_off = off.tasks["tests.record"]
    record_off.apply_delayed((0,), countdown=600)

    # When each parks one more task
    with_history = _commands_of_one_park(store, record, 900)
    without = _commands_of_one_park(store_for(off), record_off, 900)

    # Then the history costs a read that checks its key's type (HLEN), the
    # clock (TIME), the record read (HMGET) and written (HSET): four
    # commands, no TYPE
    assert "type" not in with_history
    extra = {name: with_history.get(name, 0) - without.get(name, 0) for name in with_history}
    assert {name: n for name, n in extra.items() if n} == {
        "hlen": 1,
        "time": 1,
        "hmget": 1,
        "hset": 1,
    }


def test_a_template_without_a_count_is_stored_again_by_the_next_park(app: Celery) -> None:
    # Given a parked task whose template record was deleted with its count
    # (as the last release of an entry using it does)
    record = app.tasks["tests.record"]
    store = store_for(app)
    first = record.apply_delayed((0,), countdown=600)
    client = store.client
    templates = store.keys(store.shard_of(first.id)).templates
    (template_id,) = [f for f in client.hkeys(templates) if not f.startswith(b"#")]
    client.hdel(templates, template_id, b"#" + template_id)

    # When another task of the same template is parked
    record.apply_delayed((1,), countdown=600)

    # Then the template is stored again, counted for that one entry
    assert client.hexists(templates, template_id)
    assert client.hget(templates, b"#" + template_id) == b"1"


@pytest.mark.parametrize(
    ("key", "kind"),
    [("due", "zset"), ("msg", "hash"), ("lease", "zset"), ("dests", "set"), ("templates", "hash")],
)
def test_a_key_of_another_type_refuses_the_park_with_the_fix_and_writes_nothing(
    app: Celery, key: str, kind: str
) -> None:
    # Given a store where one of park.lua's keys was written by something else
    record = app.tasks["tests.record"]
    store = store_for(app)
    record.apply_delayed((0,), countdown=600)  # every key exists, as in production
    client = store.client
    name = getattr(store.keys(0), key)
    client.delete(name)
    client.set(name, "not celery-zdelay's")
    before = {k: client.dump(k) for k in client.keys("*") if b":parked:" not in k}

    # When a task is parked
    with pytest.raises(StoreRefusedError) as refused:
        record.apply_delayed((1,), countdown=600)

    # Then the park is refused with the message that says the fix, and
    # nothing was written: no key changed, no retry marker left behind
    assert f"{name} holds a string, not a {kind}" in str(refused.value)
    assert "give celery-zdelay its own zdelay_key_prefix" in str(refused.value)
    after = {k: client.dump(k) for k in client.keys("*") if b":parked:" not in k}
    assert after == before
    assert len(client.keys("*:parked:*")) == 1  # the first park's marker only


def test_a_leased_hash_of_another_type_refuses_a_park_that_takes_over_a_lease(
    app: Celery,
) -> None:
    # Given a task being released (leased), and its leased hash overwritten
    record = app.tasks["tests.record"]
    store = store_for(app)
    parked = record.apply_delayed((0,), countdown=600)
    keys = store.keys(store.shard_of(parked.id))
    client = store.client
    client.zadd(keys.lease, {parked.id: 1})
    client.set(keys.leased, "not a hash")
    before = {k: client.dump(k) for k in client.keys("*") if b":parked:" not in k}

    # When the same id is parked again (it takes the id over from the lease)
    with pytest.raises(StoreRefusedError) as refused:
        record.apply_delayed((1,), countdown=600, task_id=parked.id)

    # Then the park is refused before it wrote anything
    assert f"{keys.leased} holds a string, not a hash" in str(refused.value)
    assert {k: client.dump(k) for k in client.keys("*") if b":parked:" not in k} == before


def test_a_wake_up_is_published_only_when_the_earliest_due_time_moves_earlier(
    app: Celery,
) -> None:
    record = app.tasks["tests.record"]
    store = store_for(app)
    pubsub = store.client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(store.keys(0).wake)
    heard: list[int] = []

    def wakes_after(countdown: float) -> list[int]:
        record.apply_delayed((countdown,), countdown=countdown)
        # The script published (or not) before it replied; drain what came.
        deadline = time.monotonic() + 1.0
        got: list[int] = []
        while time.monotonic() < deadline:
            message = pubsub.get_message(timeout=0.1)
            if message is None and got:
                break
            # "0": the first park's check that this user may publish wake-ups
            if message is not None and int(message["data"]) > 0:
                got.append(int(message["data"]))
        heard.extend(got)
        return got

    try:
        # Given an empty store: the first park wakes the companion
        assert len(wakes_after(600)) == 1
        # A later one does not; one due in the same millisecond range later neither
        assert wakes_after(900) == []
        assert wakes_after(600.5) == []
        # An earlier one does, naming its due ms
        woke = wakes_after(300)
        assert len(woke) == 1
        assert abs(woke[0] - (store.time_ms() + 300_000)) < 10_000
    finally:
        pubsub.close()


def test_an_id_parked_twice_in_one_call_keeps_its_last_due_time_payload_and_counts(
    app: Celery,
) -> None:
    # Given a task parked with one template, due in ten minutes
    record, add = app.tasks["tests.record"], app.tasks["tests.add"]
    store = store_for(app)
    client = store.client
    task_id = "parked-twice-in-one-call"
    add.apply_delayed((1, 2), countdown=600, task_id=task_id)
    keys = store.keys(store.shard_of(task_id))
    (replaced,) = [f for f in client.hkeys(keys.templates) if not f.startswith(b"#")]

    # When one call parks the same id twice with another template
    with celery_zdelay.batch(app):
        record.apply_delayed(("first",), countdown=300, task_id=task_id)
        record.apply_delayed(("last",), countdown=900, task_id=task_id)

    # Then the id is parked once, with the last call's due time and payload,
    # the template it replaced is gone, and the new one is counted once
    assert client.zcard(keys.due) == 1
    due_ms = int(client.zscore(keys.due, task_id)) // 1024
    assert abs(due_ms - (store.time_ms() + 900_000)) < 10_000
    payload = client.hget(keys.msg, task_id)
    # (the body is stored in base64; its start is the arguments)
    assert base64.b64encode(b'[["last"]') in payload
    assert base64.b64encode(b'[["first"]') not in payload
    counts = {f: v for f, v in client.hgetall(keys.templates).items() if f.startswith(b"#")}
    assert replaced not in client.hkeys(keys.templates)
    assert list(counts.values()) == [b"1"]


def test_a_call_of_more_than_a_thousand_entries_parks_every_one(app: Celery) -> None:
    # Given more calls than a millisecond has sequence slots
    record = app.tasks["tests.record"]
    store = store_for(app)

    # When they are parked in one call
    results = record.apply_delayed_many([(i,) for i in range(2_345)], countdown=600)

    # Then each is parked; the first 1,024 of a millisecond in the order given
    keys = store.keys(0)
    parked = [i.decode() for i in store.client.zrange(keys.due, 0, -1)]
    assert sorted(parked) == sorted(r.id for r in results)
    assert parked[:1_000] == [r.id for r in results[:1_000]]
    assert store.client.hlen(keys.msg) == 2_345


# -- the Python side of one park (issue 35) -----------------------------------


def test_each_park_is_logged_at_debug_and_nothing_is_formatted_above_it(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    # Given an app that parked once (the first park's companion warning is behind it)
    record = app.tasks["tests.record"]
    record.apply_delayed((0,), countdown=600)
    caplog.clear()

    # When one task is parked with the parking log at DEBUG, and one at INFO
    with caplog.at_level(logging.DEBUG, logger="celery_zdelay.parking"):
        logged = record.apply_delayed((1,), countdown=600)
    lines = [r.getMessage() for r in caplog.records if r.name == "celery_zdelay.parking"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="celery_zdelay.parking"):
        quiet = record.apply_delayed((2,), countdown=600)

    # Then the first names its task and id, the second logs nothing, and both are parked
    assert lines == [f"Parked tests.record[{logged.id}]"]
    assert not [r for r in caplog.records if r.name == "celery_zdelay.parking"]
    assert celery_zdelay.lookup(logged.id, app=app) is not None
    assert celery_zdelay.lookup(quiet.id, app=app) is not None


def test_eager_is_read_on_every_call_so_a_change_between_calls_holds(app: Celery) -> None:
    # Given the test app, not bound to a test (it parks nothing under eager)
    record = app.tasks["tests.record"]

    # When task_always_eager is switched on, a call made, then off, and another made
    app.conf.task_always_eager = True
    try:
        ran = record.apply_delayed(("eager",), countdown=600)
    finally:
        app.conf.task_always_eager = False
    parked = record.apply_delayed(("parked",), countdown=600)

    # Then the first ran now (as apply_async does under eager) and parked
    # nothing, and the second was parked
    assert ran.successful()
    assert celery_zdelay.lookup(ran.id, app=app) is None
    assert celery_zdelay.lookup(parked.id, app=app) is not None


def test_a_task_sent_to_a_named_exchange_is_parked_and_its_sent_event_is_not(
    make_test_app: Any, redis_client: Any
) -> None:
    # Given an app that sends task-sent events to an exchange of its own, and
    # a task routed to a named exchange (the events exchange is read for it)
    app = make_test_app(
        conf={
            "task_send_sent_event": True,
            "event_exchange": "zdelay-test-events",
            "task_routes": {"tests.record": {"exchange": "orders", "routing_key": "orders"}},
        }
    )
    record = app.tasks["tests.record"]

    # When it parks a task
    result = record.apply_delayed(("routed",), countdown=600)

    # Then the store holds that task alone, and no event
    assert celery_zdelay.lookup(result.id, app=app) is not None
    assert counts(store_for(app)).parked == 1
