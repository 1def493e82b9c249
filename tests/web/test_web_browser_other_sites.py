"""No other site can drive the dashboard, in a real Chromium.

Given a dashboard with actions and a task parked, when a page of
``attacker.example``, whose name Chromium resolves to 127.0.0.1 (DNS
rebinding, made here with ``--host-resolver-rules``), loads the dashboard's
pages as its own origin and posts its forms, then it reads no task id and no
token and cancels nothing; and when a second browser sends a token read
from the first browser's page with its own (valid) cookie, the action is
refused, while its own token works.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_zdelay.store import Store
from tests.support.browser import chromium, operator_page
from tests.support.store import is_parked
from tests.web_support import serve

pytestmark = pytest.mark.timeout(180)

ATTACKER = "attacker.example"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium(f"--host-resolver-rules=MAP {ATTACKER} 127.0.0.1") as launched:
        yield launched


def test_a_rebound_page_reads_nothing_and_cancels_nothing(
    app: Celery, store: Store, browser: Any
) -> None:
    parked = app.tasks["tests.record"].apply_delayed(("keep me",), countdown=3600)
    with serve(app) as served:
        port = served.server.server_port
        with operator_page(browser) as page:
            # The attacker's page, now served from 127.0.0.1 under its own name.
            reply = page.goto(f"http://{ATTACKER}:{port}/entry?id={parked.id}")
            assert reply is not None
            assert reply.status == 400
            assert parked.id not in page.content()
            assert page.context.cookies() == []
            # Its script tries what it would with a page it could read.
            outcome = page.evaluate(
                """async (id) => {
                    const listing = await fetch('/parked');
                    const html = await listing.text();
                    const token = (html.match(/name="csrf_token" value="([0-9a-f]+)"/) || [])[1];
                    const body = new URLSearchParams(
                        {csrf_token: token || '', op: 'cancel', ids: id});
                    const post = await fetch('/actions/parked', {method: 'POST', body});
                    return {listing: listing.status, read: html.includes(id), token: !!token,
                            post: post.status};
                }""",
                parked.id,
            )
            assert outcome == {"listing": 400, "read": False, "token": False, "post": 400}
            assert is_parked(store, parked.id)
            # The same browser at the dashboard's own address: served as usual.
            page.goto(f"{served.url}/entry?id={parked.id}")
            assert page.text_content("#entry-id") == parked.id


def test_a_token_from_another_browser_is_refused_with_this_browsers_cookie(
    app: Celery, store: Store, browser: Any
) -> None:
    parked = app.tasks["tests.record"].apply_delayed(("keep me",), countdown=3600)
    # Two browsers (each a context of its own); operator_page accepts Cancel's confirmation.
    with (
        serve(app) as served,
        operator_page(browser) as first,
        operator_page(browser) as second,
    ):
        tokens = []
        for page in (first, second):
            page.goto(f"{served.url}/entry?id={parked.id}")
            tokens.append(page.get_attribute("#entry-actions input[name=csrf_token]", "value"))
        # Both browsers hold a cookie of the dashboard's own, and different ones.
        cookies = [p.context.cookies()[0]["value"] for p in (first, second)]
        assert all(cookies)
        assert cookies[0] != cookies[1]
        assert tokens[0] != tokens[1]
        page = second
        # The second browser's form, with the first browser's token put in.
        page.evaluate(
            "t => document.querySelector('#entry-actions input[name=csrf_token]').value = t",
            tokens[0],
        )
        page.click("#entry-actions button[value=cancel]")
        page.wait_for_selector("#error")
        assert "CSRF" in page.text_content("#error")
        assert is_parked(store, parked.id)
        # Its own token, unchanged, works.
        page.goto(f"{served.url}/entry?id={parked.id}")
        page.click("#entry-actions button[value=cancel]")
        page.wait_for_selector("p.message")
        assert "cancelled 1 of 1" in page.text_content("p.message")
        assert not is_parked(store, parked.id)
