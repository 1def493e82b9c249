"""Given random sequences of public operations, the store always agrees with a plain model.

A Hypothesis stateful test (issue 33): a :class:`RuleBasedStateMachine`
parks (plain; keyed in each ``on_key`` mode, a debounce with or without
``max_wait``; tagged; with a ``limit_key`` and a ``max_late``; under an id
used before, a periodic occurrence's among them; in bulk), refuses a
``max_wait`` that is not a debounce's and a ``max_late`` on a periodic
occurrence's id, cancels and reschedules (by id, by tag and by a queue
filter), pauses and resumes (a queue, a task, a ``limit_key:`` glob), sets
and removes a queue's rate limit and a per-key one, releases with one
companion pass run in this process, lets a companion die after its claim,
stops Redis and starts it again from its append-only file, runs released
tasks as a worker does (success, failure, retry, ``Ignore``, ``Reject``)
and requeues dead letters, against a private ``redis-server``. Each
example runs under one configuration drawn at its start: with or without
``zdelay_concurrency`` (a slot per tenant key, two for ``model.run``), a
``zdelay_on_stale`` (dead, drop, run) and a ``zdelay_max_late`` (none, or
an hour and a half). After every step it reads the store straight from
its Redis keys (:func:`read_store`, never through the API) and checks:

- each id the model knows is in exactly one state (due, held by one
  control's lane: a pause, a queue's or a key's limit, a concurrency slot
  name; in flight; dead), and the store knows no other id;
- due times are those the calls asked for (on the Redis clock), a
  debounce's capped at its burst's first call + ``max_wait`` (issue 36);
- the key index (owners, parked or running) and the tag index match the
  entries exactly, and so does each entry's record (a debounce's burst:
  its first call and cap);
- nothing is released before its due time, nothing twice, nothing lost:
  what the pass put in the broker is what the model says was due and let
  through (by pauses, limits, per-key buckets in turns, free slots), what
  it dead-lettered and dropped as stale is what the model says, and so are
  the pass's stale counts;
- every cancelled, replaced or dropped id is ``REVOKED`` in the result backend;
- each token bucket holds what the model says is left, and never granted
  more than ``burst + rate * T`` (``T`` on the Redis clock since its first
  grant: the rate is 1/h, so within an example that is the burst);
- each concurrency slot record holds exactly the ids the model says were
  released and have not finished (a retry keeps its slot), never more than
  its number, and the released-and-unfinished tasks of a slot name never
  outnumber it (an id released again while a release of it runs shares
  that slot, a documented limit: counted once, and not once it is freed);
- ``celery_zdelay.history(id)`` of every id the model parked is the list
  of events its transitions made (parked by which call, rescheduled, held
  by which control and why, released by this companion and how late,
  cancelled how and by whom, dead-lettered why, requeued), the last
  :data:`HISTORY_CAP` of them;
- the counts of ``zdelay status`` (:func:`celery_zdelay.store.admin.counts`),
  the held and running counts of ``zdelay limit``
  (:func:`celery_zdelay.limits.controls`) and the tag counts of the
  dashboard equal the model's;
- the read model says the model's state: :func:`~celery_zdelay.store.lookup.find`
  (what ``lookup`` and the dashboard's entry page read) and the listing give
  each id the :class:`~celery_zdelay.store.read_model.EntryState` of its
  model state, the same control holding it and why, and a dead letter's reason.

Time: due times are now, an hour or two hours from the Redis clock, so
"due" never depends on how fast the machine is; :func:`_time_passes`
moves the due set an hour earlier with the testing fast-forward's own
script (``celery_zdelay/testing/shift.lua``), and the debounce bursts'
first calls with it, and the held sets as well (which that script leaves
alone). Lateness is then a whole number of hours plus the test's own
seconds, and the ``max_late`` limits (30 min, 1.5 h, 2.5 h) lie between
those hours: whether a release is stale never depends on the machine's
speed. Token buckets and concurrency slots run on the real Redis clock,
which the test does not move: a 1/h bucket refills less than a token in an
example, and a slot ends by itself only after ``zdelay_max_run_seconds``
(an hour).

Budget: the Hypothesis profile named by ``ZDELAY_MODEL_PROFILE`` (``ci``,
the default; ``deep`` for ``make model-check``). Every counterexample it
shrank is a plain regression test in ``test_state_model_found.py``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Any

import pytest
import redis
from celery import Celery, states
from celery.exceptions import Ignore, Reject
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from kombu import Queue

import celery_zdelay
from celery_zdelay import limits, steering
from celery_zdelay.app_state import RELEASED_BY_TEST, store_for
from celery_zdelay.companion import Companion
from celery_zdelay.store import admin
from celery_zdelay.store.admin import MAX_LIST_LIMIT, EntryState
from celery_zdelay.store.lookup import find
from celery_zdelay.store.marks import tag_count
from celery_zdelay.store.redis_keys import control_keys, held_set_key, lanes_key, shard_keys
from celery_zdelay.task_history import HistoryEvent
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
CONTROL = control_keys(PREFIX)
HOUR_MS = 3_600_000
#: Due in: now, in an hour, in two hours (seconds).
COUNTDOWNS = (0, 3600, 7200)
#: Queues: two that work, and one whose broker list is a string (every
#: release to it fails for the message's sake: dead-lettered).
QUEUES = ("celery", "emails", "poison")
#: The queue a park draws: the poison queue one time in five (else a third
#: of the tasks would be dead letters, and few would run).
QUEUE_DRAWS = ("celery", "emails", "celery", "emails", "poison")
TASKS = ("model.run", "model.other")
#: Limit keys (issue 36), and the glob of their per-key limits and slots.
LIMIT_KEYS = ("tenant:1", "tenant:2")
KEY_GLOB = "limit_key:tenant:*"
PAUSABLE = ("queue:emails", "task:model.run", KEY_GLOB)
LIMITED = "queue:emails"
#: 1/h with a burst of 2: two tokens for the whole example (no refill in
#: it); the queue's limit and each key's bucket alike.
RATE, BURST = "1/h", 2
RATE_PER_MS = 1 / HOUR_MS
#: zdelay_concurrency of the examples that draw it: one task per tenant key
#: released and not finished, two of model.run.
CONCURRENCY = {KEY_GLOB: 1, "task:model.run": 2}
#: Every slot name those controls can take a slot of.
SLOT_NAMES = (*(f"{KEY_GLOB} {k}" for k in LIMIT_KEYS), "task:model.run")
KEY_NAMES = ("k1", "k2")
TAG_NAMES = ("t1", "t2")
#: What cancel_matching and reschedule_matching select by: a tag, or a queue.
MATCHES = (*(f"tag:{t}" for t in TAG_NAMES), *(f"queue:{q}" for q in QUEUES))
MODES = ("keep", "replace", "debounce", "until_finished")
#: Ids a caller may choose itself (so the same id comes back).
OWN_IDS = ("id-1", "id-2")
NEWLINE_ID = "id\n3"
#: An id of a periodic occurrence's form: never stale, and refused with a max_late.
PERIODIC_ID = "periodic:model.run:v1:0"
OUTCOMES = ("success", "failure", "retry", "ignore", "reject")
#: A debounce's max_wait (seconds): none, or a cap below and above the countdowns.
MAX_WAITS = (None, 1800, 5400)
#: A call's max_late (seconds): none, or between the whole hours of lateness.
MAX_LATES = (None, 1800, 9000)
#: The companions' zdelay_max_late (seconds), per example.
MAX_LATE_SETTINGS = (None, 5400)
ON_STALE = ("dead", "drop", "run")
#: No release this late or less is stale (no max_late is under a second).
STALE_FLOOR_MS = 1000
#: What the model calls the reason of a dead letter of the poison queue
#: (the refusal names that queue's list key: see :func:`seen`).
POISON_REASON = "poison queue refused it"
#: Events an id's history keeps (store/lua/_history.lua).
HISTORY_CAP = 50
#: Reschedules in a row of one step: two such steps overflow a history.
RESCHEDULES = 30

#: What apply_delayed_many is called with (the rule, and the first call of an example).
PARK_MANY: dict[str, st.SearchStrategy[Any]] = {
    "task": st.sampled_from(TASKS),
    "queue": st.sampled_from(QUEUE_DRAWS),
    "countdown": st.sampled_from(COUNTDOWNS),
    "keys": st.lists(st.one_of(st.none(), st.sampled_from(KEY_NAMES)), min_size=1, max_size=3),
    "mode": st.sampled_from(MODES),
    "tags": st.sets(st.sampled_from(TAG_NAMES), max_size=2),
    "max_wait": st.sampled_from(MAX_WAITS),
    "limit_key": st.one_of(st.none(), st.sampled_from(LIMIT_KEYS)),
    "max_late": st.sampled_from(MAX_LATES),
}

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


#: Lane names (store/control.py), spelt out: a pause holds in "pause|<control>",
#: a concurrency control in "concurrency|<slot name>" (a glob's slot name is
#: the glob, a space and the key), a key's limit in "limit_key:<key>", a
#: queue's limit in the control's name.
PAUSE_LANE = "pause|"
CONCURRENCY_LANE = "concurrency|"
KEY_LANE = "limit_key:"
#: What a lane of free slots passes entries on as: every limit passed.
PASSED_ALL = "|every limit"
#: The group the keys' own limits' lanes take turns in (ReleasePass: LIMIT_KEY).
KEY_TURNS = "limit_key"


def lane_base(lane: str) -> str:
    """The control's lane a limit key's lane under a pause or the queue's limit is
    one of ("<lane> <limit key>"); any other lane itself. Also its bucket's name."""
    if lane.startswith((KEY_LANE, CONCURRENCY_LANE)):
        return lane
    return lane.split(" ", 1)[0]


