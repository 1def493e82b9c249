"""Given random sequences of public operations, the store always agrees with a plain model.

A Hypothesis stateful test (issue 33): a :class:`RuleBasedStateMachine`
parks (plain; keyed in each ``on_key`` mode, a debounce with or without
``max_wait``; tagged; under an id used before; in bulk), refuses a
``max_wait`` that is not a debounce's, cancels and reschedules (by id and
by tag), pauses and resumes, sets and removes a rate limit, releases with one companion pass
run in this process, lets a companion die after its claim, stops Redis
and starts it again from its append-only file, runs released tasks as a
worker does (success, failure, retry, ``Ignore``, ``Reject``) and
requeues dead letters, against a private ``redis-server``. After every
step it reads the store straight from its Redis keys (:func:`read_store`,
never through the API) and checks:

- each id the model knows is in exactly one state (due, held by one
  control, in flight, dead), and the store knows no other id;
- due times are those the calls asked for (on the Redis clock), a
  debounce's capped at its burst's first call + ``max_wait`` (issue 36);
- the key index (holders, running holds) and the tag index match the
  entries exactly, and so does each entry's record (a debounce's burst:
  its first call and cap);
- nothing is released before its due time, nothing twice, nothing lost:
  what the pass put in the broker is what the model says was due and let
  through, and what it dead-lettered is what the model dead-letters;
- every cancelled or replaced id is ``REVOKED`` in the result backend;
- the counts of ``zdelay status`` (:func:`celery_zdelay.store.admin.counts`),
  the held counts of ``zdelay limit`` (:func:`celery_zdelay.limits.controls`)
  and the tag counts of the dashboard equal the model's;
- the read model says the model's state: :func:`~celery_zdelay.store.lookup.find`
  (what ``lookup`` and the dashboard's entry page read) and the listing give
  each id the :class:`~celery_zdelay.store.read_model.EntryState` of its
  model state, and the same control holding it.

Time: due times are now, an hour or two hours from the Redis clock, so
"due" never depends on how fast the machine is; :func:`_time_passes`
moves the due set an hour earlier with the testing fast-forward's own
script (``celery_zdelay/testing/shift.lua``), and the debounce bursts'
first calls with it.

Budget: the Hypothesis profile named by ``ZDELAY_MODEL_PROFILE`` (``ci``,
the default; ``deep`` for ``make model-check``). Every counterexample it
shrank is a plain regression test in ``test_state_model_found.py``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
from collections import Counter
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Any

import pytest
import redis
from celery import Celery, states
from celery.exceptions import Ignore, Reject
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kombu import Queue

import celery_zdelay
from celery_zdelay import limits, steering
from celery_zdelay.app_state import RELEASED_BY_TEST, store_for
from celery_zdelay.companion import Companion
from celery_zdelay.store import admin
from celery_zdelay.store.admin import MAX_LIST_LIMIT, EntryState
from celery_zdelay.store.lookup import find
from celery_zdelay.store.marks import tag_count
from celery_zdelay.store.redis_keys import held_set_key, lanes_key, shard_keys
from celery_zdelay.testing import RedisServer
from celery_zdelay.testing.worker import InProcessWorker
from tests.conftest import BACKEND_DB, BROKER_DB, RECORD_DB
from tests.helpers import wait_for
from tests.project import close_app, make_app
from tests.support.clock import redis_ms

# -- budget -----------------------------------------------------------------------

#: Examples and steps per profile: ``ci`` in make test, ``deep`` in make model-check.
BUDGETS = {"ci": (50, 30), "deep": (1000, 60)}
for name, (examples, steps) in BUDGETS.items():
    settings.register_profile(
        name,
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        report_multiple_bugs=False,
    )
PROFILE = os.environ.get("ZDELAY_MODEL_PROFILE", "ci")
#: Seconds the whole machine test may take, per profile.
TIMEOUTS = {"ci": 600, "deep": 4 * 3600}

# -- the world the machine drives ---------------------------------------------------

PREFIX = "zdelay"
SHARD = 0
KEYS = shard_keys(PREFIX, SHARD)
HOUR_MS = 3_600_000
#: Due in: now, in an hour, in two hours (seconds).
COUNTDOWNS = (0, 3600, 7200)
#: Queues: two that work, and one whose broker list is a string (every
#: release to it fails for the message's sake: dead-lettered).
QUEUES = ("celery", "emails", "poison")
TASKS = ("model.run", "model.other")
PAUSABLE = ("queue:emails", "task:model.run")
LIMITED = "queue:emails"
#: 1/h with a burst of 2: two tokens for the whole example (no refill in it).
RATE, BURST = "1/h", 2
KEY_NAMES = ("k1", "k2")
TAG_NAMES = ("t1", "t2")
MODES = ("keep", "replace", "debounce", "until_finished")
#: Ids a caller may choose itself (so the same id comes back).
OWN_IDS = ("id-1", "id-2")
NEWLINE_ID = "id\n3"
OUTCOMES = ("success", "failure", "retry", "ignore", "reject")
#: A debounce's max_wait (seconds): none, or a cap below and above the countdowns.
MAX_WAITS = (None, 1800, 5400)

#: How the in-process worker's run of a task id ends (set by the machine).
_outcome_of: dict[str, str] = {}


def _register_tasks(app: Celery) -> None:
    def run(task: Any) -> str:
        outcome = _outcome_of.pop(task.request.id, "success")
        if outcome == "failure":
            raise ValueError("the model asked this run to fail")
        if outcome == "retry":
            raise task.retry(countdown=3600)
        if outcome == "ignore":
            raise Ignore()
        if outcome == "reject":
            raise Reject("the model asked this run to reject", requeue=False)
        return "ran"

    for name in TASKS:

        def body(self: Any, *args: Any, **kwargs: Any) -> str:
            return run(self)

        body.__name__ = name.replace(".", "_")
        app.task(name=name, shared=False, bind=True, max_retries=5)(body)


# -- the store as Redis holds it ---------------------------------------------------------


@dataclass
class Snapshot:
    """Every key of the shard, read straight from Redis."""

    due: dict[str, int]
    held: dict[str, dict[str, int]]
    lease: dict[str, int]
    leased: set[str]
    msg: set[str]
    dead: set[str]
    dead_msg: set[str]
    lanes: set[str]
    marks: dict[str, str]
    tagged: set[str]

    def places(self) -> Counter[str]:
        found: Counter[str] = Counter(self.due.keys())
        for members in self.held.values():
            found.update(members.keys())
        found.update(self.lease.keys())
        return found

    def lane_of(self, task_id: str) -> str | None:
        for lane, members in self.held.items():
            if task_id in members:
                return lane
        return None


#: The lane of a pause: its control's name after this (store/control.py), spelt out.
PAUSE_LANE = "pause|"


def _control(lane: str) -> str:
    """The control whose pause or limit holds the entries of *lane*."""
    return lane.removeprefix(PAUSE_LANE)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_store(client: redis.Redis) -> Snapshot:
    """Read the shard's state from its Redis keys (store/redis_keys.py names them)."""
    held_prefix = held_set_key(PREFIX, SHARD, "")
    held_names = sorted(
        _text(k)[len(held_prefix) :]
        for k in client.scan_iter(match=held_prefix.replace("[", "\\[") + "*", count=1000)
    )
    with client.pipeline(transaction=True) as pipe:
        pipe.zrange(KEYS.due, 0, -1, withscores=True)
        pipe.zrange(KEYS.lease, 0, -1, withscores=True)
        pipe.hkeys(KEYS.leased)
        pipe.hkeys(KEYS.msg)
        pipe.zrange(KEYS.dead, 0, -1)
        pipe.hkeys(KEYS.dead_msg)
        pipe.smembers(lanes_key(PREFIX, SHARD))
        pipe.hgetall(KEYS.marks)
        pipe.zrange(KEYS.tagged, 0, -1)
        for name in held_names:
            pipe.zrange(held_set_key(PREFIX, SHARD, name), 0, -1, withscores=True)
        replies = pipe.execute()
    due, lease, leased, msg, dead, dead_msg, lanes, marks, tagged = replies[:9]
    return Snapshot(
        due={_text(m): int(s) for m, s in due},
        held={
            name: {_text(m): int(s) for m, s in reply}
            for name, reply in zip(held_names, replies[9:], strict=True)
            if reply
        },
        lease={_text(m): int(s) for m, s in lease},
        leased={_text(m) for m in leased},
        msg={_text(m) for m in msg},
        dead={_text(m) for m in dead},
        dead_msg={_text(m) for m in dead_msg},
        lanes={_text(m) for m in lanes},
        marks={_text(k): _text(v) for k, v in marks.items()},
        tagged={_text(m) for m in tagged},
    )


