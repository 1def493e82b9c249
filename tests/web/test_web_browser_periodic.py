"""django-celery-beat rows on the dashboard's Periodic page, in Chromium at 1400x1000.

Issue 35. Given rows in PostgreSQL served by a real companion (``--beat -S
django``): one every ten seconds, a nightly report with long arguments, one
with an overlap policy, a row whose name differs from an older row's only
by ``_`` for spaces, and a row with an invalid crontab; when an operator
opens the Periodic page at 1400x1000, then each row shows under its name
in the admin, as a django-celery-beat row (not "config"), with its schedule
name beside it; the colliding row and the bad one are listed under *Not
served* by their names, with why; no word breaks in the middle, in the
arguments either; every timestamp sits on one line; the page is no wider
than the window; and *Pause* on "Every ten seconds" pauses it under that
name. The page is kept as a screenshot (``web-periodic-django-beat.png``;
``ZDELAY_WEB_SCREENSHOTS=docs/_static`` writes the one in the docs).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_zdelay import periodic
from tests.conftest import AppFactory
from tests.helpers import CeleryProcess, wait_for
from tests.support.browser import broken_words, screenshot
from tests.support.django_beat import companion, django_run, migrated_database
from tests.web_support import serve

pytestmark = pytest.mark.timeout(240)

WIDTH, HEIGHT = 1400, 1000

#: What must stay on one line: times, "(in 9s)", a tick counter, a source, a button.
ONE_LINE = (
    "#periodic time, #periodic td.runs small, #periodic td.ticks div, #periodic .source, "
    "#periodic button"
)
#: The texts of the elements matching a selector whose text spans more than one line.
WRAPPED = """(selector) => [...document.querySelectorAll(selector)].filter(element => {
        const range = document.createRange();
        range.selectNodeContents(element);
        return new Set([...range.getClientRects()].map(r => Math.round(r.top))).size > 1;
    }).map(element => element.textContent)"""

ROWS = """
from django.db import connection
from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask
ten, _ = IntervalSchedule.objects.get_or_create(every=10, period="seconds")
hourly, _ = IntervalSchedule.objects.get_or_create(every=1, period="hours")
nightly = CrontabSchedule.objects.create(minute="0", hour="3", timezone="Europe/Paris")
PeriodicTask.objects.create(
    name="Every ten seconds", task="tests.record", interval=ten, args=json.dumps(["tick"])
)
PeriodicTask.objects.create(
    name="Send the nightly sales report to finance",
    task="tests.record",
    crontab=nightly,
    args=json.dumps(["sales-report", "finance@example.com", "eu-west-1"]),
    kwargs=json.dumps(
        {"format": "xlsx", "include_refunds": True, "recipients": ["cfo@example.com"]}
    ),
)
PeriodicTask.objects.create(
    name="Clean up expired sessions",
    task="tests.record",
    interval=hourly,
    headers=json.dumps({"zdelay_overlap": "skip"}),
)
PeriodicTask.objects.create(name="Every_ten_seconds", task="tests.record", interval=ten)
PeriodicTask.objects.create(
    name="Broken crontab",
    task="tests.record",
    crontab=CrontabSchedule.objects.create(minute="99"),
)
"""


@pytest.fixture
def viewport() -> dict[str, int]:
    return {"width": WIDTH, "height": HEIGHT}


@pytest.fixture
def postgres(tmp_path: Path) -> Iterator[str]:
    """The rows in PostgreSQL, as a Django shop keeps them."""
    yield from migrated_database("postgres", tmp_path)


def test_an_operator_reads_and_pauses_django_celery_beat_rows_under_their_admin_names(
    make_test_app: AppFactory,
    postgres: str,
    processes: list[CeleryProcess],
    page: Any,
    tmp_path: Path,
) -> None:
    # Given the rows, served by a companion
    django_run(postgres, ROWS)
    app = make_test_app(conf={"zdelay_beat": True, "result_backend": "disabled://"})
    companion(app, processes, postgres, "--beat", "-S", "django")

    def ran() -> bool:
        infos = periodic.schedules(app)[1]
        return any(i.display_name == "Every ten seconds" and i.last_run_ms for i in infos)

    wait_for(ran, timeout=60, interval=0.5, message="a run of 'Every ten seconds'")

    with serve(app) as served:
        # When the operator opens the Periodic page
        page.goto(served.url + "/periodic")

        # Then each row shows under its name in the admin, as a
        # django-celery-beat row, its schedule name beside it
        shown = {
            row.get_attribute("data-name"): (
                row.locator(".name").inner_text(),
                row.locator(".source").inner_text(),
            )
            for row in page.locator("#periodic tbody tr").all()
        }

        def admin(name: str) -> tuple[str, str]:
            stored_as = name.replace(" ", "_")
            return f"{name}\ndjango-celery-beat\nstored as {stored_as}", "django-celery-beat"

        assert shown == {
            "Every_ten_seconds": admin("Every ten seconds"),
            "Send_the_nightly_sales_report_to_finance": admin(
                "Send the nightly sales report to finance"
            ),
            "Clean_up_expired_sessions": admin("Clean up expired sessions"),
        }
        # and the rows not served are named as in the admin, with why
        unserved = {
            row.get_attribute("data-name"): row.locator("td.reason").inner_text()
            for row in page.locator("#unserved tbody tr").all()
        }
        assert unserved.keys() == {"Every_ten_seconds", "Broken crontab"}
        assert "as the older row 'Every ten seconds'" in unserved["Every_ten_seconds"]
        assert "invalid crontab" in unserved["Broken crontab"]

        # and at 1400 px nothing is cramped: no word broken, in the arguments
        # either; every timestamp ("(in 9s)" too), counter, source and button
        # on one line; nothing wider than the window
        assert broken_words(page, in_code=True) == []
        assert page.evaluate(WRAPPED, ONE_LINE) == []
        assert page.locator("#periodic time").count() >= 4
        assert page.evaluate("document.documentElement.scrollWidth") <= WIDTH
        screenshot(page, "web-periodic-django-beat.png", tmp_path)

        # When the operator pauses "Every ten seconds"
        row = '#periodic tr[data-name="Every_ten_seconds"]'
        page.click(f"{row} button[value=pause]")
        page.wait_for_selector("p.message")

        # Then it is paused under that name
        assert page.text_content("p.message") == "paused Every ten seconds"
        assert page.text_content(f"{row} .state") == "paused"
        (info,) = [i for i in periodic.schedules(app)[1] if i.name == "Every_ten_seconds"]
        assert info.paused
        page.click(f"{row} button[value=resume]")
        page.wait_for_selector("p.message")
        assert page.text_content("p.message") == "resumed Every ten seconds"
        assert page.text_content(f"{row} .state") == "active"
