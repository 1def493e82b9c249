"""The dashboard in a real headless Chromium, against a real Redis, companion and worker.

Given tasks parked for later, an operator loads the overview and sees the
timeline, filters the listing, opens an entry, cancels one (gone from
Redis), reschedules one (new due time shown and stored), and requeues a dead
letter that a real worker then runs. A hostile entry renders inert, and an
action without a valid CSRF token changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from celery import Celery

import celery_zdelay
from celery_zdelay import periodic
from celery_zdelay.store import Store
from tests.conftest import AppFactory
from tests.helpers import CeleryProcess, Runs
from tests.support.browser import screenshot
from tests.support.deadletters import make_dead_letter
from tests.web_support import serve

pytestmark = [pytest.mark.timeout(180), pytest.mark.timing]

HOUR_S = 3600


def test_an_operator_sees_filters_cancels_reschedules_and_requeues(
    app: Celery,
    store: Store,
    page: Any,
    runs: Runs,
    companion: Callable[..., CeleryProcess],
    worker: Callable[..., CeleryProcess],
    tmp_path: Path,
) -> None:
    # Given: reminders spread over the next day, two additions, one dead letter.
    record, add = app.tasks["tests.record"], app.tasks["tests.add"]
    reminders = [
        record.apply_delayed((f"reminder {i}",), {"user": i}, countdown=HOUR_S + 97 * i)
        for i in range(120)
    ]
    adds = [add.apply_delayed((i, i), countdown=2 * HOUR_S + i) for i in range(2)]
    lost = record.apply_delayed(("requeue me",), countdown=HOUR_S)
    make_dead_letter(store, lost.id, "bad signature: the entry was signed with an old key")
    companion(app)
    worker(app)

    with serve(app) as served:
        # The overview counts them, shows the companion and the timeline.
        page.goto(served.url + "/")
        assert page.text_content("#count-parked") == "122"
        assert page.text_content("#count-dead") == "1"
        bars = page.locator("#timeline rect")
        counts = [int(bars.nth(i).get_attribute("data-count")) for i in range(bars.count())]
        assert sum(counts) == 122
        assert max(counts) < 122  # spread over several bars of the day
        # The heartbeat appears by itself: the overview refreshes without a reload.
        page.evaluate("document.body.dataset.marker = 'same page'")
        page.wait_for_selector("#companions tr.alive", timeout=30_000)
        assert page.evaluate("document.body.dataset.marker") == "same page"
        screenshot(page, "web-overview.png", tmp_path)

        # Filter: only the additions.
        page.goto(served.url + "/parked")
        assert page.locator("#parked tbody tr").count() == 50  # one page
        page.fill("#filters input[name=task]", "tests.add")
        page.click("#filters button[type=submit]")
        rows = page.locator("#parked tbody tr")
        assert rows.count() == 2
        assert {rows.nth(i).get_attribute("data-id") for i in range(2)} == {a.id for a in adds}
        page.fill("#filters input[name=task]", "tests.*")
        page.click("#filters button[type=submit]")
        screenshot(page, "web-parked.png", tmp_path)

        # Open an entry: headers and reprs as Celery recorded them.
        page.fill("#filters input[name=task]", "tests.add")
        page.click("#filters button[type=submit]")
        page.click(f'#parked tr[data-id="{adds[0].id}"] a.entry-link')
        assert page.text_content("#entry-id") == adds[0].id
        assert page.text_content("#entry-task") == "tests.add"
        assert page.text_content("#entry-argsrepr") == "(0, 0)"
        assert page.text_content("#entry-state") == "parked"

        # Cancel it: gone from Redis.
        page.click("#entry-actions button[value=cancel]")
        page.wait_for_selector("p.message")
        assert "cancelled 1 of 1" in page.text_content("p.message")
        keys = store.keys(store.shard_of(adds[0].id))
        assert store.client.zscore(keys.due, adds[0].id) is None
        assert store.client.hget(keys.msg, adds[0].id) is None

        # Reschedule the other by a delay: its new due time is shown and stored.
        page.goto(served.url + "/entry?id=" + adds[1].id)
        before = page.get_attribute("#entry-due time", "data-ms")
        page.fill("#entry-actions input[name=delay]", "5h")
        page.click("#entry-actions button[value=reschedule]")
        page.wait_for_selector("p.message")
        assert "rescheduled 1 of 1" in page.text_content("p.message")
        shown = int(page.get_attribute("#entry-due time", "data-ms"))
        assert shown != int(before)
        stored = int(store.client.zscore(store.keys(store.shard_of(adds[1].id)).due, adds[1].id))
        assert stored // 1024 == shown
        assert abs(shown - (store.time_ms() + 5 * HOUR_S * 1000)) < 60_000
        assert "in 4h 59m" in page.text_content("#entry-due")

        # Requeue the dead letter from the dead-letter page: a real worker runs it.
        page.goto(served.url + "/dead")
        assert "bad signature" in page.text_content(f'#dead tr[data-id="{lost.id}"] .reason')
        page.check(f'#dead tr[data-id="{lost.id}"] input[name=ids]')
        page.click("#dead-form button[value=requeue]")
        page.wait_for_selector("p.message")
        assert "requeued 1 of 1" in page.text_content("p.message")
        runs.wait_for_ids({lost.id})
        assert runs.by_id()[lost.id]["args"] == ["requeue me"]
        assert page.locator(f'#dead tr[data-id="{lost.id}"]').count() == 0
    assert not any(r.id in runs.ids() for r in reminders)


HOSTILE = '"><img src=x onerror="window.__xss=1"><script>window.__xss=2</script>'


def test_hostile_ids_names_reprs_and_headers_render_inert(
    app: Celery, store: Store, page: Any
) -> None:
    # Given entries whose every visible field is an attack, and one not even UTF-8.
    celery_zdelay.send_delayed(
        app,
        "<script>window.__xss=3</script>",
        args=(HOSTILE,),
        kwargs={"k": HOSTILE},
        countdown=HOUR_S,
        task_id="id" + HOSTILE,
        headers={"x-evil": HOSTILE},
        queue="q" + HOSTILE,
    )
    long_repr = "<b>" + "A" * 100_000
    app.tasks["tests.record"].apply_delayed((long_repr,), countdown=HOUR_S, task_id="long-one")
    raw_id = b"bad-\xff\xfe<script>window.__xss=4</script>"
    keys = store.keys(0)
    store.client.hset(keys.msg, raw_id, b"\xff\xfe<script>window.__xss=5</script>")
    store.client.zadd(keys.due, {raw_id: (store.time_ms() + 1000_000) * 1024})
    dead_id = "dead" + HOSTILE
    celery_zdelay.send_delayed(
        app, "tests.record", args=(HOSTILE,), countdown=HOUR_S, task_id=dead_id
    )
    make_dead_letter(store, dead_id, "reason " + HOSTILE)
    periodic.add("<script>window.__xss=6</script>", app=app, task="tests.record", schedule=60)

    with serve(app) as served:
        dialogs: list[str] = []
        page.on("dialog", lambda d: dialogs.append(d.message))
        paths = [
            "/",
            "/parked",
            "/dead",
            "/periodic",
            "/entry?" + urlencode({"id": "id" + HOSTILE}),
            "/entry?" + urlencode({"id": dead_id}),
        ]
        for path in paths:
            page.goto(served.url + path)
            assert page.evaluate("window.__xss") is None
            # Only the dashboard's own script tag exists; no injected element.
            assert page.evaluate("document.querySelectorAll('script').length") == 1
        assert page.locator("img").count() == 0
        assert page.text_content("#entry-id") == dead_id  # shown as text, found by its id
        page.goto(served.url + "/dead")
        assert "reason " + HOSTILE in page.text_content("#dead")
        page.goto(served.url + "/periodic")
        assert "<script>window.__xss=6</script>" in page.text_content("#periodic")
        page.goto(served.url + "/parked")
        text = page.text_content("#parked")
        assert "<script>window.__xss=3</script>" in text
        assert HOSTILE[:20] in text
        assert "bad-\ufffd\ufffd<script>" in text  # non-UTF-8 shown replaced, as text
        page.goto(served.url + "/entry?id=long-one")
        assert page.text_content("#entry-argsrepr").startswith("('<b>AAAA")
        assert page.locator("b").count() == 0
        assert dialogs == []


def test_an_action_without_a_valid_csrf_token_is_refused_and_changes_nothing(
    app: Celery, store: Store, browser: Any
) -> None:
    parked = app.tasks["tests.record"].apply_delayed(("keep me",), countdown=HOUR_S)
    keys = store.keys(store.shard_of(parked.id))
    with serve(app) as served:
        context = browser.new_context()
        try:
            page = context.new_page()
            page.goto(served.url + "/entry?id=" + parked.id)
            token = page.get_attribute("#entry-actions input[name=csrf_token]", "value")
            form = {"op": "cancel", "ids": parked.id}
            # Another browser that loaded the dashboard too: it holds a valid
            # cookie of its own, so the token below is refused for being
            # bound to another cookie, not for a missing one.
            other = browser.new_context()
            other.new_page().goto(served.url + "/parked")
            assert [c["name"] for c in other.cookies()] == ["zdelay_csrf"]
            # No token, a wrong token, and a good token from another browser.
            for fields, ctx in (
                (form, context),
                ({**form, "csrf_token": "0" * 64}, context),
                ({**form, "csrf_token": token}, other),
            ):
                reply = ctx.request.post(served.url + "/actions/parked", form=fields)
                assert reply.status == 403
                assert "CSRF" in reply.text()
                assert store.client.zscore(keys.due, parked.id) is not None
            other.close()
            # A GET never acts.
            reply = context.request.get(served.url + "/actions/parked?op=cancel&ids=" + parked.id)
            assert reply.status == 405
            assert store.client.zscore(keys.due, parked.id) is not None
            # With the page's own token, the same request works.
            reply = context.request.post(
                served.url + "/actions/parked", form={**form, "csrf_token": token}
            )
            assert reply.status == 200  # followed the redirect
            assert store.client.zscore(keys.due, parked.id) is None
        finally:
            context.close()


def test_an_operator_pauses_resumes_and_runs_a_periodic_schedule(
    make_test_app: AppFactory,
    page: Any,
    runs: Runs,
    companion: Callable[..., CeleryProcess],
    worker: Callable[..., CeleryProcess],
) -> None:
    # "Run now" makes an AsyncResult in the server's request thread; with a
    # result backend, collecting it later opens a pub/sub connection in that
    # thread's own backend, which nothing closes. Runs are recorded anyway.
    app = make_test_app(conf={"result_backend": "disabled://"})
    assert periodic.add("hourly-report", app=app, task="tests.record", schedule=3600, args=["r"])
    companion(app)
    worker(app)
    with serve(app) as served:
        page.goto(served.url + "/periodic")
        row = '#periodic tr[data-name="hourly-report"]'
        assert page.text_content(f"{row} .state") == "active"
        page.click(f"{row} button[value=pause]")
        page.wait_for_selector("p.message")
        assert page.text_content(f"{row} .state") == "paused"
        assert periodic.schedules(app)[1][0].paused
        page.click(f"{row} button[value=resume]")
        page.wait_for_selector("p.message")
        assert page.text_content(f"{row} .state") == "active"
        page.click(f"{row} button[value=run]")
        message = page.text_content("p.message")
        assert message is not None
        assert "hourly-report runs now as periodic:hourly-report:run:" in message
        task_id = message.rsplit(" ", 1)[1]
        runs.wait_for_ids({task_id})
        assert runs.by_id()[task_id]["args"] == ["r"]


def test_a_date_picked_in_the_browsers_zone_is_stored_as_that_instant(
    app: Celery, store: Store, page: Any
) -> None:
    # The page's browser runs in Europe/Paris (UTC+1 in January).
    parked = app.tasks["tests.record"].apply_delayed(("later",), countdown=HOUR_S)
    with serve(app) as served:
        page.goto(served.url + "/entry?id=" + parked.id)
        page.fill("#entry-actions input.local-eta", "2030-01-15T10:30")
        page.click("#entry-actions button[value=reschedule]")
        page.wait_for_selector("p.message")
        assert "rescheduled 1 of 1" in page.text_content("p.message")
        due = store.client.zscore(store.keys(store.shard_of(parked.id)).due, parked.id)
        assert int(due) // 1024 == 1894699800000  # 2030-01-15T09:30:00Z
        assert page.text_content("#entry-due time") == "2030-01-15T09:30:00Z"
        local = page.text_content("time.local")
        assert local is not None
        assert "10:30" in local  # the same instant, in the browser's zone
