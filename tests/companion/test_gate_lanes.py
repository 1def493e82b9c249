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
from celery_zdelay.store.control import hold_reason, lane_control, pause_lane

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
