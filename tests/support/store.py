"""A store stocked by the real scripts, and entries written by hand.

:func:`stock` builds the store the admin, CLI, metrics and dashboard tests
read: parked, overdue, in-flight and dead entries. :func:`put_raw` and
:func:`write_heartbeat` write what a bug, an attacker or another companion
could, without validation.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from celery import Celery

from celery_zdelay.companion import Companion
from celery_zdelay.config import get_config
from celery_zdelay.parking import store_for
from celery_zdelay.schedule import Due
from celery_zdelay.store import ParkRequest, Store
from celery_zdelay.store.control import pause_lane
from celery_zdelay.store.marks import Mark
from celery_zdelay.store.redis_keys import companions_key, held_set_key
from celery_zdelay.testing import RedisServer
from tests.helpers import wait_for
from tests.support.keys import keys_of

__all__ = [
    "Stock",
    "claim_parked",
    "due_ms",
    "ids_on_shard",
    "is_parked",
    "put_raw",
    "release_everything",
    "stock",
    "write_heartbeat",
]


@dataclass(frozen=True)
class Stock:
    """Ids of what :func:`stock` parked."""

    #: tests.record on queue "orders", due in 30 min (+0, +1, +2 s).
    later: list[str]
    #: tests.add (2, 3), due in 60 s.
    soon: str
    #: tests.record ("late",) {"x": 1}, due 5 s ago and never claimed.
    overdue: str
    #: tests.record ("taken",), claimed with a 10-minute lease.
    in_flight: str
    #: A damaged payload the companion dead-lettered.
    dead: str


def held_sets(shard: int, control: str, prefix: str = "zdelay") -> tuple[str, str]:
    """The two held sets of *control* on *shard*: its rate limit's and its pause's."""
    return (
        held_set_key(prefix, shard, control),
        held_set_key(prefix, shard, pause_lane(control)),
    )


def stock(app: Celery) -> Stock:
    """Park, claim and dead-letter entries so each state has at least one.

    Given no companion runs: 5 parked (1 overdue), 1 in flight, 1 dead.
    """
    store = Store(get_config(app))
    try:
        dead = put_raw(store, "damaged-1", b"not a celery-zdelay payload", due_in_ms=-20_000)
        with Companion(app, store=store) as companion:
            assert companion.release_due().dead_lettered == 1
        record = app.tasks["tests.record"]
        now = datetime.now(timezone.utc)
        taken = record.apply_delayed(("taken",), eta=now - timedelta(seconds=10))
        overdue = record.apply_delayed(("late",), {"x": 1}, eta=now - timedelta(seconds=5))
        later = [record.apply_delayed((i,), countdown=1800 + i, queue="orders") for i in range(3)]
        soon = app.tasks["tests.add"].apply_delayed((2, 3), countdown=60)
        claimed = store.claim(store.shard_of(taken.id), limit=1, lease_ms=600_000)
        assert [e.task_id for e in claimed.entries] == [taken.id]
        return Stock(
            later=[r.id for r in later],
            soon=soon.id,
            overdue=overdue.id,
            in_flight=taken.id,
            dead=dead,
        )
    finally:
        store.close()


def put_raw(store: Store, task_id: str, payload: bytes | None, *, due_in_ms: int) -> str:
    """Write an entry by hand, as a bug or an attacker could: no validation at all."""
    keys = store.keys(store.shard_of(task_id))
    if payload is not None:
        store.client.hset(keys.msg, task_id, payload)
    store.client.zadd(keys.due, {task_id: (store.time_ms() + due_in_ms) * 1024})
    return task_id


def is_parked(store: Store, task_id: str) -> bool:
    """Return whether *task_id* is in its shard's due set (parked, not leased or gone)."""
    return store.client.zscore(store.keys(store.shard_of(task_id)).due, task_id) is not None


def due_ms(store: Store, task_id: str) -> int:
    """Return the due time of the parked entry *task_id*, read from its shard's due set."""
    score = store.client.zscore(store.keys(store.shard_of(task_id)).due, task_id)
    assert score is not None, f"{task_id} is not parked"
    return int(score) // 1024


