"""Every page of the dashboard as an operator sees it, in Chromium at 1400x1000.

Given a store with reminders, an entry with a long list of headers, a dead
letter and periodic schedules served by a real companion (with ``--beat``),
when an operator walks every page at 1400x1000, then past times read "ago"
(a last run, a death), never "overdue"; no cell breaks a word in the middle
("activ e"); the entry page shows its Cancel button without scrolling, and
a successful cancel lands on the listing with its message and no red "Not
found". A companion publishing to RabbitMQ is shown on the normal release
path, not as something "off". Each page is kept as a screenshot
(``ZDELAY_WEB_SCREENSHOTS=docs/_static`` writes the ones in the docs).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from werkzeug.test import Client

from celery_zdelay import periodic
from celery_zdelay.store import Store
from celery_zdelay.web import create_app
from tests.conftest import AppFactory, RabbitMQ
from tests.helpers import CeleryProcess
from tests.support.browser import broken_words, screenshot
from tests.support.deadletters import make_dead_letter
from tests.web_support import serve

pytestmark = pytest.mark.timeout(240)

WIDTH, HEIGHT = 1400, 1000


@pytest.fixture
def viewport() -> dict[str, int]:
    return {"width": WIDTH, "height": HEIGHT}


def _wait_for_a_last_run(app: Celery, names: set[str], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ran = {s.name for s in periodic.schedules(app)[1] if s.last_run_ms is not None}
        if names <= ran:
            return
        time.sleep(0.2)
    raise AssertionError(f"no last run of {names} within {timeout_s} s")


def test_an_operator_reads_every_page_at_1400_by_1000(
    app: Celery,
    store: Store,
    page: Any,
    companion: Callable[..., CeleryProcess],
    tmp_path: Path,
) -> None:
    record = app.tasks["tests.record"]
    for i in range(40):
        record.apply_delayed((f"reminder {i}",), {"user": i}, countdown=900 + 137 * i)
    # An entry whose headers table is long: tracing and business headers.
    noisy = record.apply_delayed(
        ("order 42", "x" * 400),
        countdown=3600,
        headers={f"x-trace-{i:02d}": f"span-{i:02d}-" + "ab" * 20 for i in range(60)},
    )
    lost = record.apply_delayed(("requeue me",), countdown=3600)
    make_dead_letter(store, lost.id, "bad signature: the entry was signed with an old key")
    for name, every in (("heartbeat-ping", 1), ("nightly-report", 86_400)):
        assert periodic.add(
            name, app=app, task="tests.record", schedule=every, args=[name, "y" * 300]
        )
    companion(app, "--beat")
    _wait_for_a_last_run(app, {"heartbeat-ping"})

    with serve(app) as served:
        page.goto(served.url + "/")
        page.wait_for_selector("#companions tr.alive", timeout=30_000)
        assert broken_words(page) == []
        assert "atomic handoff" in page.text_content("#companions")
        screenshot(page, "web-overview.png", tmp_path)

        page.goto(served.url + "/parked")
        assert broken_words(page) == []
        screenshot(page, "web-parked.png", tmp_path)

        page.goto(served.url + "/periodic")
        row = '#periodic tr[data-name="heartbeat-ping"]'
        assert "ago" in (page.text_content(row) or "")  # its last run
        assert "overdue" not in page.text_content("#periodic")
        assert broken_words(page) == []
        screenshot(page, "web-periodic.png", tmp_path)

        page.goto(served.url + "/dead")
        assert "ago" in page.text_content(f'#dead tr[data-id="{lost.id}"]')
        assert "overdue" not in page.text_content("#dead")
        assert broken_words(page) == []
        screenshot(page, "web-dead.png", tmp_path)

        # The entry: its actions in view without scrolling, above 60 headers.
        page.goto(served.url + "/entry?id=" + noisy.id)
        assert page.locator("#headers tr").count() >= 60
        cancel = page.locator("#entry-actions button[value=cancel]")
        box = cancel.bounding_box()
        assert box is not None
        assert box["y"] + box["height"] <= HEIGHT
        assert broken_words(page) == []
        screenshot(page, "web-entry.png", tmp_path)

        # Cancel it: the listing says so, and nothing reads as an error.
        cancel.click()
        page.wait_for_selector("p.message")
        assert f"cancelled 1 of 1: {noisy.id}" in page.text_content("p.message")
        assert page.locator(".error").count() == 0
        assert page.url.startswith(served.url + "/parked")
        assert page.locator(f'#parked tr[data-id="{noisy.id}"]').count() == 0


def test_a_companion_publishing_to_rabbitmq_is_on_the_normal_path_not_off(
    make_test_app: AppFactory,
    rabbitmq: RabbitMQ,
    companion: Callable[..., CeleryProcess],
) -> None:
    app = make_test_app(broker=rabbitmq.url)
    companion(app)
    client = Client(create_app(app))
    deadline = time.monotonic() + 60
    html = ""
    while time.monotonic() < deadline and "alive" not in html:
        html = client.get("/overview.part").get_data(as_text=True)
        time.sleep(0.2)
    assert 'class="alive"' in html, html[-2000:]
    cell = html.split('class="path">', 1)[1].split("</td>", 1)[0]
    assert cell.startswith("publish to the broker")
    assert "amqp" in cell  # why not the handoff, as a note
    assert "off (" not in cell