def parse_record(record: str) -> tuple[str | None, str | None, tuple[str, ...]]:
    """(key, mode letter, tags) of a marks record: "<mode><hold>\\n<key>\\n<tag>..."."""
    lines = record.split("\n")
    key = lines[1] if len(lines) > 1 and lines[1] else None
    return key, (lines[0][:1] if key else None), tuple(t for t in lines[2:] if t)


MODE_LETTERS = {"keep": "k", "replace": "r", "debounce": "d", "until_finished": "u"}


def record_fields(record: str) -> dict[str, int]:
    """The head fields of a marks record (a debounce's "f" first call, "w" max_wait)."""
    return {part[0]: int(part[1:]) for part in record.partition("\n")[0].split(" ")[1:]}


# -- the model ------------------------------------------------------------------------


#: The read model's state of each of the model's states of a live entry.
STATE_OF = {"due": EntryState.PARKED, "held": EntryState.HELD, "in_flight": EntryState.IN_FLIGHT}


@dataclass
class Entry:
    """One parked task, as the model knows it."""

    id: str
    task: str
    queue: str
    key: str | None
    mode: str | None
    tags: tuple[str, ...]
    due_ms: int
    #: Order of entries due in the same millisecond (parking order).
    seq: int
    #: "due", "held", "in_flight".
    state: str = "due"
    lane: str | None = None
    #: Redis ms the lease of an in-flight entry ends.
    lease_until: int = 0
    #: A debounce's burst (issue 36): bounds of its first call's Redis ms,
    #: and its max_wait in ms (None: no cap).
    first: tuple[int, int] | None = None
    cap: int | None = None

    def order(self) -> tuple[int, int]:
        return (self.due_ms, self.seq)

    def marked(self) -> bool:
        return self.key is not None or bool(self.tags)