def lane_control(lane: str) -> str:
    """The control whose pause, limit or slots hold the entries of *lane* (``held_by``)."""
    if lane.startswith(CONCURRENCY_LANE):
        return lane.removeprefix(CONCURRENCY_LANE).split(" ", 1)[0]
    return lane_base(lane).removeprefix(PAUSE_LANE)


def slot_control(slot: str) -> str:
    """The concurrency control a slot name counts under."""
    return slot.split(" ", 1)[0]


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
    """(key, mode letter, tags) of a marks record: "<mode><max run>\\n<key>\\n<tag>..."."""
    lines = record.split("\n")
    key = lines[1] if len(lines) > 1 and lines[1] else None
    return key, (lines[0][:1] if key else None), tuple(t for t in lines[2:] if t)


MODE_LETTERS = {"keep": "k", "replace": "r", "debounce": "d", "until_finished": "u"}


def record_fields(record: str) -> dict[str, int]:
    """The head fields of a marks record (a debounce's "f" first call, "w" max_wait)."""
    return {part[0]: int(part[1:]) for part in record.partition("\n")[0].split(" ")[1:]}


def seen(event: HistoryEvent) -> tuple[Any, ...]:
    """What of a history event the model predicts: its name and the fields that apply."""
    due = None if event.due is None else round(event.due.timestamp() * 1000)
    if event.event == "parked":
        return ("parked", event.call, due)
    if event.event == "rescheduled":
        return ("rescheduled", due)
    if event.event in ("held", "cancelled"):
        return (event.event, event.reason, event.by)
    if event.event == "released":
        return ("released", event.by)
    if event.event == "dead":
        # The poison queue's refusal says what to do about that key: its name says enough.
        refused = event.reason is not None and event.reason.startswith("queue list poison ")
        return ("dead", POISON_REASON if refused else event.reason)
    return (event.event,)


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
    #: "due", "held", "in_flight", "dead".
    state: str = "due"
    lane: str | None = None
    #: Redis ms the lease of an in-flight entry ends.
    lease_until: int = 0
    #: A debounce's burst (issue 36): bounds of its first call's Redis ms,
    #: and its max_wait in ms (None: no cap).
    first: tuple[int, int] | None = None
    cap: int | None = None
    #: Its limit key and its own max_late in ms (issue 36).
    limit_key: str | None = None
    max_late_ms: int | None = None
    #: Why a dead letter is dead: "stale", or the poison queue's refusal (None).
    reason: str | None = None

    def order(self) -> tuple[int, int]:
        return (self.due_ms, self.seq)

    def marked(self) -> bool:
        return self.key is not None or bool(self.tags)


@dataclass
class Owner:
    id: str
    #: Released with until_finished: owns the key while it runs.
    running: bool = False


@dataclass
class Seen:
    """An event the model expects in an id's history (see :func:`seen`)."""

    fields: tuple[Any, ...]
    #: A release's: the bounds of how late (ms) it can say it was.
    late: tuple[int, int] | None = None


