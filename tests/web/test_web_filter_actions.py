"""An action on a filter applies to exactly the entries that matched when the operator confirmed it.

Given 10,050 tasks due in 50 minutes, when the operator reschedules "every
entry due before 1h" by 15 minutes (a new time that still matches the
filter), then each of the 10,050 is moved exactly once, in one click, and
the message says so. When more match than one action may change, nothing
changes and the message says why and what to do, instead of "apply again
for the rest" (which moved the same first entries again, forever). The
command line's filter operations select every match before changing one.
"""

from __future__ import annotations

import re
import time
from datetime import timedelta
from urllib.parse import unquote_plus

import pytest
from celery import Celery
from werkzeug.test import Client

import celery_zdelay
from celery_zdelay.store import Store
from celery_zdelay.web import app as web_app
from celery_zdelay.web import create_app

pytestmark = pytest.mark.timeout(300)

MINUTE_MS = 60_000


def _park(app: Celery, n: int, countdown: float) -> list[str]:
    task = app.tasks["tests.record"]
    ids: list[str] = []
    for start in range(0, n, 2_000):
        calls = [(i,) for i in range(start, min(start + 2_000, n))]
        ids += [r.id for r in task.apply_delayed_many(calls, countdown=countdown)]
    return ids


def _due_ms(store: Store, ids: list[str]) -> dict[str, int]:
    dues = {}
    with store.client.pipeline(transaction=False) as pipe:
        for task_id in ids:
            pipe.zscore(store.keys(store.shard_of(task_id)).due, task_id)
        for task_id, score in zip(ids, pipe.execute(), strict=True):
            assert score is not None, task_id
            dues[task_id] = int(score) // 1024
    return dues


def _act(client: Client, **fields: str) -> str:
    html = client.get("/parked").get_data(as_text=True)
    token = re.search(r'name="csrf_token" value="([0-9a-f]+)"', html)
    assert token is not None
    reply = client.post("/actions/parked", data={"csrf_token": token.group(1), **fields})
    assert reply.status_code == 303
    return unquote_plus(reply.headers["Location"].split("msg=", 1)[1])


def test_a_reschedule_whose_new_time_still_matches_moves_every_match_once(
    app: Celery, store: Store
) -> None:
    # The review's case: 10,050 due in 50 min, "due before 1h", delay 15 min.
    ids = _park(app, 10_050, countdown=50 * 60)
    client = Client(create_app(app, actions=True))
    started = time.perf_counter()
    message = _act(
        client, op="reschedule", scope="filter", due_before="1h", delay="15m", back="parked"
    )
    took = time.perf_counter() - started
    assert message == "rescheduled 10050 of 10050"
    now_ms = store.time_ms()
    dues = _due_ms(store, ids)
    # Each moved once: due about 15 minutes from now, none left at 50 minutes.
    assert all(now_ms + 10 * MINUTE_MS < d <= now_ms + 15 * MINUTE_MS for d in dues.values())
    print(f"reschedule of 10,050 by filter in one click: {took:.1f} s")


def test_more_matches_than_one_action_takes_change_nothing_and_say_why(
    app: Celery, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(web_app, "MAX_BULK", 30)
    ids = _park(app, 35, countdown=50 * 60)
    before = _due_ms(store, ids)
    client = Client(create_app(app, actions=True))
    for fields in (
        {"op": "reschedule", "delay": "15m"},
        {"op": "run"},
        {"op": "cancel"},
    ):
        message = _act(client, scope="filter", due_before="1h", **fields)
        assert message.startswith("Nothing ")
        assert "more than 30 entries match" in message
        assert "zdelay" in message  # the command line takes every match
        assert _due_ms(store, ids) == before
    # Narrowed to at most 30, the action takes them all, each once.
    message = _act(client, op="cancel", scope="filter", due_before="1h", task="tests.nothing")
    assert message == "cancelled 0 of 0"
    ticked = ids[:30]
    message = _act(client, op="reschedule", delay="15m", **{"ids": ticked})  # type: ignore[arg-type]
    assert message == "rescheduled 30 of 30"


def test_the_command_lines_filter_reschedule_moves_every_match_once(
    app: Celery, store: Store
) -> None:
    # More than one page of the selection (1,000 ids), and a new time that
    # still matches: each is selected before any is moved.
    ids = _park(app, 2_500, countdown=50 * 60)
    moved = celery_zdelay.reschedule_matching(
        countdown=15 * 60, due_before=timedelta(hours=1), app=app
    )
    assert moved == 2_500
    now_ms = store.time_ms()
    dues = _due_ms(store, ids)
    assert all(now_ms + 10 * MINUTE_MS < d <= now_ms + 15 * MINUTE_MS for d in dues.values())
    assert celery_zdelay.cancel_matching(due_before=timedelta(hours=1), app=app) == 2_500
