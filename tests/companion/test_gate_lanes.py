"""The gate's lanes: a pause holds in a set of its own, apart from its control's limit.

Given a control both paused and rate-limited, what the pause holds and what
the limit holds wait in two held sets; while the control is paused neither
is drained (not even claimed and held again, pass after pass), and once it
is resumed the pause's set is drained first, without the limit's tokens, so
its entries meet every limit. Each test here pins a line of
``celery_zdelay/companion/gate.py`` or ``store/control.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery

from celery_zdelay.companion.gate import Gate
from celery_zdelay.config import get_config
from celery_zdelay.entry import TaskMessage
from celery_zdelay.rates import parse_limit
from celery_zdelay.store import Store
from celery_zdelay.store.control import (
    UNMATCHED_KEYS,
    hold_reason,
    lane_control,
    lane_group,
    pause_lane,
)
from celery_zdelay.store.headers import LIMIT_KEY_HEADER

pytestmark = pytest.mark.timeout(30)

TASK = "task:tests.record"
QUEUE = "queue:emails"


@pytest.fixture
def gate(app: Celery) -> Iterator[Gate]:
    store = Store(get_config(app))
    yield Gate(store)
    store.close()


def _message() -> TaskMessage:
    return TaskMessage(
        body=b"[]",
        content_type="application/json",
        content_encoding="utf-8",
        headers={"id": "t-1", "task": "tests.record"},
        properties={},
        priority=0,
        exchange="",
        routing_key="emails",
    )


def test_a_pause_holds_in_its_own_lane_and_a_limit_in_the_one_named_by_it(gate: Gate) -> None:
    gate.limits = {TASK: parse_limit("1/h", name=TASK)}
    assert gate.lane_of(_message()) == TASK
    gate.paused = {TASK: 1}
    assert gate.lane_of(_message()) == pause_lane(TASK)
    gate.paused = {QUEUE: 1}
    assert gate.lane_of(_message()) == pause_lane(QUEUE)


def test_neither_lane_of_a_paused_control_is_drained_and_the_pauses_goes_first_after(
    gate: Gate,
) -> None:
    # Given a control limited and paused, with entries held in both its lanes
    gate.limits = {TASK: parse_limit("1/h", name=TASK)}
    gate.paused = {TASK: 1}
    gate.lanes = {0: {TASK, pause_lane(TASK)}}

    # Then while it is paused, nothing of it is released
    assert gate.releasable([0]) == {}

    # And once resumed, the pause's set is drained first (no limit of its
    # own: its entries meet every limit), then the limit's
    gate.paused = {}
    assert list(gate.releasable([0])) == [pause_lane(TASK), TASK]
    assert pause_lane(TASK) not in gate.limits


def test_a_lane_names_its_control_and_why_it_holds() -> None:
    assert lane_control(pause_lane(QUEUE)) == QUEUE
    assert lane_control(QUEUE) == QUEUE
    assert hold_reason(pause_lane(QUEUE), paused=set()) == "pause"
    assert hold_reason(QUEUE, paused=set()) == "rate_limit"
    # A limit's set of a control paused too: nothing of it leaves, by the pause.
    assert hold_reason(QUEUE, paused={QUEUE}) == "pause"


# -- per-key lanes --------------------------------------------------------------------

PER_TENANT = "limit_key:tenant:*"


def _keyed(limit_key: str) -> TaskMessage:
    message = _message()
    return TaskMessage(
        body=message.body,
        content_type=message.content_type,
        content_encoding=message.content_encoding,
        headers={**message.headers, LIMIT_KEY_HEADER: limit_key},
        properties={},
        priority=0,
        exchange="",
        routing_key="emails",
    )


def test_a_limit_key_is_held_in_its_own_lane_after_its_queue_and_task(gate: Gate) -> None:
    gate.limits = {QUEUE: parse_limit("1/h"), PER_TENANT: parse_limit("5/s")}
    # Its queue's limit first (in its key's lane under the queue's, for fair
    # turns), then its key's own lane: not the glob's
    assert gate.lane_of(_keyed("tenant:42")) == f"{QUEUE} tenant:42"
    assert gate.limit_of(f"{QUEUE} tenant:42") == parse_limit("1/h")
    assert gate.bucket_of(f"{QUEUE} tenant:42") == QUEUE
    assert gate.control_of(f"{QUEUE} tenant:42") == QUEUE
    assert gate.lane_of(_keyed("tenant:42"), passed=QUEUE) == "limit_key:tenant:42"
    assert gate.lane_of(_keyed("tenant:42"), passed="limit_key:tenant:42") is None
    # A key no glob matches, or a message without one, meets no per-key limit
    assert gate.lane_of(_keyed("partner:1"), passed=QUEUE) is None
    assert gate.lane_of(_message(), passed=QUEUE) is None
    # Each key's lane is under the glob's limit, counted under the glob
    assert gate.limit_of("limit_key:tenant:42") == parse_limit("5/s")
    assert gate.control_of("limit_key:tenant:42") == PER_TENANT


def test_keys_lanes_are_released_last_on_every_shard_and_not_while_their_glob_is_paused(
    gate: Gate,
) -> None:
    gate.limits = {QUEUE: parse_limit("1/h"), PER_TENANT: parse_limit("5/s")}
    gate.lanes = {1: {"limit_key:tenant:1"}, 2: {"limit_key:tenant:2", pause_lane(TASK)}}
    assert gate.releasable([0, 1, 2]) == {
        pause_lane(TASK): [2],
        QUEUE: [0, 1, 2],
        "limit_key:tenant:1": [0, 1, 2],
        "limit_key:tenant:2": [0, 1, 2],
    }
    gate.paused = {PER_TENANT: 1}
    assert list(gate.releasable([0, 1, 2])) == [pause_lane(TASK), QUEUE]
    assert gate.lane_of(_keyed("tenant:1")) == f"{pause_lane(PER_TENANT)} tenant:1"
    assert hold_reason("limit_key:tenant:1", paused={PER_TENANT}) == "pause"
    assert hold_reason("limit_key:tenant:1", paused=set()) == "rate_limit"


def test_a_keys_lane_under_a_queues_limit_is_looked_for_on_every_shard(gate: Gate) -> None:
    # Another companion may have held that key's tasks on any shard since the
    # lanes were read: due order within the key's lane needs them all, as a
    # per-key limit's lane does; a pause's lanes only where named (drained)
    gate.limits = {QUEUE: parse_limit("1/h")}
    gate.lanes = {1: {f"{QUEUE} tenant:1", f"{pause_lane(TASK)} tenant:1"}}
    assert gate.releasable([0, 1, 2]) == {
        f"{pause_lane(TASK)} tenant:1": [1],
        QUEUE: [0, 1, 2],
        f"{QUEUE} tenant:1": [0, 1, 2],
    }
    # And while the queue is paused, neither of its lanes goes
    gate.paused = {QUEUE: 1}
    assert list(gate.releasable([0, 1, 2])) == [f"{pause_lane(TASK)} tenant:1"]
    assert hold_reason(f"{QUEUE} tenant:1", paused={QUEUE}) == "pause"
    assert hold_reason(f"{QUEUE} tenant:1", paused=set()) == "rate_limit"


def test_a_key_lane_counts_under_the_first_glob_matching_it() -> None:
    names = ["limit_key:tenant:*", "limit_key:tenant:4*", QUEUE]
    assert lane_group("limit_key:tenant:42", names) == "limit_key:tenant:*"
    assert lane_group("limit_key:other", names) == UNMATCHED_KEYS
    assert lane_group(pause_lane(PER_TENANT), names) == PER_TENANT
    assert lane_group(QUEUE, names) == QUEUE
    assert lane_group(f"{QUEUE} tenant:42", names) == QUEUE
    assert lane_group(f"{pause_lane(PER_TENANT)} tenant:42", names) == PER_TENANT