@dataclass
class Model:
    entries: dict[str, Entry] = field(default_factory=dict)
    dead: dict[str, Entry] = field(default_factory=dict)
    owners: dict[str, Owner] = field(default_factory=dict)
    revoked: set[str] = field(default_factory=set)
    #: Ids a run ended in SUCCESS: Celery's result backend keeps a SUCCESS
    #: over any later state of the id (backends/base.py), REVOKED included.
    succeeded: set[str] = field(default_factory=set)
    paused: set[str] = field(default_factory=set)
    #: The queue's limit, and the per-key limit of KEY_GLOB, set.
    limited: bool = False
    key_limited: bool = False
    #: Tokens left per bucket (named by its lane: the queue's, "limit_key:<key>"),
    #: those it granted, and the Redis ms of its first grant; a bucket not
    #: here was never taken from.
    tokens: dict[str, int] = field(default_factory=dict)
    granted: dict[str, int] = field(default_factory=dict)
    first_grant: dict[str, int] = field(default_factory=dict)
    #: This example's configuration: zdelay_concurrency set, zdelay_on_stale,
    #: zdelay_max_late in ms.
    concurrency: bool = False
    on_stale: str = "dead"
    max_late_ms: int | None = None
    #: Per slot name, the ids that took a slot: released, not finished.
    slots: dict[str, set[str]] = field(default_factory=dict)
    #: Ids whose run ended in a retry (its message dropped): unfinished, per slot name.
    retrying: dict[str, list[str]] = field(default_factory=dict)
    #: Ids released again while a release of them was unfinished, until none
    #: of theirs is: they share one slot (counted once, and not after it is freed).
    shared: set[str] = field(default_factory=set)
    #: Per group of lanes served in turns (a control's bucket; KEY_TURNS for
    #: the keys' own limits), the lane that released first in its last pass.
    turns: dict[str, str] = field(default_factory=dict)
    #: The lanes set: each lane entries were held in, until a pass finds it empty.
    lanes: set[str] = field(default_factory=set)
    #: Per id parked, the events its history should hold.
    history: dict[str, list[Seen]] = field(default_factory=dict)
    poison_broken: bool = True
    seq: int = 0
    #: Each id's place in the order ids were first parked.
    first_seen: dict[str, int] = field(default_factory=dict)

    def owner_ids(self) -> set[str]:
        return {o.id for o in self.owners.values()}

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def live(self, state: str) -> list[Entry]:
        return [e for e in self.entries.values() if e.state == state]

    def saw(self, task_id: str, *fields: Any) -> Seen:
        event = Seen(fields)
        self.history.setdefault(task_id, []).append(event)
        return event

    def limit_of(self, lane: str) -> bool:
        """Whether a rate limit releases *lane* (a queue's, or a key's under KEY_GLOB)."""
        if lane_base(lane) == LIMITED:
            return self.limited
        return lane.startswith(KEY_LANE) and self.key_limited

    def lane_of(self, entry: Entry, passed: str | None = None) -> str | None:
        """The lane that holds *entry* back at the gate (docs/control.rst): a
        pause holds in a set of its own; then the queue's limit, the task's,
        the key's, each in the lane named by it, but those up to *passed*
        (the limit whose tokens released it; PASSED_ALL: every limit). With a
        limit key, a pause's or the queue's lane holds it in the lane of its key
        under it (issue 36: fair turns)."""
        lane = self._held_by(entry, passed)
        if lane is None or entry.limit_key is None or lane.startswith(KEY_LANE):
            return lane
        return f"{lane} {entry.limit_key}"

    def _held_by(self, entry: Entry, passed: str | None) -> str | None:
        task, queue = f"task:{entry.task}", f"queue:{entry.queue}"
        if task in self.paused:
            return PAUSE_LANE + task
        if queue in self.paused:
            return PAUSE_LANE + queue
        order = [queue, task]
        if entry.limit_key is not None:
            if KEY_GLOB in self.paused:
                return PAUSE_LANE + KEY_GLOB
            order.append(KEY_LANE + entry.limit_key)
        start = (
            len(order)
            if passed == PASSED_ALL
            else order.index(passed) + 1
            if passed in order
            else 0
        )
        for name in order[start:]:
            if self.limit_of(name):
                return name
        return None

    def slots_of(self, task: str, limit_key: str | None) -> list[str]:
        """The slot names a task takes a slot in, in the controls' sorted order."""
        if not self.concurrency:
            return []
        found = []
        for name in sorted(CONCURRENCY):
            if name == KEY_GLOB and limit_key is not None:
                found.append(f"{KEY_GLOB} {limit_key}")
            elif name == f"task:{task}":
                found.append(name)
        return found

    def stopped(self, lane: str) -> bool:
        """Whether a pause stops *lane* from being released (a paused glob: its keys' lanes)."""
        control = lane_control(lane)
        return control in self.paused or (control.startswith(KEY_LANE) and KEY_GLOB in self.paused)

    def held_reason(self, lane: str) -> str:
        """Why *lane* holds its entries now, as lookup and the listing say."""
        if lane.startswith(PAUSE_LANE) or self.stopped(lane):
            return "pause"
        return "concurrency" if lane.startswith(CONCURRENCY_LANE) else "rate_limit"

    def known_controls(self) -> set[str]:
        """The controls limited, paused or with a concurrency number now."""
        names = set(self.paused)
        if self.limited:
            names.add(LIMITED)
        if self.key_limited:
            names.add(KEY_GLOB)
        if self.concurrency:
            names.update(CONCURRENCY)
        return names

    def group(self, lane: str) -> str:
        """The control *lane* counts under in ``controls()``: a key's lane under its glob."""
        control = lane_control(lane)
        known = self.known_controls()
        if not control.startswith(KEY_LANE) or control in known:
            return control
        return KEY_GLOB if KEY_GLOB in known else "limit_key:*"

    def forget_marks(self, task_id: str) -> None:
        """An entry leaves (cancelled, replaced, parked again): its key goes with it."""
        entry = self.entries.get(task_id)
        if entry is None or entry.key is None:
            return
        owner = self.owners.get(entry.key)
        if owner is not None and owner.id == task_id:
            del self.owners[entry.key]


@dataclass
class Pass:
    """What the model says one companion pass does."""

    #: The Redis ms the pass began (its claims are as late as this, or a little later).
    now_ms: int
    released: list[str] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)
    #: Stale entries, per zdelay_on_stale outcome ("run": once published).
    stale: Counter[str] = field(default_factory=Counter)
    #: History events of the releases, with the due time each was late from.
    releases: list[tuple[Seen, int]] = field(default_factory=list)


# -- the machine ------------------------------------------------------------------------

#: Set by the fixture for the test's run: the server, a client, and the app
#: of each configuration ((concurrency, on_stale, max_late) -> app).
_world: dict[str, Any] = {}