def ids_on_shard(store: Store, shard: int, n: int, prefix: str = "id") -> list[str]:
    """Return *n* task ids that hash to *shard*."""
    found = []
    i = 0
    while len(found) < n:
        candidate = f"{prefix}-{i}"
        if store.shard_of(candidate) == shard:
            found.append(candidate)
        i += 1
    return found


def write_heartbeat(store: Store, companion_id: str, *, seen_ago_ms: int, **fields: object) -> None:
    """Write a heartbeat in the companion's own format (see companion/loop.py)."""
    now = store.time_ms()
    beat = {
        "id": companion_id,
        "host": "host-a",
        "pid": 4242,
        "version": "0.1.0",
        "shards": [0],
        "handoff": "on",
        "started_ms": now - 3_600_000,
        "seen_ms": now - seen_ago_ms,
        "released": 7,
        "dead_lettered": 1,
        **fields,
    }
    store.client.hset(companions_key(store.config.key_prefix), companion_id, json.dumps(beat))


def claim_parked(
    app: Celery, ids: list[str], *, lease_ms: int = 3_600_000
) -> tuple[int, dict[str, int]]:
    """Park *ids* due in the past (in that order) on shard 0 and claim them all.

    Returns the claim's token and each id's due score.
    """
    store = store_for(app)
    now = store.time_ms()
    store.park(
        [ParkRequest(i, Due("a", now - 100 + n), b'{"v":1}\nbody') for n, i in enumerate(ids)]
    )
    due = store.keys(0).due
    scores = {m.decode(): int(s) for m, s in store.client.zrange(due, 0, -1, withscores=True)}
    claimed = store.claim(0, limit=len(ids), lease_ms=lease_ms)
    assert sorted(e.task_id for e in claimed.entries) == sorted(ids)
    return claimed.token, scores


#: A parked message's bytes where only the store reads them (no worker runs it).
PAYLOAD = b'{"v":1}\nbody'


def marked_request(
    task_id: str,
    ms: int,
    key: str | None = None,
    on_key: str = "keep",
    tags: tuple[str, ...] = (),
    max_run_ms: int = 0,
) -> ParkRequest:
    """A request parking *task_id* at *ms* with a key (its mode and max run) and tags."""
    return ParkRequest(task_id, Due("a", ms), PAYLOAD, mark=Mark(key, on_key, tags, max_run_ms))


def release_everything(app: Celery, client: Any, queue: str, control: str) -> list[tuple[str, Any]]:
    """Release every parked entry (*control* lifted): companion passes until the
    due sets, leases and *control*'s held sets are empty; return the (id,
    argsrepr) of each message sent to *queue*."""
    store = store_for(app)
    with Companion(app) as comp:

        def all_out() -> bool:
            comp.release_due()
            return not any(
                client.zcard(key)
                for shard in store.shards
                for key in (keys_of(shard).due, keys_of(shard).lease, *held_sets(shard, control))
            )

        wait_for(all_out, timeout=30, message="every parked task released")
    sent = [json.loads(raw) for raw in client.lrange(queue, 0, -1)]
    return [(m["headers"]["id"], m["headers"]["argsrepr"]) for m in sent]


@contextmanager
def acl_users(server: RedisServer, password: str) -> Iterator[Callable[..., str]]:
    """Yield a maker of ACL users of *server* (from rules, logging in with *password*).

    The maker returns the new user's name; every user made is deleted on exit.
    """
    admin = server.client()
    made: list[str] = []

    def make(*rules: str) -> str:
        name = f"zdelay-test-{uuid.uuid4().hex[:8]}"
        admin.execute_command("ACL", "SETUSER", name, "on", f">{password}", "resetchannels", *rules)
        made.append(name)
        return name

    try:
        yield make
    finally:
        for name in made:
            admin.execute_command("ACL", "DELUSER", name)
        admin.close()
