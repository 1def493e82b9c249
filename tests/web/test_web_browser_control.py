"""Limits, pauses and tags on the dashboard, in a real headless Chromium.

Given a real companion and a real worker, when an operator pauses the emails
queue on "Limits and pauses", then emails due now stay parked (the page
counts them waiting behind the pause, the parked page lists them marked
held) and none runs; a limit set from the
same page shows with its burst; on resume every email runs. A form whose
token was tampered with changes nothing, and a read-only dashboard offers no
form. On the parked page the operator filters by a tag, sees each entry's
tags, opens one (its key, mode and tags), and cancels every entry of the tag
in one click, leaving the others parked. Screenshots are kept for the docs
(``ZDELAY_WEB_SCREENSHOTS=docs/_static``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

import celery_zdelay
from celery_zdelay.limits import controls
from tests.conftest import AppFactory
from tests.helpers import CeleryProcess, Runs, wait_for
from tests.support.browser import screenshot
from tests.web_support import serve

pytestmark = [pytest.mark.timeout(240), pytest.mark.timing]

WIDTH, HEIGHT = 1400, 1000


@pytest.fixture
def viewport() -> dict[str, int]:
    return {"width": WIDTH, "height": HEIGHT}


def _waiting(app: Celery, name: str) -> int:
    return sum(c.waiting for c in controls(app=app) if c.name == name)


def _paused(app: Celery, name: str) -> bool:
    return any(c.name == name and c.paused_since_ms is not None for c in controls(app=app))


def test_an_operator_pauses_a_queue_limits_it_and_resumes_it(
    make_test_app: AppFactory,
    page: Any,
    runs: Runs,
    companion: Callable[..., CeleryProcess],
    worker: Callable[..., CeleryProcess],
    tmp_path: Path,
) -> None:
    app = make_test_app(
        conf={"zdelay_shards": 2, "zdelay_rate_limits": {"task:tests.add": "10/m"}},
        queues=[{"name": "celery"}, {"name": "emails"}],
    )
    companion(app)
    worker(app, "celery", "emails")
    with serve(app) as served:
        page.goto(served.url + "/control")
        row = '#controls tr[data-name="{}"]'

        # A form whose token was tampered with changes nothing
        page.fill("#new-control input[name=name]", "queue:emails")
        page.evaluate(
            "document.querySelector('#new-control input[name=csrf_token]').value = '0'.repeat(64)"
        )
        page.click("#new-control button[value=pause]")
        page.wait_for_selector("#error")
        assert "CSRF token is missing or wrong" in page.text_content("#error")
        assert not _paused(app, "queue:emails")

        # When the operator pauses the emails queue
        page.goto(served.url + "/control")
        page.fill("#new-control input[name=name]", "queue:emails")
        page.click("#new-control button[value=pause]")
        page.wait_for_selector("p.message")
        assert page.text_content("p.message").startswith("paused queue:emails (since ")
        assert _paused(app, "queue:emails")

        # Then emails falling due wait behind the pause, counted, and none runs
        # (due 3 s on: a pause reaches a companion within its 0.5 s refresh,
        # which a loaded machine can stretch; parked due at once, one raced it)
        record = app.tasks["tests.record"]
        emails = {record.apply_delayed((i,), countdown=3, queue="emails").id for i in range(5)}
        other = record.apply_delayed(("not paused",), countdown=0).id
        runs.wait_for_ids({other})
        wait_for(lambda: _waiting(app, "queue:emails") == 5, timeout=30, message="5 held")
        assert not emails & set(runs.ids())

        # When it also gets a limit from its row
        page.goto(served.url + "/control")
        emails_row = row.format("queue:emails")
        assert page.text_content(emails_row + " td.waiting") == "5 waiting behind the pause"
        page.fill(emails_row + " input[name=rate]", "2/s")
        page.fill(emails_row + " input[name=burst]", "3")
        page.click(emails_row + " button[value=limit]")
        page.wait_for_selector("p.message")
        assert page.text_content("p.message") == "queue:emails: limit 2/s (burst 3)"
        assert page.text_content(emails_row + " td.limit") == "2/s (burst 3)"
        assert page.text_content(emails_row + " td.source") == "runtime"
        assert "since" in page.text_content(emails_row + " td.paused")
        setting_row = row.format("task:tests.add")
        assert page.text_content(setting_row + " td.source") == "setting"
        screenshot(page, "web-control.png", tmp_path)

        # The parked page lists the held emails, each marked with the pause
        page.goto(served.url + "/parked?queue=emails")
        marks = page.locator("#parked span.held").all_text_contents()
        assert marks == ["held: paused queue:emails"] * 5
        page.goto(served.url + "/control")

        # When the operator resumes it, then every email runs (under the limit)
        page.click(emails_row + " button[value=resume]")
        page.wait_for_selector("p.message")
        assert page.text_content("p.message") == "resumed queue:emails"
        runs.wait_for_ids(emails)
        wait_for(lambda: _waiting(app, "queue:emails") == 0, timeout=30, message="none held")

        # ...and removes the limit: the row goes (nothing holds it any more)
        page.goto(served.url + "/control")
        page.click(emails_row + " button[value=unlimit]")
        page.wait_for_selector("p.message")
        assert page.text_content("p.message") == "queue:emails: no rate limit"
        assert page.locator(emails_row).count() == 0

    # A read-only dashboard shows the same rows and offers no form
    celery_zdelay.pause("queue:emails", app=app)
    with serve(app, actions=False) as served:
        page.goto(served.url + "/control")
        assert page.locator(row.format("queue:emails")).count() == 1
        assert page.locator("main form").count() == 0
        assert page.locator("main button").count() == 0


def test_an_operator_filters_by_tag_opens_an_entry_and_cancels_the_tag(
    make_test_app: AppFactory, page: Any, tmp_path: Path
) -> None:
    app = make_test_app(conf={"zdelay_shards": 4})
    record = app.tasks["tests.record"]
    order = [
        record.apply_delayed(
            (f"reminder {i}",),
            countdown=900 + 300 * i,
            key=f"pay:42:{i}",
            on_key="keep",
            tags=["order:42", f"customer:{i % 3}"],
        ).id
        for i in range(12)
    ]
    others = [
        record.apply_delayed((f"other {i}",), countdown=600 + 300 * i, tags=[f"order:{i}"]).id
        for i in range(20)
    ]
    with serve(app) as served:
        # When the operator filters the listing by the tag
        page.goto(served.url + "/parked")
        page.fill("#filters input[name=tag]", "order:42")
        page.click("#filters button[type=submit]")
        page.wait_for_selector("#parked tbody tr[data-id]")
        # Then exactly the tagged entries are listed, in due order, with their tags
        listed = page.eval_on_selector_all(
            "#parked tbody tr[data-id]", "rows => rows.map(r => r.dataset.id)"
        )
        assert listed == order
        first = f'#parked tr[data-id="{order[0]}"] td.tags'
        assert page.text_content(first).split() == ["order:42", "customer:0"]
        assert (page.text_content("#tag-count") or "").startswith("12 entries tagged order:42")
        screenshot(page, "web-tags.png", tmp_path)

        # An entry's page shows its key, mode and tags
        page.click(f'#parked tr[data-id="{order[1]}"] a.entry-link')
        page.wait_for_selector("#entry-key")
        assert page.text_content("#entry-key") == "pay:42:1 (on_key=keep)"
        assert page.text_content("#entry-tags").split() == ["order:42", "customer:1"]
        screenshot(page, "web-entry-tags.png", tmp_path)

        # Its tag links back to the tag's filter; every match is cancelled at once
        page.click("#entry-tags a.tag >> text=order:42")
        page.wait_for_selector("#parked tbody tr[data-id]")
        assert page.input_value("#filters input[name=tag]") == "order:42"
        page.check("#bulk input[name=scope][value=filter]")
        page.click("#bulk button[value=cancel]")
        page.wait_for_selector("p.message")
        assert page.text_content("p.message") == "cancelled 12 of 12"
        assert page.locator("#parked tbody tr[data-id]").count() == 0
    assert all(celery_zdelay.lookup(task_id, app=app) is None for task_id in order)
    assert all(celery_zdelay.lookup(task_id, app=app) is not None for task_id in others)