@dataclass
class Holder:
    id: str
    #: Released with until_finished: held while it runs.
    running: bool = False


@dataclass
class Model:
    entries: dict[str, Entry] = field(default_factory=dict)
    dead: dict[str, Entry] = field(default_factory=dict)
    holders: dict[str, Holder] = field(default_factory=dict)
    revoked: set[str] = field(default_factory=set)
    #: Ids a run ended in SUCCESS: Celery's result backend keeps a SUCCESS
    #: over any later state of the id (backends/base.py), REVOKED included.
    succeeded: set[str] = field(default_factory=set)
    paused: set[str] = field(default_factory=set)
    limited: bool = False
    tokens: int = BURST
    poison_broken: bool = True
    seq: int = 0
    #: Each id's place in the order ids were first parked.
    first_seen: dict[str, int] = field(default_factory=dict)

    def holder_ids(self) -> set[str]:
        return {h.id for h in self.holders.values()}

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def live(self, state: str) -> list[Entry]:
        return [e for e in self.entries.values() if e.state == state]

    def lane_of(self, entry: Entry, passed: str | None = None) -> str | None:
        """The lane that holds *entry* back at the gate (docs/control.rst): a
        pause holds in a set of its own, a limit in the set named by it."""
        task, queue = f"task:{entry.task}", f"queue:{entry.queue}"
        if task in self.paused:
            return PAUSE_LANE + task
        if queue in self.paused:
            return PAUSE_LANE + queue
        if self.limited and queue == LIMITED and passed != queue:
            return queue
        return None

    def forget_marks(self, task_id: str) -> None:
        """An entry leaves (cancelled, replaced, parked again): its key goes with it."""
        entry = self.entries.get(task_id)
        if entry is None or entry.key is None:
            return
        holder = self.holders.get(entry.key)
        if holder is not None and holder.id == task_id:
            del self.holders[entry.key]


# -- the machine ------------------------------------------------------------------------

#: Set by the fixture for the test's run: the server and the app.
_world: dict[str, Any] = {}


