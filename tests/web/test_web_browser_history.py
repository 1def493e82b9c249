"""The entry page of a task that is gone shows its history, in a real headless Chromium.

Given an email held by a pause, then released by a companion once resumed,
and a reminder an operator cancels from its own entry page, when the
operator opens either page after the task is gone, then it shows what
happened (parked, held by the pause, released by which companion and how
late; parked, cancelled by the dashboard) instead of "Not found"; an id
that was never parked is still "Not found" (404). The released email's page
is kept as a screenshot for the docs (``web-entry-history.png``, with
``ZDELAY_WEB_SCREENSHOTS=docs/_static``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

import celery_zdelay
from celery_zdelay.companion import Companion
from tests.conftest import AppFactory
from tests.support.browser import screenshot
from tests.web_support import serve

pytestmark = pytest.mark.timeout(240)

WIDTH, HEIGHT = 1400, 1000


@pytest.fixture
def viewport() -> dict[str, int]:
    return {"width": WIDTH, "height": HEIGHT}


def _rows(page: Any) -> list[tuple[str, str]]:
    """(event, details) of each row of the history table."""
    return [
        (row.get_attribute("data-event"), row.locator("td.detail").text_content())
        for row in page.locator("#history tbody tr").all()
    ]


def test_an_operator_reads_what_happened_to_a_task_that_is_gone(
    make_test_app: AppFactory, page: Any, tmp_path: Path
) -> None:
    app = make_test_app(queues=[{"name": "celery"}, {"name": "emails"}])
    record = app.tasks["tests.record"]
    # An email held by a pause, released by a companion once resumed
    celery_zdelay.pause("queue:emails", app=app)
    email = record.apply_delayed(("welcome",), countdown=0, queue="emails")
    with Companion(app) as comp:
        comp.release_due()
    celery_zdelay.resume("queue:emails", app=app)
    # A companion started after the resume (one running sees it within its refresh)
    with Companion(app) as comp:
        comp.release_due()
        companion_id = comp.id
    reminder = record.apply_delayed(("pay",), countdown=3600)

    with serve(app) as served:
        # When the operator cancels the reminder from its page
        page.goto(f"{served.url}/entry?id={quote(reminder.id)}")
        page.click("#entry-actions button[value=cancel]")
        page.wait_for_selector("p.message")

        # Then its page, now that it is gone, says so and shows who cancelled it
        response = page.goto(f"{served.url}/entry?id={quote(reminder.id)}")
        assert response.status == 200
        assert page.get_attribute("#entry-state", "data-state") == "gone"
        assert _rows(page) == [
            ("parked", page.locator("#history td.detail").first.text_content()),
            ("cancelled", "id, by dashboard"),
        ]
        assert (
            page.locator("#history td.detail").first.text_content().startswith("plain call, due ")
        )

        # And the email's page shows it held by the pause, then released by
        # the companion, how late
        response = page.goto(f"{served.url}/entry?id={quote(email.id)}")
        assert response.status == 200
        events = _rows(page)
        assert [event for event, _ in events] == ["parked", "held", "released"]
        assert events[1][1] == "pause (queue:emails)"
        assert events[2][1].startswith(f"by {companion_id}, ")
        assert events[2][1].endswith(" late")
        assert "Not found" not in (page.text_content("main") or "")
        screenshot(page, "web-entry-history.png", tmp_path)

        # An id never parked is still not found
        response = page.goto(f"{served.url}/entry?id=never-parked")
        assert response.status == 404
        assert (page.text_content("#entry-state") or "").startswith("Not found")
        assert page.locator("#history").count() == 0
