"""A cancel is a revoke wherever Celery users look.

Given a parked task, when it is cancelled (from Python or the CLI), then its
result says REVOKED as Celery's own ``revoke`` leaves it, and the
application's receivers of ``tasks_cancelled`` hear of it (with who
cancelled). A result backend that is down fails no cancel. A parked task
that a keyed call's ``replace`` or ``debounce`` takes out is cancelled too
(issue 33 item 5: it stayed PENDING and ``.get()`` never returned). (The
``task-revoked`` event: ``test_events.py``.)
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import TaskRevokedError
from celery.result import AsyncResult

import celery_zdelay
from celery_zdelay import signals
from celery_zdelay.revocation import REVOKE_REASON
from tests.conftest import AppFactory
from tests.support.cli import run

pytestmark = pytest.mark.timeout(60)


@contextlib.contextmanager
def _cancellations() -> Iterator[list[dict[str, Any]]]:
    heard: list[dict[str, Any]] = []

    def receiver(sender: Celery, task_ids: list[str], by: str | None, **_: Any) -> None:
        heard.append({"app": sender, "task_ids": list(task_ids), "by": by})

    signals.tasks_cancelled.connect(receiver, weak=False)
    try:
        yield heard
    finally:
        signals.tasks_cancelled.disconnect(receiver)


def test_a_cancelled_task_ends_revoked_in_the_result_backend(app: Celery) -> None:
    # Breaks if: record_revoked is not connected, or returns before writing.
    parked = app.tasks["tests.record"].apply_delayed((1,), countdown=3600)
    kept = app.tasks["tests.record"].apply_delayed((2,), countdown=3600)
    assert AsyncResult(parked.id, app=app).state == "PENDING"

    assert celery_zdelay.cancel(parked.id, app=app) is True

    result = AsyncResult(parked.id, app=app)
    assert result.state == "REVOKED"
    assert REVOKE_REASON in str(result.result)
    # Only what was cancelled: the other parked task is untouched.
    assert AsyncResult(kept.id, app=app).state == "PENDING"


def test_an_id_that_was_not_parked_is_not_marked(app: Celery) -> None:
    unknown = str(uuid.uuid4())
    with _cancellations() as heard:
        assert celery_zdelay.cancel(unknown, app=app) is False
    assert heard == []
    assert AsyncResult(unknown, app=app).state == "PENDING"


def test_receivers_hear_every_cancel_with_who_cancelled(app: Celery) -> None:
    record = app.tasks["tests.record"]
    one = record.apply_delayed(("one",), countdown=3600)
    many = [record.apply_delayed((n,), countdown=3600, queue="bulk") for n in range(3)]

    with _cancellations() as heard:
        celery_zdelay.cancel(one.id, app=app, by="support:alice")
        assert celery_zdelay.cancel_matching(queue="bulk", app=app) == 3

    assert heard[0] == {"app": app, "task_ids": [one.id], "by": "support:alice"}
    assert sorted(heard[1]["task_ids"]) == sorted(r.id for r in many)
    assert heard[1]["by"] is None
    assert all(AsyncResult(r.id, app=app).state == "REVOKED" for r in many)


def test_a_cancelled_chain_revokes_its_result_id_too(app: Celery) -> None:
    record = app.tasks["tests.record"]
    chained = celery_zdelay.apply_delayed(record.s(1) | record.si(2), countdown=3600, app=app)

    with _cancellations() as heard:
        assert celery_zdelay.cancel(chained.id, app=app) is True

    (event,) = heard
    # The chain's last task is the result the caller holds: it never runs either.
    assert chained.id in event["task_ids"]
    assert len(event["task_ids"]) == 2
    assert all(AsyncResult(i, app=app).state == "REVOKED" for i in event["task_ids"])


def test_a_cancel_from_the_cli_names_the_user(app: Celery) -> None:
    parked = app.tasks["tests.record"].apply_delayed((1,), countdown=3600)
    with _cancellations() as heard:
        outcome = run(app, "cancel", parked.id)
    assert outcome.exit_code == 0, outcome.output
    (event,) = heard
    assert event["task_ids"] == [parked.id]
    assert event["by"] is not None
    assert event["by"].startswith("cli")


def test_a_result_backend_that_is_down_fails_no_cancel(
    app: Celery, make_test_app: AppFactory
) -> None:
    parked_id = app.tasks["tests.record"].apply_delayed((1,), countdown=3600).id
    # The same store and broker, but a result backend on a port that answers
    # nothing, without retries so that the test does not wait on them.
    cancelling = make_test_app(
        conf={
            "result_backend": "redis://127.0.0.1:1/0",
            "result_backend_transport_options": {"retry_policy": {"max_retries": 0}},
        }
    )
    with _cancellations() as heard:
        assert celery_zdelay.cancel(parked_id, app=cancelling) is True
    assert celery_zdelay.lookup(parked_id, app=app) is None
    assert heard[0]["task_ids"] == [parked_id]


def test_a_cancel_from_the_dashboard_is_a_revoke_that_names_the_user(app: Celery) -> None:
    # Breaks if: the dashboard cancels through the store instead of the
    # steering module (no signal, no REVOKED), or drops who acted.
    import base64
    import re

    from werkzeug.test import Client

    from celery_zdelay.web import create_app
    from celery_zdelay.web.security import BasicAuth

    parked = app.tasks["tests.record"].apply_delayed((1,), countdown=3600)
    client = Client(BasicAuth(create_app(app, actions=True), "alice", "s3cret"))
    auth = {"Authorization": "Basic " + base64.b64encode(b"alice:s3cret").decode()}
    html = client.get("/parked", headers=auth).get_data(as_text=True)
    token = re.search(r'name="csrf_token" value="([0-9a-f]+)"', html)
    assert token is not None
    with _cancellations() as heard:
        reply = client.post(
            "/actions/parked",
            headers=auth,
            data={"csrf_token": token.group(1), "op": "cancel", "ids": parked.id},
        )
    assert reply.status_code == 303
    assert heard == [{"app": app, "task_ids": [parked.id], "by": "dashboard:alice"}]
    assert AsyncResult(parked.id, app=app).state == "REVOKED"


@pytest.mark.parametrize("mode", ["replace", "debounce"])
def test_a_task_replaced_by_key_ends_revoked_and_its_get_returns(app: Celery, mode: str) -> None:
    # Breaks if: park_keyed.lua does not report the entry it took out, or
    # parking does not announce it as a cancel.
    record = app.tasks["tests.record"]
    first = record.apply_delayed((1,), countdown=3600, key="reminder:7", on_key=mode)

    with _cancellations() as heard:
        second = record.apply_delayed((2,), countdown=3600, key="reminder:7", on_key=mode)

    assert second.id != first.id
    assert heard == [{"app": app, "task_ids": [first.id], "by": None}]
    assert AsyncResult(first.id, app=app).state == "REVOKED"
    with pytest.raises(TaskRevokedError):
        first.get(timeout=10)
    # The task parked now is untouched, and a keep call replaces nothing.
    assert AsyncResult(second.id, app=app).state == "PENDING"
    with _cancellations() as heard:
        kept = record.apply_delayed((3,), countdown=3600, key="reminder:7", on_key="keep")
    assert kept.id == second.id
    assert heard == []


def test_apply_delayed_many_revokes_each_task_its_keys_replaced_once(app: Celery) -> None:
    record = app.tasks["tests.record"]
    old = record.apply_delayed_many([(1,), (2,)], countdown=3600, keys=["a", "b"])

    with _cancellations() as heard:
        new = record.apply_delayed_many(
            [(3,), (4,), (5,), (6,)],
            countdown=3600,
            keys=["a", "b", "b", None],
            on_key="replace",
        )

    # The two parked tasks are cancelled once each; the first call of "b" in
    # the batch was never parked (its caller got the last call's result).
    (event,) = heard
    assert sorted(event["task_ids"]) == sorted(r.id for r in old)
    assert all(AsyncResult(r.id, app=app).state == "REVOKED" for r in old)
    assert new[1].id == new[2].id
    assert all(AsyncResult(r.id, app=app).state == "PENDING" for r in new)


def test_a_key_replaced_in_transparent_mode_revokes_what_apply_async_returned(
    make_test_app: AppFactory,
) -> None:
    app = make_test_app(conf={"zdelay_threshold": 1})
    record = app.tasks["tests.record"]
    headers = {"zdelay_key": "k", "zdelay_on_key": "replace"}
    first = record.apply_async((1,), countdown=3600, headers=headers)

    with _cancellations() as heard:
        record.apply_async((2,), countdown=3600, headers=headers)

    assert heard[0]["task_ids"] == [first.id]
    assert AsyncResult(first.id, app=app).state == "REVOKED"
