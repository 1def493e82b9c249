"""Flower shows parked work, without a plugin.

Given a real Flower server reading the app's events, a worker sending task
events and a companion: a parked task shows in Flower at once with its eta,
a rescheduled one with its new eta, a cancelled one as REVOKED, the
parked one as SUCCESS once released and run, and a dead-lettered one as
REJECTED. (The events themselves: ``test_events.py``.)
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

import celery_zdelay
from celery_zdelay.testing import free_port
from tests.conftest import AppFactory
from tests.helpers import CeleryProcess, wait_for
from tests.support.browser import SCREENSHOTS, chromium
from tests.support.keys import SHARD0

pytestmark = pytest.mark.timeout(120)

#: Shard 0's due set and messages, where the test plants an entry to dead-letter.
DUE, MSG = SHARD0.due, SHARD0.msg


class Flower:
    """A ``celery flower`` subprocess on a free loopback port, read through its HTTP API."""

    def __init__(self, app: Celery, processes: list[CeleryProcess]) -> None:
        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        process = CeleryProcess(
            app,
            "flower",
            "--address=127.0.0.1",
            f"--port={self.port}",
            # The API answers without authentication only when told to (Flower 2).
            env={"FLOWER_UNAUTHENTICATED_API": "true"},
        )
        processes.append(process)
        process.start()
        wait_for(lambda: self.task(str(uuid.uuid4())) is None, timeout=60, message="Flower up")
        self._wait_until_subscribed()

    def task(self, task_id: str) -> dict[str, Any] | None:
        """Flower's record of *task_id*, or None (unknown, or Flower not answering yet)."""
        try:
            with urllib.request.urlopen(f"{self.url}/api/task/info/{task_id}", timeout=5) as r:
                info: dict[str, Any] = json.loads(r.read())
                return info
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
        except OSError:
            return None

    def state_of(self, task_id: str) -> str | None:
        info = self.task(task_id)
        return None if info is None else info.get("state")

    def _wait_until_subscribed(self) -> None:
        # Flower sees events only once its receiver is subscribed: send a
        # marker until it shows, so the test's own events cannot be missed.
        marker = f"marker-{uuid.uuid4()}"

        def marker_seen() -> bool:
            with self.app.events.default_dispatcher() as dispatcher:
                dispatcher.send("task-sent", uuid=marker, name="marker")
            return self.task(marker) is not None

        wait_for(marker_seen, timeout=60, message="Flower subscribed to events")


def test_flower_shows_parked_rescheduled_revoked_run_and_rejected_tasks(
    make_test_app: AppFactory,
    processes: list[CeleryProcess],
    companion: Callable[..., CeleryProcess],
    redis_client: redis.Redis,
    tmp_path: Path,
) -> None:
    app = make_test_app(conf={"task_send_sent_event": True, "worker_send_task_events": True})
    flower = Flower(app, processes)
    record = app.tasks["tests.record"]

    # Given a task parked for later and one that will be cancelled
    later = record.apply_delayed(("later",), countdown=3)
    cancelled = record.apply_delayed(("cancelled",), countdown=600)

    # Then Flower lists both as pending, with their eta
    wait_for(lambda: flower.state_of(later.id) == "PENDING", timeout=30, message="parked in Flower")
    info = flower.task(later.id)
    assert info is not None
    assert info["name"] == "tests.record"
    found = celery_zdelay.lookup(later.id, app=app)
    assert found is not None
    assert datetime.fromisoformat(info["eta"]) == found.due

    # And a person sees it on Flower's task page in a real browser
    page_text = _task_page(flower, later.id, tmp_path)
    assert later.id in page_text
    assert "PENDING" in page_text

    # When one is rescheduled, Flower shows its new eta
    moved = record.apply_delayed(("moved",), countdown=600)
    wait_for(lambda: flower.state_of(moved.id) == "PENDING", timeout=30, message="moved parked")
    assert celery_zdelay.reschedule(moved.id, countdown=1200, app=app) is True
    new_due = celery_zdelay.lookup(moved.id, app=app)
    assert new_due is not None

    def eta_of_moved() -> datetime | None:
        info = flower.task(moved.id)
        return None if info is None or not info.get("eta") else datetime.fromisoformat(info["eta"])

    wait_for(lambda: eta_of_moved() == new_due.due, timeout=30, message="the new eta in Flower")
    assert flower.state_of(moved.id) == "PENDING"
    assert (flower.task(moved.id) or {}).get("name") == "tests.record"

    # When one is cancelled, Flower shows it revoked
    assert celery_zdelay.cancel(cancelled.id, app=app) is True
    wait_for(lambda: flower.state_of(cancelled.id) == "REVOKED", timeout=30, message="revoked")

    # ... and an entry the companion will have to dead-letter (not a message of ours)
    redis_client.hset(MSG, "forged", b"\x80 not ours at all")
    redis_client.zadd(DUE, {"forged": 0})

    # When a worker and a companion run, the parked one is received and succeeds
    worker = CeleryProcess(
        app, "worker", "-P", "solo", "-E", "-l", "INFO", "-n", f"w{uuid.uuid4().hex[:6]}@%h"
    )
    processes.append(worker)
    worker.start()
    worker.wait_for_log(" ready.")
    companion(app)
    wait_for(lambda: flower.state_of(later.id) == "SUCCESS", timeout=60, message="run in Flower")
    assert flower.state_of(cancelled.id) == "REVOKED"
    # ... and the dead-lettered one shows rejected
    wait_for(lambda: flower.state_of("forged") == "REJECTED", timeout=30, message="rejected")


def _task_page(flower: Flower, task_id: str, tmp_path: Path) -> str:
    """Open Flower's page of *task_id* in Chromium; screenshot it; return its text."""
    directory = Path(SCREENSHOTS) if SCREENSHOTS else tmp_path
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(f"{flower.url}/task/{task_id}")
        page.wait_for_load_state("load")
        page.screenshot(path=str(directory / "monitoring-flower-parked.png"), full_page=True)
        return str(page.inner_text("body"))