class StoreMachine(RuleBasedStateMachine):
    """Public operations at random; the store checked against :class:`Model` after each."""

    def __init__(self) -> None:
        super().__init__()
        server: RedisServer = _world["server"]
        server.client().flushall()
        self.app: Celery = _world["app"]
        self.client: redis.Redis = _world["client"]
        self.store = store_for(self.app)
        self.client.set("poison", "not a list: releases to it fail")
        self.companion = Companion(self.app, store=self.store)
        self.worker = InProcessWorker(self.app)
        self.connection = self.app.connection_for_write()
        self.model = Model()
        #: Released messages not yet run: (queue, raw envelope).
        self.inbox: list[tuple[str, bytes]] = []
        #: Bounds of the due ms of each entry the call being modelled parks.
        self._due_bounds: dict[str, tuple[int, int]] = {}
        #: Bounds of the Redis ms of the call being modelled (a burst's first call).
        self._call_ms: tuple[int, int] = (0, 0)
        self.released_total = 0
        _outcome_of.clear()

    def teardown(self) -> None:
        self.companion.close()
        self.worker.close()
        self.connection.close()

    # -- helpers ----------------------------------------------------------------------

    def _now(self) -> int:
        return redis_ms(self.client)

    def _task(self, name: str) -> Any:
        return self.app.tasks[name]

    def _due_of(self, task_id: str, low: int, high: int) -> int:
        score = self.client.zscore(KEYS.due, task_id)
        assert score is not None, f"{task_id!r} was parked but is not in the due set"
        due_ms = int(score) // 1024
        assert low <= due_ms <= high, f"{task_id!r} due {due_ms}, asked for [{low}, {high}]"
        return due_ms

    def _own_ids(self) -> st.SearchStrategy[str | None]:
        ids: list[str | None] = [None, None, *OWN_IDS]
        ids.append(NEWLINE_ID)
        return st.sampled_from(ids)

    def _park_one(
        self,
        task_id: str,
        task: str,
        queue: str,
        key: str | None,
        mode: str | None,
        tags: tuple[str, ...],
        revoked: set[str],
        asked: tuple[int, int] = (0, 0),
        max_wait_ms: int | None = None,
    ) -> tuple[str, bool]:
        """Park in the model as park_keyed.lua promises: (id parked for the call, parked?).

        *asked* bounds the due ms the call asked for; the entry's
        ``due_bounds`` are those, capped for a debounce at its burst's first
        call + max_wait (the burst passes from a holder still waiting).
        """
        model = self.model
        holder = model.holders.get(key) if key is not None else None
        first: tuple[int, int] | None = None
        cap: int | None = None
        if mode == "debounce":
            waiting = model.entries.get(holder.id) if holder and not holder.running else None
            if waiting is not None and waiting.state in ("due", "held") and waiting.first:
                first, cap = waiting.first, waiting.cap
            first = first or self._call_ms
            if max_wait_ms is not None and (cap is None or max_wait_ms < cap):
                cap = max_wait_ms
        if holder is not None:
            if holder.running and holder.id == task_id:
                pass  # a running task parks itself again (a retry): parked
            elif mode in ("keep", "until_finished"):
                return holder.id, False
            elif not holder.running and holder.id != task_id:
                # replace, debounce: the parked holder goes (one being
                # released cannot be stopped, and keeps running).
                taken = model.entries.get(holder.id)
                if taken is not None and taken.state in ("due", "held"):
                    model.forget_marks(holder.id)
                    del model.entries[holder.id]
                    revoked.add(holder.id)
        if task_id in model.entries:
            model.forget_marks(task_id)
        model.revoked.discard(task_id)
        model.first_seen.setdefault(task_id, model.next_seq())
        low, high = asked
        if first is not None and cap is not None:
            low, high = min(low, first[0] + cap), min(high, first[1] + cap)
        self._due_bounds[task_id] = (low, high)
        model.entries[task_id] = Entry(
            id=task_id,
            task=task,
            queue=queue,
            key=key,
            mode=mode,
            tags=tags,
            due_ms=0,
            seq=model.next_seq(),
            first=first,
            cap=cap,
        )
        if key is not None:
            model.holders[key] = Holder(task_id)
        return task_id, True

    def _settle_park(self, parked: list[str], revoked: set[str]) -> None:
        for task_id in parked:
            low, high = self._due_bounds.pop(task_id)
            self.model.entries[task_id].due_ms = self._due_of(task_id, low, high)
        self._due_bounds.clear()
        self.model.revoked |= revoked

    def _drain_broker(self) -> list[tuple[str, bytes]]:
        found = []
        for queue in ("celery", "emails"):
            raw = self.client.lrange(queue, 0, -1)
            if raw:
                self.client.delete(queue)
            found += [(queue, r) for r in raw]
        return found

    # -- parking --------------------------------------------------------------------

    @rule(
        data=st.data(),
        task=st.sampled_from(TASKS),
        queue=st.sampled_from(QUEUES),
        countdown=st.sampled_from(COUNTDOWNS),
        key=st.one_of(st.none(), st.sampled_from(KEY_NAMES)),
        mode=st.sampled_from(MODES),
        tags=st.sets(st.sampled_from(TAG_NAMES), max_size=2),
        max_wait=st.sampled_from(MAX_WAITS),
    )
    def park(
        self,
        data: st.DataObject,
        task: str,
        queue: str,
        countdown: int,
        key: str | None,
        mode: str,
        tags: set[str],
        max_wait: int | None,
    ) -> None:
        """apply_delayed: plain, keyed in a mode (a debounce maybe with max_wait), tagged,
        maybe under an id used before."""
        task_id = data.draw(self._own_ids(), label="task_id")
        options: dict[str, Any] = {"queue": queue}
        if task_id is not None:
            options["task_id"] = task_id
        if key is not None:
            options.update(key=key, on_key=mode)
        if key is None or mode != "debounce":
            max_wait = None
        if max_wait is not None:
            options["max_wait"] = max_wait
        if tags:
            options["tags"] = sorted(tags)
        holders_before = self.model.holder_ids()
        if task_id == NEWLINE_ID:
            # One rule for ids at the boundary (celery_zdelay.names): refused
            # with a clear error, nothing written; the invariants after this
            # step check that the store did not change.
            with pytest.raises(celery_zdelay.ConfigurationError, match="control characters"):
                self._task(task).apply_delayed((1,), countdown=countdown, **options)
            return
        before = self._now()
        result = self._task(task).apply_delayed((1,), countdown=countdown, **options)
        self._call_ms = (before, self._now())
        own = result.id if task_id is None else task_id
        if task_id is None and result.id in holders_before:
            own = f"kept-{self.model.next_seq()}"  # kept for a holder: never parked
        revoked: set[str] = set()
        expected, parked = self._park_one(
            own,
            task,
            queue,
            key,
            mode if key is not None else None,
            tuple(sorted(tags)),
            revoked,
            asked=(self._call_ms[0] + countdown * 1000, self._call_ms[1] + countdown * 1000),
            max_wait_ms=None if max_wait is None else max_wait * 1000,
        )
        assert result.id == expected, f"apply_delayed returned {result.id}, expected {expected}"
        self._settle_park([own] if parked else [], revoked)

    @rule(
        key=st.one_of(st.none(), st.sampled_from(KEY_NAMES)),
        mode=st.sampled_from(("keep", "replace", "until_finished")),
        many=st.booleans(),
    )
    def park_with_a_max_wait_that_is_no_debounces(
        self, key: str | None, mode: str, many: bool
    ) -> None:
        """max_wait without a debounced key: refused, nothing written (the invariants check)."""
        options: dict[str, Any] = {"max_wait": 60}
        if key is not None:
            options.update({"keys": [key]} if many else {"key": key}, on_key=mode)
        task = self._task("model.run")
        call = task.apply_delayed_many if many else task.apply_delayed
        with pytest.raises(celery_zdelay.ConfigurationError, match="max_wait="):
            call([(1,)] if many else (1,), countdown=0, **options)

    @rule(
        task=st.sampled_from(TASKS),
        queue=st.sampled_from(QUEUES),
        countdown=st.sampled_from(COUNTDOWNS),
        keys=st.lists(st.one_of(st.none(), st.sampled_from(KEY_NAMES)), min_size=1, max_size=3),
        mode=st.sampled_from(MODES),
        tags=st.sets(st.sampled_from(TAG_NAMES), max_size=2),
        max_wait=st.sampled_from(MAX_WAITS),
    )
    def park_many(
        self,
        task: str,
        queue: str,
        countdown: int,
        keys: list[str | None],
        mode: str,
        tags: set[str],
        max_wait: int | None,
    ) -> None:
        """apply_delayed_many: calls due together, with or without keys, one on_key
        (a debounce maybe with max_wait)."""
        options: dict[str, Any] = {"queue": queue}
        if any(k is not None for k in keys):
            options.update(keys=keys, on_key=mode)
        if "keys" not in options or mode != "debounce":
            max_wait = None
        if max_wait is not None:
            options["max_wait"] = max_wait
        if tags:
            options["tags"] = sorted(tags)
        before = self._now()
        results = self._task(task).apply_delayed_many(
            [(n,) for n in range(len(keys))], countdown=countdown, **options
        )
        self._call_ms = (before, self._now())
        low, high = (self._call_ms[0] + countdown * 1000, self._call_ms[1] + countdown * 1000)
        returned = [r.id for r in results]
        # The model parks the calls one after the other under stand-in ids;
        # a call still parked at the end returned its own id (a result names
        # the key's holder after the call), which the stand-in then takes. A
        # call replaced by a later one of the same batch was never parked.
        model = self.model
        stand_ins = [f"call-{model.next_seq()}" for _ in keys]
        revoked: set[str] = set()
        for own, key in zip(stand_ins, keys, strict=True):
            self._park_one(
                own,
                task,
                queue,
                key,
                mode if key is not None else None,
                tuple(sorted(tags)),
                revoked,
                asked=(low, high),
                max_wait_ms=None if max_wait is None or key is None else max_wait * 1000,
            )
        revoked -= set(stand_ins)
        real = {own: returned[n] for n, own in enumerate(stand_ins) if own in model.entries}
        for own, task_id in real.items():
            model.first_seen[task_id] = model.first_seen.pop(own)
            entry = model.entries.pop(own)
            entry.id = task_id
            model.entries[task_id] = entry
            self._due_bounds[task_id] = self._due_bounds.pop(own)
        for holder in model.holders.values():
            holder.id = real.get(holder.id, holder.id)
        expected = [
            real[own] if key is None else model.holders[key].id
            for own, key in zip(stand_ins, keys, strict=True)
        ]
        assert returned == expected, f"apply_delayed_many returned {returned}, expected {expected}"
        self._settle_park(list(real.values()), revoked)

    # -- steering ---------------------------------------------------------------------

    def _some_id(self, data: st.DataObject) -> str:
        # In the order the ids came, not by their (random) value: the same
        # draws pick the same ids when Hypothesis replays a case.
        known = [i for i in self.model.entries if i not in self.model.dead]
        known = sorted([*known, *self.model.dead], key=lambda i: self.model.first_seen.get(i, 0))
        return data.draw(st.sampled_from([*known, "unknown-id"]), label="task_id")

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        """cancel(id): a due or held entry goes, REVOKED; nothing else changes."""
        task_id = self._some_id(data)
        entry = self.model.entries.get(task_id)
        expected = entry is not None and entry.state in ("due", "held")
        assert celery_zdelay.cancel(task_id, app=self.app) is expected
        if expected:
            self.model.forget_marks(task_id)
            del self.model.entries[task_id]
            self.model.revoked.add(task_id)

    @rule(data=st.data(), countdown=st.sampled_from(COUNTDOWNS))
    def reschedule(self, data: st.DataObject, countdown: int) -> None:
        """reschedule(id): a due or held entry is due at the new time, in the due set."""
        task_id = self._some_id(data)
        entry = self.model.entries.get(task_id)
        expected = entry is not None and entry.state in ("due", "held")
        low = self._now() + countdown * 1000
        assert celery_zdelay.reschedule(task_id, countdown=countdown, app=self.app) is expected
        high = self._now() + countdown * 1000
        if expected:
            assert entry is not None
            entry.state, entry.lane, entry.seq = "due", None, self.model.next_seq()
            entry.due_ms = self._due_of(task_id, low, high)

    def _tagged(self, tag: str) -> list[Entry]:
        return [
            e for e in self.model.entries.values() if tag in e.tags and e.state in ("due", "held")
        ]

    @rule(tag=st.sampled_from(TAG_NAMES))
    def cancel_by_tag(self, tag: str) -> None:
        """cancel_matching(tag=): every due or held entry of the tag, none other."""
        chosen = self._tagged(tag)
        assert celery_zdelay.cancel_matching(tag=tag, app=self.app) == len(chosen)
        for entry in chosen:
            self.model.forget_marks(entry.id)
            del self.model.entries[entry.id]
            self.model.revoked.add(entry.id)

    @rule(tag=st.sampled_from(TAG_NAMES), countdown=st.sampled_from(COUNTDOWNS))
    def reschedule_by_tag(self, tag: str, countdown: int) -> None:
        """reschedule_matching(tag=): every due or held entry of the tag moves."""
        chosen = self._tagged(tag)
        low = self._now() + countdown * 1000
        moved = celery_zdelay.reschedule_matching(tag=tag, countdown=countdown, app=self.app)
        high = self._now() + countdown * 1000
        assert moved == len(chosen)
        for entry in sorted(chosen, key=Entry.order):
            entry.state, entry.lane, entry.seq = "due", None, self.model.next_seq()
            entry.due_ms = self._due_of(entry.id, low, high)

    # -- control --------------------------------------------------------------------

    @rule(name=st.sampled_from(PAUSABLE))
    def pause(self, name: str) -> None:
        celery_zdelay.pause(name, app=self.app)
        self.model.paused.add(name)

    @rule(name=st.sampled_from(PAUSABLE))
    def resume(self, name: str) -> None:
        assert celery_zdelay.resume(name, app=self.app) is (name in self.model.paused)
        self.model.paused.discard(name)

    @rule(on=st.booleans())
    def rate_limit(self, on: bool) -> None:
        """set_rate_limit(queue:emails, 1/h burst 2) or None: the bucket outlives it."""
        celery_zdelay.set_rate_limit(
            LIMITED, RATE if on else None, burst=BURST if on else None, app=self.app
        )
        self.model.limited = on

    # -- release ----------------------------------------------------------------------

    def _release(self, entry: Entry) -> str:
        """The entry leaves through the broker (or dies there); return "released"/"dead"."""
        model = self.model
        del model.entries[entry.id]
        holder = model.holders.get(entry.key) if entry.key is not None else None
        if entry.queue == "poison" and model.poison_broken:
            if holder is not None and holder.id == entry.id:
                del model.holders[entry.key]  # type: ignore[arg-type]
            model.dead[entry.id] = replace(entry, state="dead", lane=None)
            return "dead"
        if holder is not None and holder.id == entry.id and not holder.running:
            if entry.mode == "until_finished":
                holder.running = True
            else:
                del model.holders[entry.key]  # type: ignore[arg-type]
        return "released"

    def _leases_expire(self) -> None:
        """Wait (a few ms) for the 1 ms leases of dead companions: the next claim recovers them."""
        flying = self.model.live("in_flight")
        if flying:
            until = max(e.lease_until for e in flying)
            wait_for(lambda: self._now() > until, timeout=5, message="the leases to expire")
        for entry in flying:
            entry.state = "due"

    @rule()
    def release(self) -> None:
        """One companion pass, as the companion loop runs it (Companion.release_due)."""
        model = self.model
        self._leases_expire()
        now_ms = self._now()
        outcome: dict[str, str] = {}
        due_of = {e.id: e.due_ms for e in model.entries.values()}
        for entry in sorted(model.live("due"), key=Entry.order):
            if entry.due_ms > now_ms:
                continue
            lane = model.lane_of(entry)
            if lane is not None:
                entry.state, entry.lane = "held", lane
            else:
                outcome[entry.id] = self._release(entry)
        releasable = {e.lane for e in model.live("held")} | ({LIMITED} if model.limited else set())

        # Held sets to drain first, then the limit: what a resumed pause
        # moves under the limit goes out in the same pass, as tokens allow.
        def flow(name: str) -> tuple[bool, str]:
            return (model.limited and name == LIMITED, name)

        for lane in sorted(releasable, key=flow):
            if _control(lane) in model.paused:
                continue
            held = sorted((e for e in model.live("held") if e.lane == lane), key=Entry.order)
            granted = len(held)
            if model.limited and lane == LIMITED:
                granted = min(model.tokens, len(held))
                model.tokens -= granted
            for entry in held[:granted]:
                again = model.lane_of(entry, passed=lane)
                if again is not None:
                    entry.lane = again
                else:
                    outcome[entry.id] = self._release(entry)
        self.companion.gate.refresh(self.companion.shards, force=True)
        report = self.companion.release_due()
        after_ms = self._now()
        assert not report.failed
        released = [o for o in outcome if outcome[o] == "released"]
        dead = [o for o in outcome if outcome[o] == "dead"]
        sent = self._drain_broker()
        sent_ids = Counter(json.loads(raw)["headers"]["id"] for _, raw in sent)
        assert sent_ids == Counter(released), (
            f"released {dict(sent_ids)}, the model expected {sorted(released)}"
        )
        assert report.dead_lettered == len(dead), (
            f"{report.dead_lettered} dead-lettered, the model expected {sorted(dead)}"
        )
        for _, raw in sent:
            envelope = json.loads(raw)
            assert envelope["headers"].get("retries", 0) == 0
        # Never early: what went out was due when the pass began.
        assert all(due_of[task_id] <= now_ms <= after_ms for task_id in sent_ids)
        self.inbox += sent
        self.released_total += len(sent)

    @rule()
    def companion_dies_after_claim(self) -> None:
        """A companion claims what is due and dies: in flight until the lease ends."""
        self._leases_expire()
        now_ms = self._now()
        result = self.store.claim(SHARD, limit=1000, lease_ms=1)
        due = [e for e in self.model.live("due") if e.due_ms <= now_ms]
        assert sorted(c.task_id for c in result.entries) == sorted(e.id for e in due)
        for entry in due:
            entry.state, entry.lease_until = "in_flight", result.now_ms + 1

    @rule()
    def redis_restarts_from_its_aof(self) -> None:
        """Redis stops (SIGTERM) and starts again from its append-only file.

        It writes every write it acknowledged to the file as it stops, so the
        store must come back exactly as the model left it: clients reconnect
        and scripts load again on their own. (A SIGKILL with ``appendfsync
        always`` says the same, at a disk sync per write: three times the
        test's time.)
        """
        server: RedisServer = _world["server"]
        server.restart()

    @rule()
    def time_passes(self) -> None:
        """An hour passes for the due set (the testing fast-forward's shift.lua)."""
        shift = resources.files("celery_zdelay.testing").joinpath("shift.lua").read_text()
        self.client.register_script(shift)(keys=[KEYS.due, KEYS.marks], args=[HOUR_MS])
        for entry in self.model.live("due"):
            entry.due_ms -= HOUR_MS
        # A debounce's burst started an hour earlier too, parked, held, in flight or dead.
        for entry in [*self.model.entries.values(), *self.model.dead.values()]:
            if entry.first is not None:
                entry.first = (entry.first[0] - HOUR_MS, entry.first[1] - HOUR_MS)

    # -- workers ------------------------------------------------------------------------

    @precondition(lambda self: bool(self.inbox))
    @rule(data=st.data(), outcome=st.sampled_from(OUTCOMES))
    def worker_runs(self, data: st.DataObject, outcome: str) -> None:
        """A worker runs a released task, which ends as *outcome* (Celery's own tracer)."""
        index = data.draw(st.integers(0, len(self.inbox) - 1), label="message")
        queue, raw = self.inbox[index]
        headers = json.loads(raw)["headers"]
        task_id, key = headers["id"], headers.get("zdelay_key")
        until_finished = headers.get("zdelay_on_key") == "until_finished"
        holder = self.model.holders.get(key) if key is not None else None
        runs_holder = holder is not None and holder.id == task_id and holder.running
        del self.inbox[index]
        self.client.rpush(queue, raw)
        _outcome_of[task_id] = outcome
        # Taken from its own queue only (the poison queue cannot be read).
        message = (
            Queue(queue)
            .bind(self.connection.default_channel)
            .get(no_ack=False, accept=self.app.conf.accept_content)
        )
        assert message is not None
        assert message.headers["id"] == task_id
        self.worker.run(message)
        # The backend keeps the last state of an id: an earlier release of an
        # id cancelled since (parked again under it) ran, and says so.
        self.model.revoked.discard(task_id)
        if outcome == "success":
            self.model.succeeded.add(task_id)
        retried = self._drain_broker()
        assert all(json.loads(r)["headers"]["id"] == task_id for _, r in retried)
        assert len(retried) == (1 if outcome == "retry" else 0)
        if until_finished and runs_holder and outcome != "retry":
            del self.model.holders[key]

    # -- dead letters ---------------------------------------------------------------------

    @precondition(lambda self: bool(self.model.dead))
    @rule(data=st.data())
    def requeue(self, data: st.DataObject) -> None:
        """requeue_dead([id]): due now again, its tags back, its key if still free."""
        model = self.model
        dead = sorted(model.dead, key=lambda i: model.first_seen.get(i, 0))
        task_id = data.draw(st.sampled_from(dead), label="task_id")
        live = model.entries.get(task_id)
        low = self._now()
        (done,) = steering.requeue_dead([task_id], app=self.app)
        high = self._now()
        assert done is (live is None), f"requeue_dead({task_id!r}) said {done}"
        if not done:
            return
        entry = model.dead.pop(task_id)
        if entry.key is not None:
            if entry.key in model.holders:
                entry = replace(entry, key=None, mode=None, first=None, cap=None)
            else:
                model.holders[entry.key] = Holder(task_id)
        model.entries[task_id] = replace(
            entry, state="due", seq=model.next_seq(), due_ms=self._due_of(task_id, low, high)
        )

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def store_matches_model(self) -> None:
        model, snap = self.model, read_store(self.client)
        # Each id in exactly one place, and the payloads with them.
        places = snap.places()
        assert [i for i, n in places.items() if n > 1] == [], f"in two places: {snap}"
        assert snap.msg == set(places), f"payloads {snap.msg} for entries {set(places)}"
        assert snap.leased == set(snap.lease)
        assert snap.dead_msg == snap.dead
        # ...the model's ids, each in the model's state.
        assert set(places) == set(model.entries), (
            f"store has {sorted(places)}, model {sorted(model.entries)}"
        )
        assert snap.dead == set(model.dead), f"dead {sorted(snap.dead)}, model {sorted(model.dead)}"
        for entry in model.entries.values():
            if entry.state == "due":
                assert entry.id in snap.due, f"{entry.id} should be due: {snap}"
                assert snap.due[entry.id] // 1024 == entry.due_ms
            elif entry.state == "held":
                assert snap.lane_of(entry.id) == entry.lane, f"{entry.id} held by {entry.lane}"
                assert snap.held[entry.lane][entry.id] // 1024 == entry.due_ms  # type: ignore[index]
            else:
                assert entry.id in snap.lease
        # The key and tag index: records, holders, tag members, exactly.
        expected_marks: dict[str, tuple[str | None, str | None, tuple[str, ...]]] = {}
        for prefix, entries in (("i:", model.entries), ("d:", model.dead)):
            for entry in entries.values():
                if entry.marked():
                    mode = MODE_LETTERS[entry.mode] if entry.mode else None
                    expected_marks[prefix + entry.id] = (entry.key, mode, entry.tags)
        records = {
            name: parse_record(value)
            for name, value in snap.marks.items()
            if name.startswith(("i:", "d:"))
        }
        assert records == expected_marks, f"records {records}, model {expected_marks}"
        # A debounce's record carries its burst: the first call's Redis ms
        # (within the bounds of that call) and the cap; no other record has one.
        for prefix, entries in (("i:", model.entries), ("d:", model.dead)):
            for entry in entries.values():
                if not entry.marked():
                    continue
                fields = record_fields(snap.marks[prefix + entry.id])
                if entry.first is None:
                    assert fields == {}, f"{entry.id}: fields {fields}, model no burst"
                    continue
                assert entry.first[0] <= fields["f"] <= entry.first[1], (
                    f"{entry.id}: burst from {fields['f']}, model {entry.first}"
                )
                assert fields.get("w") == entry.cap, f"{entry.id}: cap {fields}, model {entry.cap}"
        holders = {
            name[2:]: (value.partition("\n")[0], bool(value.partition("\n")[2]))
            for name, value in snap.marks.items()
            if name.startswith("k:")
        }
        assert holders == {k: (h.id, h.running) for k, h in model.holders.items()}, (
            f"key holders {holders}, model {model.holders}"
        )
        tagged = {f"{t}\n{e.id}" for e in model.entries.values() for t in e.tags}
        assert snap.tagged == tagged, f"tag index {snap.tagged}, model {tagged}"

    @invariant()
    def readers_say_each_ids_model_state(self) -> None:
        """lookup (as the dashboard's entry page reads it) and the listing say the model's state."""
        model = self.model
        listed = {e.task_id: e for e in admin.list_parked(self.store, limit=MAX_LIST_LIMIT).entries}
        assert set(listed) == set(model.entries), f"listed {sorted(listed)}"
        for task_id in {*model.entries, *model.dead}:
            entry = model.entries.get(task_id)
            expected = EntryState.DEAD if entry is None else STATE_OF[entry.state]
            found = find(self.store, task_id)
            assert found is not None, f"{task_id} not found, model {expected}"
            assert found.state is expected, f"{task_id} {found.state}, model {expected}"
            if entry is not None:
                assert listed[task_id].state is expected
                control = None if entry.lane is None else _control(entry.lane)
                assert found.held_by == listed[task_id].held_by == control

    @invariant()
    def admin_reads_match_model(self) -> None:
        model = self.model
        counts = admin.counts(self.store)
        now_ms = counts.now_ms
        due = model.live("due")
        flying = model.live("in_flight")
        assert counts.parked == len(due)
        assert counts.in_flight == len(flying)
        assert counts.dead == len(model.dead)
        assert counts.overdue == sum(1 for e in [*due, *flying] if e.due_ms <= now_ms)
        waiting = {c.name: c.waiting for c in limits.controls(app=self.app) if c.waiting}
        held = Counter(_control(e.lane) for e in model.live("held") if e.lane is not None)
        assert waiting == dict(held), f"controls() waiting {waiting}, model {dict(held)}"
        for tag in TAG_NAMES:
            assert tag_count(self.store, tag) == sum(
                1 for e in model.entries.values() if tag in e.tags
            )

    @invariant()
    def cancelled_ids_are_revoked(self) -> None:
        backend = self.app.backend
        for task_id in self.model.revoked:
            state = backend.get_task_meta(task_id)["status"]
            if state == states.SUCCESS and task_id in self.model.succeeded:
                continue  # an id reused after a success: Celery keeps the SUCCESS
            assert state == states.REVOKED, f"{task_id} cancelled but {state}"