class StoreMachine(RuleBasedStateMachine):
    """Public operations at random; the store checked against :class:`Model` after each."""

    def __init__(self) -> None:
        super().__init__()
        server: RedisServer = _world["server"]
        server.client().flushall()
        self.client: redis.Redis = _world["client"]
        self.client.set("poison", "not a list: releases to it fail")
        self.model = Model()
        #: Released messages not yet run: (queue, raw envelope).
        self.inbox: list[tuple[str, bytes]] = []
        #: Bounds of the due ms of each entry the call being modelled parks.
        self._due_bounds: dict[str, tuple[int, int]] = {}
        #: Bounds of the Redis ms of the call being modelled (a burst's first call).
        self._call_ms: tuple[int, int] = (0, 0)
        self._pass = Pass(now_ms=0)
        self.released_total = 0
        self._closers: list[Callable[[], None]] = []
        #: Per id, its raw history record and the model's event count when last read.
        self._histories_read: dict[str, tuple[bytes | None, int]] = {}
        _outcome_of.clear()

    @initialize(
        concurrency=st.booleans(),
        on_stale=st.sampled_from(ON_STALE),
        max_late=st.sampled_from(MAX_LATE_SETTINGS),
        first=st.fixed_dictionaries(PARK_MANY),
    )
    def configure(
        self, concurrency: bool, on_stale: str, max_late: int | None, first: dict[str, Any]
    ) -> None:
        """The example's settings (zdelay_concurrency, zdelay_on_stale, zdelay_max_late),
        and a first apply_delayed_many: every example starts with something parked."""
        self.app: Celery = _world["app_for"](concurrency, on_stale, max_late)
        self.store = store_for(self.app)
        self.companion = Companion(self.app, store=self.store)
        self.worker = InProcessWorker(self.app)
        self.connection = self.app.connection_for_write()
        self._closers += [self.companion.close, self.worker.close, self.connection.close]
        model = self.model
        model.concurrency, model.on_stale = concurrency, on_stale
        model.max_late_ms = None if max_late is None else max_late * 1000
        self.park_many(**first)

    def teardown(self) -> None:
        for close in self._closers:
            close()
        # The collector runs here, between examples, and never inside a step
        # (model_world turns it off): see model_world.
        gc.collect()

    # -- helpers ----------------------------------------------------------------------

    def _met(self, feature: str) -> None:
        """Count *feature* in the statistics (``--hypothesis-show-statistics``)."""
        event(feature)

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
        ids: list[str | None] = [None, None, *OWN_IDS, PERIODIC_ID]
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
        limit_key: str | None = None,
        max_late_ms: int | None = None,
    ) -> tuple[str, bool]:
        """Park in the model as park_keyed.lua promises: (id parked for the call, parked?).

        *asked* bounds the due ms the call asked for; the entry's
        ``due_bounds`` are those, capped for a debounce at its burst's first
        call + max_wait (the burst passes from an owner still waiting).
        """
        model = self.model
        owner = model.owners.get(key) if key is not None else None
        first: tuple[int, int] | None = None
        cap: int | None = None
        if mode == "debounce":
            waiting = model.entries.get(owner.id) if owner and not owner.running else None
            if waiting is not None and waiting.state in ("due", "held") and waiting.first:
                first, cap = waiting.first, waiting.cap
            first = first or self._call_ms
            if max_wait_ms is not None and (cap is None or max_wait_ms < cap):
                cap = max_wait_ms
        if owner is not None:
            if owner.running and owner.id == task_id:
                pass  # a running task parks itself again (a retry): parked
            elif mode in ("keep", "until_finished"):
                return owner.id, False
            elif not owner.running and owner.id != task_id:
                # replace, debounce: the parked owner goes (one being
                # released cannot be stopped, and keeps running).
                taken = model.entries.get(owner.id)
                if taken is not None and taken.state in ("due", "held"):
                    model.forget_marks(owner.id)
                    del model.entries[owner.id]
                    revoked.add(owner.id)
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
            limit_key=limit_key,
            max_late_ms=max_late_ms,
        )
        if key is not None:
            model.owners[key] = Owner(task_id)
        return task_id, True

    def _settle_park(self, parked: list[str], revoked: set[str], how: str) -> None:
        """The parked ids' due times as stored; their history and the replaced ones'."""
        for task_id in revoked:
            self.model.saw(task_id, "cancelled", "replaced", None)
        for task_id in parked:
            low, high = self._due_bounds.pop(task_id)
            due_ms = self._due_of(task_id, low, high)
            self.model.entries[task_id].due_ms = due_ms
            self.model.saw(task_id, "parked", how, due_ms)
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
        queue=st.sampled_from(QUEUE_DRAWS),
        countdown=st.sampled_from(COUNTDOWNS),
        key=st.one_of(st.none(), st.sampled_from(KEY_NAMES)),
        mode=st.sampled_from(MODES),
        tags=st.sets(st.sampled_from(TAG_NAMES), max_size=2),
        max_wait=st.sampled_from(MAX_WAITS),
        limit_key=st.one_of(st.none(), st.sampled_from(LIMIT_KEYS)),
        max_late=st.sampled_from(MAX_LATES),
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
        limit_key: str | None,
        max_late: int | None,
    ) -> None:
        """apply_delayed: plain, keyed in a mode (a debounce maybe with max_wait), tagged,
        with a limit key and a max_late, maybe under an id used before."""
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
        if limit_key is not None:
            options["limit_key"] = limit_key
        if max_late is not None:
            options["max_late"] = max_late
        owners_before = self.model.owner_ids()
        if task_id == NEWLINE_ID:
            # One rule for ids at the boundary (celery_zdelay.names): refused
            # with a clear error, nothing written; the invariants after this
            # step check that the store did not change.
            with pytest.raises(celery_zdelay.ConfigurationError, match="control characters"):
                self._task(task).apply_delayed((1,), countdown=countdown, **options)
            return
        if task_id == PERIODIC_ID and max_late is not None:
            # A periodic occurrence is never stale: a max_late on one is refused.
            with pytest.raises(celery_zdelay.ConfigurationError, match="periodic"):
                self._task(task).apply_delayed((1,), countdown=countdown, **options)
            return
        before = self._now()
        result = self._task(task).apply_delayed((1,), countdown=countdown, **options)
        self._call_ms = (before, self._now())
        own = result.id if task_id is None else task_id
        if task_id is None and result.id in owners_before:
            own = f"kept-{self.model.next_seq()}"  # kept for an owner: never parked
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
            limit_key=limit_key,
            max_late_ms=None if max_late is None else max_late * 1000,
        )
        assert result.id == expected, f"apply_delayed returned {result.id}, expected {expected}"
        how = "keyed" if key is not None or tags else "plain"
        self._settle_park([own] if parked else [], revoked, how)

    @rule(
        task=st.sampled_from(TASKS),
        queue=st.sampled_from(QUEUE_DRAWS),
        countdown=st.sampled_from(COUNTDOWNS),
        limit_key=st.one_of(st.none(), st.sampled_from(LIMIT_KEYS)),
    )
    def park_an_occurrence(
        self, task: str, queue: str, countdown: int, limit_key: str | None
    ) -> None:
        """apply_delayed under a periodic occurrence's id (no max_late): never stale,
        however late, whatever zdelay_max_late says (a rule of its own, to come often)."""
        options: dict[str, Any] = {"queue": queue, "task_id": PERIODIC_ID}
        if limit_key is not None:
            options["limit_key"] = limit_key
        before = self._now()
        result = self._task(task).apply_delayed((1,), countdown=countdown, **options)
        self._call_ms = (before, self._now())
        assert result.id == PERIODIC_ID
        revoked: set[str] = set()
        self._park_one(
            PERIODIC_ID,
            task,
            queue,
            None,
            None,
            (),
            revoked,
            asked=(self._call_ms[0] + countdown * 1000, self._call_ms[1] + countdown * 1000),
            limit_key=limit_key,
        )
        self._settle_park([PERIODIC_ID], revoked, "plain")

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

    @rule(**PARK_MANY)
    def park_many(
        self,
        task: str,
        queue: str,
        countdown: int,
        keys: list[str | None],
        mode: str,
        tags: set[str],
        max_wait: int | None,
        limit_key: str | None,
        max_late: int | None,
    ) -> None:
        """apply_delayed_many: calls due together, with or without keys, one on_key
        (a debounce maybe with max_wait), one limit key and max_late for all."""
        options: dict[str, Any] = {"queue": queue}
        if any(k is not None for k in keys):
            options.update(keys=keys, on_key=mode)
        if "keys" not in options or mode != "debounce":
            max_wait = None
        if max_wait is not None:
            options["max_wait"] = max_wait
        if tags:
            options["tags"] = sorted(tags)
        if limit_key is not None:
            options["limit_key"] = limit_key
        if max_late is not None:
            options["max_late"] = max_late
        before = self._now()
        results = self._task(task).apply_delayed_many(
            [(n,) for n in range(len(keys))], countdown=countdown, **options
        )
        self._call_ms = (before, self._now())
        low, high = (self._call_ms[0] + countdown * 1000, self._call_ms[1] + countdown * 1000)
        returned = [r.id for r in results]
        # The model parks the calls one after the other under stand-in ids;
        # a call still parked at the end returned its own id (a result names
        # the key's owner after the call), which the stand-in then takes. A
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
                limit_key=limit_key,
                max_late_ms=None if max_late is None else max_late * 1000,
            )
        revoked -= set(stand_ins)
        real = {own: returned[n] for n, own in enumerate(stand_ins) if own in model.entries}
        for own, task_id in real.items():
            model.first_seen[task_id] = model.first_seen.pop(own)
            entry = model.entries.pop(own)
            entry.id = task_id
            model.entries[task_id] = entry
            self._due_bounds[task_id] = self._due_bounds.pop(own)
        for owner in model.owners.values():
            owner.id = real.get(owner.id, owner.id)
        expected = [
            real[own] if key is None else model.owners[key].id
            for own, key in zip(stand_ins, keys, strict=True)
        ]
        assert returned == expected, f"apply_delayed_many returned {returned}, expected {expected}"
        marked = "keys" in options or bool(tags)
        how = "bulk" if len(keys) > 1 else "keyed" if marked else "plain"
        self._settle_park(list(real.values()), revoked, how)

    # -- steering ---------------------------------------------------------------------

    def _some_id(self, data: st.DataObject) -> str:
        # In the order the ids came, not by their (random) value: the same
        # draws pick the same ids when Hypothesis replays a case.
        known = [i for i in self.model.entries if i not in self.model.dead]
        known = sorted([*known, *self.model.dead], key=lambda i: self.model.first_seen.get(i, 0))
        return data.draw(st.sampled_from([*known, "unknown-id"]), label="task_id")

    def _cancelled(self, entries: list[Entry], how: str, by: str | None = None) -> None:
        for entry in entries:
            self.model.forget_marks(entry.id)
            del self.model.entries[entry.id]
            self.model.revoked.add(entry.id)
            self.model.saw(entry.id, "cancelled", how, by)

    def _rescheduled(self, entries: list[Entry], low: int, high: int) -> None:
        for entry in sorted(entries, key=Entry.order):
            entry.state, entry.lane, entry.seq = "due", None, self.model.next_seq()
            entry.due_ms = self._due_of(entry.id, low, high)
            self.model.saw(entry.id, "rescheduled", entry.due_ms)

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        """cancel(id): a due or held entry goes, REVOKED; nothing else changes."""
        task_id = self._some_id(data)
        entry = self.model.entries.get(task_id)
        expected = entry is not None and entry.state in ("due", "held")
        assert celery_zdelay.cancel(task_id, app=self.app) is expected
        if expected:
            assert entry is not None
            self._cancelled([entry], "id")

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
            self._rescheduled([entry], low, high)

    @rule(data=st.data())
    def reschedule_again_and_again(self, data: st.DataObject) -> None:
        """reschedule(id) RESCHEDULES times in a row: its history keeps the last HISTORY_CAP."""
        task_id = self._some_id(data)
        entry = self.model.entries.get(task_id)
        expected = entry is not None and entry.state in ("due", "held")
        for _ in range(RESCHEDULES):
            low = self._now() + 3600_000
            assert celery_zdelay.reschedule(task_id, countdown=3600, app=self.app) is expected
            if expected:
                assert entry is not None
                self._rescheduled([entry], low, self._now() + 3600_000)

    def _steerable(self, tag: str | None = None, queue: str | None = None) -> list[Entry]:
        return [
            e
            for e in self.model.entries.values()
            if e.state in ("due", "held")
            and (tag is None or tag in e.tags)
            and (queue is None or e.queue == queue)
        ]

    @rule(match=st.sampled_from(MATCHES))
    def cancel_matching(self, match: str) -> None:
        """cancel_matching(tag= or queue=): every due or held entry it selects, none other."""
        kind, _, value = match.partition(":")
        chosen = self._steerable(**{kind: value})
        assert celery_zdelay.cancel_matching(**{kind: value}, app=self.app) == len(chosen)
        self._cancelled(chosen, "tag" if kind == "tag" else "matching")

    @rule(match=st.sampled_from(MATCHES), countdown=st.sampled_from(COUNTDOWNS))
    def reschedule_matching(self, match: str, countdown: int) -> None:
        """reschedule_matching(tag= or queue=): every due or held entry it selects moves."""
        kind, _, value = match.partition(":")
        chosen = self._steerable(**{kind: value})
        low = self._now() + countdown * 1000
        moved = celery_zdelay.reschedule_matching(
            **{kind: value}, countdown=countdown, app=self.app
        )
        high = self._now() + countdown * 1000
        assert moved == len(chosen)
        self._rescheduled(chosen, low, high)

    # -- control --------------------------------------------------------------------

    @rule(name=st.sampled_from(PAUSABLE))
    def pause(self, name: str) -> None:
        celery_zdelay.pause(name, app=self.app)
        self.model.paused.add(name)

    @rule(name=st.sampled_from(PAUSABLE))
    def resume(self, name: str) -> None:
        assert celery_zdelay.resume(name, app=self.app) is (name in self.model.paused)
        self.model.paused.discard(name)

    @rule(name=st.sampled_from((LIMITED, KEY_GLOB)), on=st.booleans())
    def rate_limit(self, name: str, on: bool) -> None:
        """set_rate_limit(queue:emails or limit_key:tenant:*, 1/h burst 2) or None:
        the queue's bucket, or a bucket per key; a bucket outlives its limit."""
        celery_zdelay.set_rate_limit(
            name, RATE if on else None, burst=BURST if on else None, app=self.app
        )
        if name == LIMITED:
            self.model.limited = on
        else:
            self.model.key_limited = on

    # -- release ----------------------------------------------------------------------

    def _release(self, entry: Entry) -> str:
        """The entry leaves through the broker (or dies there); return "released"/"dead"."""
        model = self.model
        if entry.queue == "poison" and model.poison_broken:
            self._bury(entry, None)
            return "dead"
        del model.entries[entry.id]
        owner = model.owners.get(entry.key) if entry.key is not None else None
        if owner is not None and owner.id == entry.id and not owner.running:
            if entry.mode == "until_finished":
                owner.running = True
            else:
                del model.owners[entry.key]  # type: ignore[arg-type]
        self._pass.released.append(entry.id)
        event = model.saw(entry.id, "released", self.companion.id)
        self._pass.releases.append((event, entry.due_ms))
        return "released"

    def _bury(self, entry: Entry, reason: str | None) -> None:
        """Dead-lettered with *reason* ("stale", or None: the poison queue's refusal)."""
        model = self.model
        del model.entries[entry.id]
        owner = model.owners.get(entry.key) if entry.key is not None else None
        if owner is not None and owner.id == entry.id:
            del model.owners[entry.key]  # type: ignore[arg-type]
        model.dead[entry.id] = replace(entry, state="dead", lane=None, reason=reason)
        self._pass.dead.append(entry.id)
        model.saw(entry.id, "dead", reason or POISON_REASON)

    def _is_stale(self, entry: Entry) -> bool:
        """Claimed past its max_late (its own, else the companions'): never a periodic id's."""
        late_ms = self._pass.now_ms - entry.due_ms
        if late_ms <= STALE_FLOOR_MS or entry.id.startswith("periodic:"):
            return False
        limit_ms = entry.max_late_ms if entry.max_late_ms is not None else self.model.max_late_ms
        return limit_ms is not None and late_ms > limit_ms

    def _take_tokens(self, bucket: str, wanted: int) -> int:
        model = self.model
        left = model.tokens.get(bucket, BURST)
        granted = min(left, wanted)
        model.tokens[bucket] = left - granted
        if granted:
            model.granted[bucket] = model.granted.get(bucket, 0) + granted
            model.first_grant.setdefault(bucket, self._pass.now_ms)
        return granted

    def _take_slots(
        self, entries: list[Entry], held: dict[str, list[Entry]]
    ) -> tuple[list[Entry], dict[str, list[str]]]:
        """take_slots.lua for *entries* about to be published, slot name by slot name.

        In due order, an id that took a slot keeps it, another takes one
        while fewer than the number are taken. An entry short of a slot is
        held in the lane of the first it missed, and gives back those it
        got. Returns those that got all theirs, and each one's slot names.
        """
        model = self.model
        names = {e.id: model.slots_of(e.task, e.limit_key) for e in entries}
        granted: dict[str, set[str]] = {}
        for slot in {s for e in entries for s in names[e.id]}:
            taken = model.slots.setdefault(slot, set())
            live = len(taken)
            granted[slot] = set()
            for entry in entries:
                if slot not in names[entry.id]:
                    continue
                if entry.id in taken:
                    # Released again while a release of it runs: it shares that
                    # release's slot, which the first run to end frees (docs/control.rst).
                    granted[slot].add(entry.id)
                    model.shared.add(entry.id)
                elif live < CONCURRENCY[slot_control(slot)]:
                    live += 1
                    granted[slot].add(entry.id)
                    taken.add(entry.id)
        passing: list[Entry] = []
        slotted: dict[str, list[str]] = {}
        for entry in entries:
            missing = [s for s in names[entry.id] if entry.id not in granted[s]]
            if not missing:
                passing.append(entry)
                slotted[entry.id] = names[entry.id]
                continue
            held.setdefault(CONCURRENCY_LANE + missing[0], []).append(entry)
            for slot in names[entry.id]:
                model.slots[slot].discard(entry.id)
        return passing, slotted

    def _claimed(self, entries: list[Entry], passed: str | None) -> None:
        """What a pass does with *entries* claimed together (ReleasePass._release_leased).

        Each is judged stale first (its lateness at the claim), then the
        gate holds it (pauses; limits after *passed*), then it takes its
        slots; what is left is released, or dies in the poison queue.
        """
        model = self.model
        held: dict[str, list[Entry]] = {}
        dropped: list[Entry] = []
        buried: list[Entry] = []
        run_late: set[str] = set()
        publish: list[Entry] = []
        for entry in entries:
            if self._is_stale(entry):
                if model.on_stale == "dead":
                    buried.append(entry)
                    continue
                if model.on_stale == "drop":
                    dropped.append(entry)
                    continue
                run_late.add(entry.id)
            lane = model.lane_of(entry, passed=passed)
            if lane is not None:
                held.setdefault(lane, []).append(entry)
            else:
                publish.append(entry)
        slotted: dict[str, list[str]] = {}
        if publish and model.concurrency:
            publish, slotted = self._take_slots(publish, held)
        for lane, waiting in held.items():
            # The history says what held it when it was held, by the lane's kind.
            reason = (
                "pause"
                if lane.startswith(PAUSE_LANE)
                else "concurrency"
                if lane.startswith(CONCURRENCY_LANE)
                else "rate_limit"
            )
            self._met(f"held: {reason} ({lane_control(lane)})")
            model.lanes.add(lane)
            for entry in waiting:
                entry.state, entry.lane = "held", lane
                model.saw(entry.id, "held", reason, lane_control(lane))
        for outcome in {"dead": buried, "drop": dropped, "run": run_late}.items():
            if outcome[1]:
                self._met(f"stale: {outcome[0]}")
        for entry in dropped:
            self._cancelled([entry], "stale", f"companion:{self.companion.id}")
            self._pass.stale["drop"] += 1
        for entry in publish:
            if self._release(entry) == "released":
                self._pass.stale["run"] += entry.id in run_late
            else:
                # The broker did not take it: the slots it took are freed.
                for slot in slotted.get(entry.id, ()):
                    model.slots[slot].discard(entry.id)
        for entry in buried:
            self._bury(entry, "stale")
            self._pass.stale["dead"] += 1

    def _releasable(self) -> list[str]:
        """The lanes a pass releases from, in the order they go (Gate.releasable)."""
        model = self.model
        names = set(model.lanes)
        if model.limited:
            names.add(LIMITED)

        def flow(name: str) -> tuple[int, str]:
            if not model.limit_of(name):
                return (0, name)
            return (3 if name.startswith(KEY_LANE) else 1, name)

        return sorted((n for n in names if not model.stopped(n)), key=flow)

    def _give_back(self, bucket: str, unused: int) -> None:
        """Tokens taken and not used go back to *bucket* (capped at its burst)."""
        model = self.model
        if unused <= 0:
            return
        model.tokens[bucket] = min(BURST, model.tokens.get(bucket, BURST) + unused)
        model.granted[bucket] -= unused

    def _release_lane(self, lane: str, most: int, tokens: int = 0) -> tuple[int, bool]:
        """Release up to *most* of what *lane* holds, as its tokens or free slots allow.

        *tokens* were dealt to it from its control's bucket (its turn); else it
        takes its own. Returns how many it released and whether it may release
        more now (ReleasePass._release_lane).
        """
        model = self.model
        held = sorted((e for e in model.live("held") if e.lane == lane), key=Entry.order)[:most]
        if not held:
            self._give_back(lane_base(lane), tokens)
            # Found empty: its name leaves the lanes set (forget_lane.lua).
            model.lanes.discard(lane)
            return 0, False
        granted = len(held)
        if lane.startswith(CONCURRENCY_LANE):
            slot = lane.removeprefix(CONCURRENCY_LANE)
            free = CONCURRENCY[slot_control(slot)] - len(model.slots.get(slot, ()))
            granted = min(granted, max(0, free))
            passed: str | None = PASSED_ALL
        elif tokens:
            granted = min(granted, tokens)
            passed = lane_base(lane)
        elif model.limit_of(lane):
            granted = self._take_tokens(lane_base(lane), granted)
            passed = lane_base(lane)
        else:
            passed = None
        if not granted:
            return 0, False
        self._met(f"released from a lane: {lane_control(lane)}")
        self._claimed(held[:granted], passed)
        self._give_back(lane_base(lane), tokens - granted)
        return granted, granted == most

    def _in_turns(self, group: str, lanes: list[str], *, shared: bool) -> None:
        """Release *lanes* round robin, a share of a batch each per turn
        (ReleasePass._release_in_turns): starting after the lane that released
        first in the group's last pass; *shared*: from the group's one bucket,
        the turn's tokens dealt out in turn order."""
        model = self.model
        if not lanes:
            return
        if len(lanes) > 1:
            self._met(f"turns of {len(lanes)} lanes ({'shared' if shared else 'own'} buckets)")
        after = model.turns.get(group)
        start = next((i for i, lane in enumerate(lanes) if after is None or lane > after), 0)
        active = lanes[start:] + lanes[:start]
        first: str | None = None
        batch = self.companion.batch_size
        while active:
            share = max(1, batch // len(active))
            if shared:
                wanted = share * len(active)
                granted = self._take_tokens(group, wanted)
                dealt = [
                    granted // len(active) + (i < granted % len(active)) for i in range(len(active))
                ]
            else:
                granted = wanted = share
                dealt = [share] * len(active)
            more: list[str] = []
            short = False
            for lane, tokens in zip(active, dealt, strict=True):
                if not tokens:
                    more.append(lane)
                    continue
                released, again = self._release_lane(lane, tokens, tokens if shared else 0)
                if released and first is None:
                    first = lane
                if again:
                    more.append(lane)
                else:
                    short = True
            active = more if granted == wanted or short else []
        if first is not None:
            model.turns[group] = first

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
        self._companion_pass(0)

    # Passes after time passed: rules of their own, so that the examples which
    # Hypothesis's swarm testing gives a random half of the rules still pass often.

    @rule()
    def release_an_hour_later(self) -> None:
        """An hour passes for what is parked (see :meth:`_hours_pass`), then a pass."""
        self._companion_pass(1)

    @rule()
    def release_two_hours_later(self) -> None:
        """Two hours pass for what is parked, then a pass: what is due now goes stale."""
        self._companion_pass(2)

    def _companion_pass(self, later: int) -> None:
        """*later* hours pass for what is parked, then one companion pass."""
        model = self.model
        self._hours_pass(later)
        self._leases_expire()
        now_ms = self._now()
        self._pass = Pass(now_ms=now_ms)
        due_of = {e.id: e.due_ms for e in model.entries.values()}
        # The due set, claimed in due order; then the held sets: drained
        # ones and free slots first, then the queue's limit, then the keys'
        # lanes in turns, each as its tokens allow. Lanes a step creates
        # later in that order go out in the same pass.
        due = sorted((e for e in model.live("due") if e.due_ms <= now_ms), key=Entry.order)
        self._claimed(due, passed=None)
        # Each control's lanes in turns, the next control's asked for after
        # each (what one drains may fill the next), then the keys' own limits.
        done: set[str] = set()
        while True:
            lanes = [
                n
                for n in self._releasable()
                if not (model.limit_of(n) and n.startswith(KEY_LANE)) and lane_base(n) not in done
            ]
            if not lanes:
                break
            group = lane_base(lanes[0])
            done.add(group)
            group_lanes = [n for n in lanes if lane_base(n) == group]
            self._in_turns(group, group_lanes, shared=model.limit_of(group_lanes[0]))
        turns = [n for n in self._releasable() if model.limit_of(n) and n.startswith(KEY_LANE)]
        self._in_turns(KEY_TURNS, turns, shared=False)

        self.companion.gate.refresh(self.companion.shards, force=True)
        report = self.companion.release_due()
        after_ms = self._now()
        assert not report.failed
        expected = self._pass
        sent = self._drain_broker()
        sent_ids = Counter(json.loads(raw)["headers"]["id"] for _, raw in sent)
        assert sent_ids == Counter(expected.released), (
            f"released {dict(sent_ids)}, the model expected {sorted(expected.released)}"
        )
        assert report.dead_lettered == len(expected.dead), (
            f"{report.dead_lettered} dead-lettered, the model expected {sorted(expected.dead)}"
        )
        assert report.stale == {k: n for k, n in expected.stale.items() if n}, (
            f"stale {report.stale}, the model expected {dict(expected.stale)}"
        )
        for _, raw in sent:
            envelope = json.loads(raw)
            assert envelope["headers"].get("retries", 0) == 0
        # Never early: what went out was due when the pass began.
        assert all(due_of[task_id] <= now_ms <= after_ms for task_id in sent_ids)
        for released, due_ms in expected.releases:
            released.late = (max(0, now_ms - due_ms), max(0, after_ms - due_ms))
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

    def _hours_pass(self, hours: int) -> None:
        """*hours* pass for what is parked: the due set (the testing fast-forward's
        shift.lua) and the held sets (moved here: that script leaves them alone)."""
        if not hours:
            return
        delta_ms = hours * HOUR_MS
        shift = resources.files("celery_zdelay.testing").joinpath("shift.lua").read_text()
        self.client.register_script(shift)(keys=[KEYS.due, KEYS.marks], args=[delta_ms])
        held_prefix = held_set_key(PREFIX, SHARD, "")
        for held in self.client.scan_iter(match=held_prefix.replace("[", "\\[") + "*"):
            members = self.client.zrange(held, 0, -1, withscores=True)
            if members:
                self.client.zadd(held, {m: int(s) - delta_ms * 1024 for m, s in members})
        for entry in [*self.model.live("due"), *self.model.live("held")]:
            entry.due_ms -= delta_ms
        # A debounce's burst started as much earlier, parked, held, in flight or dead.
        for entry in [*self.model.entries.values(), *self.model.dead.values()]:
            if entry.first is not None:
                entry.first = (entry.first[0] - delta_ms, entry.first[1] - delta_ms)

    # -- workers ------------------------------------------------------------------------

    @precondition(lambda self: bool(self.inbox))
    @rule(data=st.data(), outcome=st.sampled_from(OUTCOMES))
    def worker_runs(self, data: st.DataObject, outcome: str) -> None:
        """A worker runs a released task, which ends as *outcome* (Celery's own tracer);
        every end but a retry frees its key (until_finished) and its concurrency slots."""
        index = data.draw(st.integers(0, len(self.inbox) - 1), label="message")
        queue, raw = self.inbox[index]
        headers = json.loads(raw)["headers"]
        task_id, key = headers["id"], headers.get("zdelay_key")
        until_finished = headers.get("zdelay_on_key") == "until_finished"
        owner = self.model.owners.get(key) if key is not None else None
        runs_owner = owner is not None and owner.id == task_id and owner.running
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
        if until_finished and runs_owner and outcome != "retry":
            del self.model.owners[key]
        slots = self.model.slots_of(headers["task"], headers.get("zdelay_limit_key"))
        if outcome == "retry":
            self.model.retrying[task_id] = slots
        else:
            self.model.retrying.pop(task_id, None)
            for slot in slots:
                self.model.slots.get(slot, set()).discard(task_id)
            if all(json.loads(r)["headers"]["id"] != task_id for _, r in self.inbox):
                self.model.shared.discard(task_id)

    # -- dead letters ---------------------------------------------------------------------

    @precondition(lambda self: bool(self.model.dead))
    @rule(data=st.data())
    def requeue(self, data: st.DataObject) -> None:
        """requeue_dead([id]): due now again, its tags back, its key if still free.

        The id may be named twice in the call (``zdelay requeue X X``): its
        first mention requeues it, the second finds nothing more to do.
        """
        model = self.model
        dead = sorted(model.dead, key=lambda i: model.first_seen.get(i, 0))
        task_id = data.draw(st.sampled_from(dead), label="task_id")
        mentions = data.draw(st.integers(min_value=1, max_value=2), label="mentions")
        live = model.entries.get(task_id)
        low = self._now()
        done, *again = steering.requeue_dead([task_id] * mentions, app=self.app)
        high = self._now()
        assert done is (live is None), f"requeue_dead({task_id!r}) said {done}"
        assert again == [False] * (mentions - 1), f"named again, requeue_dead said {again}"
        if not done:
            return
        entry = model.dead.pop(task_id)
        if entry.key is not None:
            if entry.key in model.owners:
                entry = replace(entry, key=None, mode=None, first=None, cap=None)
            else:
                model.owners[entry.key] = Owner(task_id)
        model.entries[task_id] = replace(
            entry,
            state="due",
            reason=None,
            seq=model.next_seq(),
            due_ms=self._due_of(task_id, low, high),
        )
        model.saw(task_id, "requeued")

    @precondition(lambda self: bool(self.model.dead))
    @rule(data=st.data())
    def purge(self, data: st.DataObject) -> None:
        """purge_dead([id]): the dead letter goes for good, its kept marks with it."""
        model = self.model
        dead = sorted(model.dead, key=lambda i: model.first_seen.get(i, 0))
        task_id = data.draw(st.sampled_from(dead), label="task_id")
        assert steering.purge_dead([task_id], app=self.app) == 1
        del model.dead[task_id]
        model.saw(task_id, "purged")

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
        # The key and tag index: records, owners, tag members, exactly.
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
        owners = {
            name[2:]: (value.partition("\n")[0], bool(value.partition("\n")[2]))
            for name, value in snap.marks.items()
            if name.startswith("k:")
        }
        assert owners == {k: (h.id, h.running) for k, h in model.owners.items()}, (
            f"key owners {owners}, model {model.owners}"
        )
        tagged = {f"{t}\n{e.id}" for e in model.entries.values() for t in e.tags}
        assert snap.tagged == tagged, f"tag index {snap.tagged}, model {tagged}"
        # The lanes set names every lane that holds entries (and lanes no pass
        # has found empty yet): what companions look in.
        assert snap.lanes == model.lanes, f"lanes {snap.lanes}, model {model.lanes}"

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
            if entry is None:
                reason = model.dead[task_id].reason
                if reason is not None:
                    assert found.reason == reason, f"{task_id} dead for {found.reason}"
                continue
            assert listed[task_id].state is expected
            control = None if entry.lane is None else lane_control(entry.lane)
            assert found.held_by == listed[task_id].held_by == control
            why = None if entry.lane is None else model.held_reason(entry.lane)
            assert found.held_reason == listed[task_id].held_reason == why, (
                f"{task_id} held for {found.held_reason}, model {why}"
            )

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
        infos = limits.controls(app=self.app)
        waiting = {c.name: c.waiting for c in infos if c.waiting}
        held = Counter(model.group(e.lane) for e in model.live("held") if e.lane is not None)
        assert waiting == dict(held), f"controls() waiting {waiting}, model {dict(held)}"
        running = {c.name: c.running for c in infos if c.concurrency}
        expected = {
            name: sum(len(ids) for slot, ids in model.slots.items() if slot_control(slot) == name)
            for name in (CONCURRENCY if model.concurrency else ())
        }
        assert running == expected, f"controls() running {running}, model {expected}"
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

    @invariant()
    def slots_are_held_by_the_released_and_unfinished(self) -> None:
        """Each slot record holds the ids the model released under it whose run has not
        ended, never more than its number; nor do the tasks released and unfinished."""
        model = self.model
        now_ms = self._now()
        with self.client.pipeline(transaction=False) as pipe:
            for slot in SLOT_NAMES:
                pipe.zrange(CONTROL.slots(PREFIX, slot), 0, -1, withscores=True)
            replies = pipe.execute()
        unfinished: dict[str, set[str]] = {}
        for _, raw in self.inbox:
            headers = json.loads(raw)["headers"]
            for slot in model.slots_of(headers["task"], headers.get("zdelay_limit_key")):
                unfinished.setdefault(slot, set()).add(headers["id"])
        for task_id, slots in model.retrying.items():
            for slot in slots:
                unfinished.setdefault(slot, set()).add(task_id)
        for slot, reply in zip(SLOT_NAMES, replies, strict=True):
            live = {_text(m) for m, ends in reply if ends > now_ms}
            # An id released twice at once shares one slot, freed by its first
            # run's end (a documented limit): not counted against the number.
            counted = unfinished.get(slot, set()) - (model.shared - live)
            number = CONCURRENCY[slot_control(slot)]
            assert live == model.slots.get(slot, set()), (
                f"slots of {slot!r}: {sorted(live)}, model {sorted(model.slots.get(slot, ()))}"
            )
            assert len(live) <= number
            assert len(counted) <= number, (
                f"{slot!r}: {sorted(counted)} released and unfinished, at most {number}"
            )

    @invariant()
    def buckets_grant_at_most_burst_plus_rate_times_t(self) -> None:
        """Each bucket (the queue's, each key's) holds the tokens the model says are
        left, and granted at most burst + rate * T since its first grant (Redis clock)."""
        model = self.model
        names = [LIMITED, *(KEY_LANE + k for k in LIMIT_KEYS)]
        now_ms = self._now()
        with self.client.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hget(CONTROL.bucket(PREFIX, name), "level")
            levels = pipe.execute()
        for name, level in zip(names, levels, strict=True):
            if level is None:
                assert name not in model.tokens, f"bucket {name} gone, model {model.tokens}"
                continue
            # The 1/h refill adds less than a token within an example.
            assert math.floor(float(level)) == model.tokens.get(name), (
                f"bucket {name}: {float(level)} tokens, model {model.tokens.get(name)}"
            )
            if name in model.granted:
                span_ms = now_ms - model.first_grant[name]
                assert model.granted[name] <= BURST + math.floor(RATE_PER_MS * span_ms)

    @invariant()
    def history_says_what_happened(self) -> None:
        """history(id) of every id parked is the model's events for it, in order, the
        last 50; the store records no history of an id the model never parked.

        Each id is read through ``celery_zdelay.history`` when its record (read
        raw, all in one round trip) or the model's events changed since it last was.
        """
        model = self.model
        raw = {_text(k): v for k, v in self.client.hgetall(KEYS.history).items()}
        stray = sorted(set(raw) - set(model.history))
        assert not stray, f"history recorded for {stray}, never parked in the model"
        for task_id, expected in model.history.items():
            if self._histories_read.get(task_id) == (raw.get(task_id), len(expected)):
                continue
            self._histories_read[task_id] = (raw.get(task_id), len(expected))
            events = celery_zdelay.history(task_id, app=self.app)
            kept = expected[-HISTORY_CAP:]
            got, want = [seen(e) for e in events], [s.fields for s in kept]
            if got != want:
                pairs = zip(got, want, strict=False)
                at = next((n for n, (a, b) in enumerate(pairs) if a != b), min(len(got), len(want)))
                raise AssertionError(
                    f"history of {task_id!r} ({len(got)} events, model {len(want)}) differs "
                    f"at event {at}: {got[at : at + 3]}, model {want[at : at + 3]}"
                )
            assert [e.at for e in events] == sorted(e.at for e in events)
            for recorded, said in zip(events, kept, strict=True):
                if said.late is not None:
                    assert recorded.late_ms is not None
                    low, high = said.late
                    assert low <= recorded.late_ms <= high, (
                        f"{task_id!r} released {recorded.late_ms} ms late, model [{low}, {high}]"
                    )


@pytest.fixture
def model_world() -> Any:
    """The private Redis and the apps the machine drives (one per test).

    Its own server, with an append-only file: the machine restarts it. An app
    per configuration an example draws, made when first drawn.
    """
    redis_server = RedisServer(appendonly="yes").start()
    url = redis_server.url
    apps: dict[tuple[bool, str, int | None], Celery] = {}

    def app_for(concurrency: bool, on_stale: str, max_late: int | None) -> Celery:
        config = (concurrency, on_stale, max_late)
        if config not in apps:
            conf: dict[str, Any] = {
                "zdelay_redis_url": f"{url}/{BROKER_DB}",
                "zdelay_on_stale": on_stale,
                "zdelay_max_late": max_late,
            }
            if concurrency:
                conf["zdelay_concurrency"] = CONCURRENCY
            app = make_app(
                f"{url}/{BROKER_DB}",
                f"{url}/{BACKEND_DB}",
                f"{url}/{RECORD_DB}",
                conf=conf,
                queues=[{"name": q} for q in QUEUES],
            )
            _register_tasks(app)
            # The machine releases what it parks: no companion process is expected.
            setattr(app, RELEASED_BY_TEST, True)
            apps[config] = app
        return apps[config]

    client = redis_server.client(BROKER_DB)
    _world.update(server=redis_server, app_for=app_for, client=client)
    # The garbage collector runs between examples only (StoreMachine.teardown).
    # A collection inside a step runs the finalisers of whatever cyclic
    # garbage there is at whatever point the step has reached: after the
    # Redis restart rule, Celery 5.3 drops its result consumer's PubSub in a
    # cycle as it reconnects, and redis-py 5.0's PubSub.__del__ takes its
    # connection pool's lock (not reentrant before redis-py 6.2), which
    # deadlocked a step that held it (CI's oldest run hung so, in a
    # worker's store_result); or the finaliser talks to the Redis a step has down.
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
    _world.clear()
    # The machines' AsyncResults unsubscribe from the result backend when they
    # are collected: collect them while the session's Redis still answers (after
    # it, each __del__ failed to connect: an unraisable error at pytest's exit).
    gc.collect()
    client.close()
    for app in apps.values():
        with contextlib.suppress(Exception):
            close_app(app)
    redis_server.stop()


StoreMachine.TestCase.settings = settings.get_profile(PROFILE)
TestStateModel = StoreMachine.TestCase
TestStateModel.pytestmark = [  # type: ignore[attr-defined]
    pytest.mark.usefixtures("model_world"),
    pytest.mark.timeout(TIMEOUTS.get(PROFILE, 600)),
    # A tenant key parked in an example without zdelay_concurrency matches no
    # setting (the per-key limit is set at run time): warned once, as documented.
    pytest.mark.filterwarnings("ignore::celery_zdelay.UnmatchedLimitKeyWarning"),
]
