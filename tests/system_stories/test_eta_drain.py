"""ETA tasks sent before the switch, drained by the workers; and why adopting needs them stopped.

``docs/migrating.rst`` gives two ways for the ETA tasks that workers hold
after a project switches to celery-zdelay: let the workers that hold them
run them (drain), or stop the workers and adopt them into the store
(``test_eta_adopt.py``). Adopting never revokes, and this file shows why it
cannot: Celery's ``revoke`` is by id and sticks, so a copy parked under the
same id would be dropped by the worker as revoked. Both are proven here
with a real worker, a real companion and the Redis broker:

- what workers hold is listed by ``inspect().scheduled()`` (the check the
  guide gives), and a warm restart of the worker holding them loses and
  doubles none: each runs once, at or after its eta;
- a task revoked while a worker held it, parked again under its id, is
  released by the companion and then discarded by the worker: it never runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from celery_zdelay import cancel
from tests.helpers import CeleryProcess, Runs, wait_for
from tests.support.scheduled import held_etas

pytestmark = pytest.mark.timeout(240)

#: Seconds before the held tasks come due: room for the inspect and a worker
#: restart on a loaded machine (later is fine: they then run at once).
COUNTDOWN_S = 20


def test_held_eta_tasks_are_listed_and_each_runs_once_across_a_warm_restart(
    app: Celery, worker: Callable[..., CeleryProcess], runs: Runs
) -> None:
    # Given a worker holding ETA tasks sent as before the switch
    first = worker(app)
    record = app.tasks["tests.record"]
    sent = {
        record.apply_async(("held", n), countdown=COUNTDOWN_S + n).id: time.time() + COUNTDOWN_S + n
        for n in range(4)
    }

    # Then inspect().scheduled() lists each with its eta
    wait_for(
        lambda: set(held_etas(app)) == set(sent),
        timeout=30,
        interval=0.5,
        message="the held tasks in inspect().scheduled()",
    )
    etas = held_etas(app)
    for task_id, eta in etas.items():
        assert abs(eta - sent[task_id]) < 5
    # and celery-zdelay does not hold them: cancel says so, as the guide warns
    assert not cancel(next(iter(sent)), app=app)

    # When the worker is restarted warm before they come due
    assert first.terminate() == 0
    worker(app)

    # Then each runs exactly once, not before its eta
    ran = runs.wait_for_ids(set(sent), stall_timeout=COUNTDOWN_S + 60)
    assert sorted(ran) == sorted(sent)
    assert runs.duplicates() == {}
    for run in runs.all():
        assert run["wall"] >= etas[run["id"]] - 0.5


def test_a_task_revoked_while_held_and_parked_again_under_its_id_never_runs(
    app: Celery,
    worker: Callable[..., CeleryProcess],
    companion: Callable[..., CeleryProcess],
    runs: Runs,
) -> None:
    # Given a worker holding two ETA tasks, and a companion
    held = worker(app)
    companion(app)
    record = app.tasks["tests.record"]
    revoked = record.apply_async(("revoked",), countdown=600).id
    control = record.apply_async(("control",), countdown=600).id
    wait_for(
        lambda: {revoked, control} <= set(held_etas(app)),
        timeout=30,
        interval=0.5,
        message="the held tasks in inspect().scheduled()",
    )

    # When one is revoked, and both are parked under their ids to run in 2 s
    # (what an "adopt" would do: the original must not run twice)
    app.control.revoke(revoked)
    held.wait_for_log(f"Tasks flagged as revoked: {revoked}")
    for task_id, marker in ((revoked, "revoked"), (control, "control")):
        record.apply_delayed((marker,), countdown=2, task_id=task_id)

    # Then the copy of the unrevoked one runs from the companion, and the
    # worker discards the released copy of the revoked one: it is lost
    runs.wait_for_ids({control}, stall_timeout=60)
    held.wait_for_log(f"Discarding revoked task: tests.record[{revoked}]", timeout=60)
    ran: list[dict[str, Any]] = runs.all()
    assert [r["args"] for r in ran] == [["control"]]