@pytest.fixture
def model_world() -> Any:
    """The private Redis and the app the machine drives (one per test).

    Its own server, with an append-only file: the machine restarts it.
    """
    redis_server = RedisServer(appendonly="yes").start()
    url = redis_server.url
    app = make_app(
        f"{url}/{BROKER_DB}",
        f"{url}/{BACKEND_DB}",
        f"{url}/{RECORD_DB}",
        conf={"zdelay_redis_url": f"{url}/{BROKER_DB}"},
        queues=[{"name": q} for q in QUEUES],
    )
    _register_tasks(app)
    # The machine releases what it parks: no companion process is expected.
    setattr(app, RELEASED_BY_TEST, True)
    client = redis_server.client(BROKER_DB)
    _world.update(server=redis_server, app=app, client=client)
    yield
    _world.clear()
    # The machines' AsyncResults unsubscribe from the result backend when they
    # are collected: collect them while the session's Redis still answers (after
    # it, each __del__ failed to connect: an unraisable error at pytest's exit).
    gc.collect()
    client.close()
    with contextlib.suppress(Exception):
        close_app(app)
    redis_server.stop()


StoreMachine.TestCase.settings = settings.get_profile(PROFILE)
TestStateModel = StoreMachine.TestCase
TestStateModel.pytestmark = [  # type: ignore[attr-defined]
    pytest.mark.usefixtures("model_world"),
    pytest.mark.timeout(TIMEOUTS.get(PROFILE, 600)),
]
