"""A schedule's score in the planner's index is the one Python computes.

Pins ``periodic_next_visit`` in ``periodic/lua/_pointer.lua`` (see
docs/mutation.rst): the score ``revisit.lua`` writes for a schedule is its
pointer's ms, or the earliest occurrence the pointer lists as parked after
the last run recorded, if earlier; pairs that are not ``{number, id}`` and
unreadable run records are ignored; a pointer without ms is never visited.
Each case is checked against the value written out and against
:func:`~celery_zdelay.periodic.store.next_visit_ms`, which the planner uses
on the Python side and which must agree.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from celery import Celery

from celery_zdelay import periodic
from celery_zdelay.parking import store_for
from celery_zdelay.periodic.store import PeriodicStore, Pointer, next_visit_ms

pytestmark = pytest.mark.timeout(60)

MS = 1_764_972_000_000  # far from any small number a mutant could land on

CASES: list[tuple[str, dict[str, Any], Any, float]] = [
    # (case, pointer record, run record (None: none stored), expected score)
    ("the pointer alone", {"ms": MS, "v": 1, "ids": []}, None, MS),
    (
        "an occurrence parked before the pointer and never run",
        {"ms": MS, "v": 1, "ids": [[MS - 7000, "a"], [MS + 5000, "b"]]},
        None,
        MS - 7000,
    ),
    (
        "the earliest of those",
        {"ms": MS, "v": 1, "ids": [[MS - 3000, "a"], [MS - 9000, "b"], [MS - 6000, "c"]]},
        None,
        MS - 9000,
    ),
    (
        "an occurrence recorded as run is not waited for",
        {"ms": MS, "v": 1, "ids": [[MS - 7000, "a"]]},
        {"ms": MS - 7000, "lateness_ms": 3},
        MS,
    ),
    (
        "one after the last run is",
        {"ms": MS, "v": 1, "ids": [[MS - 7000, "a"], [MS - 4000, "b"]]},
        {"ms": MS - 7000, "lateness_ms": 3},
        MS - 4000,
    ),
    (
        "a run recorded before it leaves it waited for",
        {"ms": MS, "v": 1, "ids": [[MS - 7000, "a"]]},
        {"ms": MS - 7001, "lateness_ms": 3},
        MS - 7000,
    ),
    (
        "an occurrence at ms 0 with no run recorded",
        {"ms": MS, "v": 1, "ids": [[0, "zero"]]},
        None,
        0,
    ),
    (
        "an unreadable run record counts as none",
        {"ms": MS, "v": 1, "ids": [[MS - 7000, "a"]]},
        "not json",
        MS - 7000,
    ),
    (
        "a run record without ms counts as none",
        {"ms": MS, "v": 1, "ids": [[MS - 7000, "a"]]},
        {"lateness_ms": 3},
        MS - 7000,
    ),
    (
        "pairs that are not {ms, id} are ignored",
        {"ms": MS, "v": 1, "ids": ["junk", [str(MS - 9000), "s"], [MS - 2000, "ok"]]},
        None,
        MS - 2000,
    ),
    ("a pointer without ids", {"ms": MS, "v": 1}, None, MS),
    # A planner put its next look off (defer.lua, PARK_LEAD_MS)
    ("a wake after the pointer", {"ms": MS, "v": 1, "ids": [], "wake": MS + 9000}, None, MS + 9000),
    ("a wake before the pointer is not", {"ms": MS, "v": 1, "wake": MS - 9000}, None, MS),
    (
        "an occurrence waiting for its run is, whatever the wake",
        {"ms": MS, "v": 1, "ids": [[MS, "a"]], "wake": MS + 9000},
        None,
        MS,
    ),
    (
        "one recorded as run is not waited for",
        {"ms": MS, "v": 1, "ids": [[MS, "a"]], "wake": MS + 9000},
        {"ms": MS, "lateness_ms": 3},
        MS + 9000,
    ),
    ("a wake that is not a number is ignored", {"ms": MS, "v": 1, "wake": "soon"}, None, MS),
]


def _scored(app: Celery, pointer: dict[str, Any], run: Any) -> float:
    assert periodic.add("s", app=app, task="tests.record", schedule=10.0)
    periodic_store = PeriodicStore(store_for(app))
    client, keys = periodic_store.store.client, periodic_store.keys
    client.hset(keys.pointers, "s", json.dumps(pointer))
    client.hdel(keys.runs, "s")
    if run is not None:
        client.hset(keys.runs, "s", run if isinstance(run, str) else json.dumps(run))
    assert periodic_store.revisit(["s"], 0) == 1
    score = client.zscore(keys.visits, "s")
    assert score is not None
    return float(score)


@pytest.mark.parametrize(
    ("pointer", "run", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_the_score_is_the_pointer_or_the_earliest_occurrence_not_run(
    app: Celery, pointer: dict[str, Any], run: Any, expected: float
) -> None:
    score = _scored(app, pointer, run)
    assert score == expected
    # The planner's own reading agrees (pairs it cannot read are left out there too)
    last = run.get("ms", -1) if isinstance(run, dict) else -1
    try:
        parsed = Pointer.from_json(json.dumps(pointer))
    except (ValueError, KeyError, TypeError):
        return
    assert next_visit_ms(parsed, last) == expected


def test_the_score_is_written_as_an_integer_of_every_digit(app: Celery) -> None:
    # A Lua number formatted by default would be 1.764972000001e+12: off by the last digits
    odd = MS + 1
    assert _scored(app, {"ms": odd, "v": 1, "ids": []}, None) == odd


def test_a_pointer_without_ms_is_never_visited(app: Celery) -> None:
    assert _scored(app, {"v": 1, "ids": [[MS, "a"]]}, None) == math.inf
