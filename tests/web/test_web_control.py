"""Rate limits and pauses on the dashboard, over WSGI against a real Redis.

Given limits from the settings and from run time, a paused queue and tasks a
real companion pass held back, when an operator opens "Limits and pauses",
then each is listed with where its limit comes from, since when it is
paused, and how many tasks wait behind it. With actions enabled, the page's
forms set, change and remove a limit and pause and resume a queue through
the same public functions as the CLI (the companions' gate reads what they
store), each with an audit line naming the dashboard user. Bad input is a
400 that says what to write and changes nothing; a read-only dashboard
offers no form and refuses every post; a post without the CSRF token, or
from another site, changes nothing. ``zdelay status`` shows the same.
"""

from __future__ import annotations

import base64
import json
import logging
import re
from html import unescape
from typing import Any
from urllib.parse import unquote_plus

import pytest
from celery import Celery
from werkzeug.test import Client

import celery_zdelay
from celery_zdelay.companion import Companion
from celery_zdelay.limits import concurrency, controls, rate_limits
from celery_zdelay.store import Store
from celery_zdelay.web import create_app
from celery_zdelay.web.security import BasicAuth
from tests.conftest import AppFactory
from tests.helpers import wait_for
from tests.support.cli import run
from tests.support.deadletters import make_dead_letter
from tests.web_support import token_in

pytestmark = pytest.mark.timeout(90)

QUEUES = [{"name": "celery"}, {"name": "emails"}]
AUTH = {"Authorization": "Basic " + base64.b64encode(b"alice:s3cret").decode()}


@pytest.fixture
def app(make_test_app: AppFactory) -> Celery:
    return make_test_app(
        conf={
            "zdelay_shards": 4,
            "zdelay_audit_log": True,
            "zdelay_rate_limits": {"task:tests.add": "10/m"},
        },
        queues=QUEUES,
    )


@pytest.fixture
def client(app: Celery) -> Client:
    """A dashboard with actions, behind basic authentication as alice."""
    return Client(BasicAuth(create_app(app, actions=True), "alice", "s3cret"))


def _row(html: str, name: str) -> str:
    found = re.search(r'<tr data-name="' + re.escape(name) + r'">(.*?)</tr>', html, re.DOTALL)
    assert found is not None, html[-3000:]
    return found.group(1)


def _cell(row: str, cls: str) -> str:
    found = re.search(r'<td class="' + cls + r'"[^>]*>(.*?)</td>', row, re.DOTALL)
    assert found is not None, row
    return re.sub(r"<[^>]+>", "", found.group(1)).strip()


def _post(client: Client, **fields: str) -> Any:
    token = token_in(client.get("/control", headers=AUTH).get_data(as_text=True))
    return client.post(
        "/actions/control", headers=AUTH, data={"csrf_token": token, "back": "control", **fields}
    )


def _message(reply: Any) -> str:
    assert reply.status_code == 303, reply.get_data(as_text=True)[-1500:]
    location = reply.headers["Location"]
    assert location.startswith("/control?msg=")
    return unquote_plus(location.split("msg=", 1)[1])


def test_the_page_lists_every_limit_and_pause_with_what_waits_behind_it(
    app: Celery, store: Store
) -> None:
    # Given a limit from the settings, one set at run time, a paused queue,
    # and 3 emails a companion's pass held back behind the pause
    celery_zdelay.set_rate_limit("queue:celery", "50/s", burst=80, app=app)
    since = celery_zdelay.pause("queue:emails", app=app)
    for i in range(3):
        app.tasks["tests.record"].apply_delayed((i,), countdown=0, queue="emails")
    with Companion(app) as companion:
        companion.release_due()
    assert [(c.name, c.waiting) for c in controls(app=app) if c.waiting] == [("queue:emails", 3)]

    # When an operator opens the page of a read-only dashboard
    html = Client(create_app(app)).get("/control").get_data(as_text=True)

    # Then each control is a row saying what holds it and what waits
    setting = _row(html, "task:tests.add")
    assert (_cell(setting, "limit"), _cell(setting, "source")) == ("10/m (burst 1)", "setting")
    assert _cell(setting, "paused") == "no"
    runtime = _row(html, "queue:celery")
    assert (_cell(runtime, "limit"), _cell(runtime, "source")) == ("50/s (burst 80)", "runtime")
    paused = _row(html, "queue:emails")
    assert _cell(paused, "limit") == "none"
    assert f'data-ms="{since}"' in paused  # since when, on the Redis clock
    assert _cell(paused, "paused").startswith("since ")
    assert "ago" in _cell(paused, "paused")
    assert _cell(paused, "waiting") == "3 waiting behind the pause"
    # ...and, read-only, no form and no button to change anything
    assert "<form" not in html.split("<main>", 1)[1]
    assert "actions/control" not in html
    assert "/control" in html.split("<nav>", 1)[1].split("</nav>", 1)[0]
    # The overview says it too: held tasks are not in its parked count
    overview = Client(create_app(app)).get("/overview.part").get_data(as_text=True)
    assert 'id="count-held">3<' in overview
    assert '<small id="controls-summary">(1 paused, 2 limited)</small>' in overview


def test_tasks_held_by_a_limit_are_counted_as_such(app: Celery) -> None:
    # Given a limit of 1/m with a burst of 1 and 4 tasks due
    celery_zdelay.set_rate_limit("queue:emails", "1/m", app=app)
    for i in range(4):
        app.tasks["tests.record"].apply_delayed((i,), countdown=0, queue="emails")
    with Companion(app) as companion:
        companion.release_due()
        companion.release_due()
    # Then one went out with the burst's token and 3 are held by the limit
    html = Client(create_app(app)).get("/control").get_data(as_text=True)
    assert _cell(_row(html, "queue:emails"), "waiting") == "3 held by the limit"


def test_limits_are_set_changed_and_removed_from_the_page_and_audited(
    app: Celery, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="celery_zdelay.audit"):
        # Set, with the default burst; change, with a burst; remove
        message = _message(_post(client, op="limit", name="queue:emails", rate="50/s"))
        assert message == "queue:emails: limit 50/s (burst 50)"
        assert rate_limits(app=app)["queue:emails"].burst == 50
        message = _message(_post(client, op="limit", name="queue:emails", rate="20/m", burst="5"))
        assert message == "queue:emails: limit 20/m (burst 5)"
        limit = rate_limits(app=app)["queue:emails"]
        assert (limit.text, limit.burst) == ("20/m", 5)
        assert _message(_post(client, op="unlimit", name="queue:emails")) == (
            "queue:emails: no rate limit"
        )
        assert "queue:emails" not in rate_limits(app=app)
        # A limit of the settings is removed too (the store overrides it)
        _message(_post(client, op="unlimit", name="task:tests.add"))
        assert "task:tests.add" not in rate_limits(app=app)

    # Each change has its audit line, naming the dashboard user
    lines = [r.getMessage() for r in caplog.records if r.name == "celery_zdelay.audit"]
    assert lines == [
        "Rate limit of queue:emails set to 50/s (burst 50) by dashboard:alice",
        "Rate limit of queue:emails set to 20/m (burst 5) by dashboard:alice",
        "Rate limit of queue:emails removed by dashboard:alice",
        "Rate limit of task:tests.add removed by dashboard:alice",
    ]
    # ...and the page shows the limit now in force
    html = client.get("/control", headers=AUTH).get_data(as_text=True)
    assert 'data-name="queue:emails"' not in html


def test_concurrency_is_set_shown_and_removed_from_the_page_and_audited(
    app: Celery, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="celery_zdelay.audit"):
        message = _message(_post(client, op="concurrency", name="task:tests.add", most="2"))
        assert message == "task:tests.add: concurrency 2"
        # (a name the settings lack applies once workers can have read it)
        wait_for(lambda: concurrency(app=app).get("task:tests.add") == 2, timeout=10)
        row = _row(client.get("/control", headers=AUTH).get_data(as_text=True), "task:tests.add")
        assert _cell(row, "concurrency") == "2 (0 running, runtime)"
        assert 'value="unconcurrency"' in row
        message = _message(_post(client, op="unconcurrency", name="task:tests.add"))
        assert message == "task:tests.add: no concurrency control"
        assert concurrency(app=app) == {}
        row = _row(client.get("/control", headers=AUTH).get_data(as_text=True), "task:tests.add")
        assert _cell(row, "concurrency") == "none"
    lines = [r.getMessage() for r in caplog.records if r.name == "celery_zdelay.audit"]
    assert lines == [
        "Concurrency of task:tests.add set to 2 by dashboard:alice",
        "Concurrency of task:tests.add removed by dashboard:alice",
    ]


def test_a_queue_is_paused_and_resumed_from_the_page_and_audited(
    app: Celery, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="celery_zdelay.audit"):
        message = _message(_post(client, op="pause", name="queue:emails"))
        (info,) = [c for c in controls(app=app) if c.name == "queue:emails"]
        assert info.paused_since_ms is not None
        assert message.startswith("paused queue:emails (since ")
        html = client.get("/control", headers=AUTH).get_data(as_text=True)
        row = _row(html, "queue:emails")
        assert 'value="resume"' in row
        assert 'value="pause"' not in row

        assert _message(_post(client, op="resume", name="queue:emails")) == "resumed queue:emails"
        assert all(c.paused_since_ms is None for c in controls(app=app))
        assert _message(_post(client, op="resume", name="queue:emails")) == (
            "queue:emails was not paused"
        )
    lines = [r.getMessage() for r in caplog.records if r.name == "celery_zdelay.audit"]
    assert len(lines) == 2
    assert re.fullmatch(r"Paused queue:emails \(since .+Z\) by dashboard:alice", lines[0])
    assert lines[1] == "Resumed queue:emails by dashboard:alice"


def test_an_unknown_queue_is_applied_with_the_warning_said(app: Celery, client: Client) -> None:
    message = _message(_post(client, op="pause", name="queue:emials"))
    assert message.startswith("paused queue:emials")
    assert "Warning: queue:emials: the app knows no queue 'emials'" in message
    assert "queue:emials" in {c.name for c in controls(app=app)}


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"op": "limit", "name": "queue:emails", "rate": "fast"}, "'fast' is not a rate"),
        ({"op": "limit", "name": "queue:emails", "rate": "5/w"}, "such as '100/s'"),
        ({"op": "limit", "name": "queue:emails", "rate": ""}, "give a rate"),
        ({"op": "limit", "name": "queue:emails", "rate": "5/s", "burst": "0"}, "at least 1"),
        ({"op": "limit", "name": "queue:emails", "rate": "5/s", "burst": "lots"}, "whole number"),
        ({"op": "limit", "name": "emails", "rate": "5/s"}, "write 'queue:<queue name>'"),
        ({"op": "pause", "name": ""}, "is not a control name"),
        ({"op": "pause", "name": "queue:a b"}, "without braces or spaces"),
        ({"op": "concurrency", "name": "queue:emails", "most": "0"}, "at least 1"),
        ({"op": "concurrency", "name": "queue:emails", "most": "two"}, "whole number"),
        ({"op": "concurrency", "name": "queue:emails"}, "whole number"),
        ({"op": "concurrency", "name": "emails", "most": "2"}, "write 'queue:<queue name>'"),
        (
            {"op": "throttle", "name": "queue:emails"},
            "use limit, unlimit, concurrency, unconcurrency, pause, resume",
        ),
    ],
)
def test_bad_input_is_a_400_that_says_what_to_write_and_changes_nothing(
    app: Celery, client: Client, fields: dict[str, str], says: str
) -> None:
    before = controls(app=app)
    reply = _post(client, **fields)
    assert reply.status_code == 400
    text = unescape(re.sub(r"\s+", " ", reply.get_data(as_text=True)))
    assert says in text
    if fields["op"] != "throttle":
        assert "Nothing was changed" in text
    assert controls(app=app) == before


def test_a_read_only_dashboard_refuses_every_control_action(app: Celery) -> None:
    client = Client(create_app(app, actions=False))
    token = token_in(client.get("/parked").get_data(as_text=True))
    for op in ("limit", "unlimit", "pause", "resume"):
        reply = client.post(
            "/actions/control",
            data={"csrf_token": token, "op": op, "name": "queue:emails", "rate": "1/s"},
        )
        assert reply.status_code == 403
        assert "read-only" in reply.get_data(as_text=True)
    assert [c.name for c in controls(app=app)] == ["task:tests.add"]


def test_a_post_without_the_token_or_from_another_site_changes_nothing(
    app: Celery, client: Client
) -> None:
    token = token_in(client.get("/control", headers=AUTH).get_data(as_text=True))
    attempts: list[tuple[dict[str, str], dict[str, str]]] = [
        ({}, {}),  # no token
        ({"csrf_token": "0" * 64}, {}),  # a wrong one
        ({"csrf_token": token}, {"Origin": "http://attacker.example"}),
    ]
    for extra, headers in attempts:
        reply = client.post(
            "/actions/control",
            headers={**AUTH, **headers},
            data={"op": "pause", "name": "queue:emails", **extra},
        )
        assert reply.status_code == 403
        assert "nothing was changed" in reply.get_data(as_text=True)
    assert all(c.paused_since_ms is None for c in controls(app=app))
    # The same token, from the dashboard's own page, works
    reply = client.post(
        "/actions/control",
        headers={**AUTH, "Origin": "http://localhost"},
        data={"op": "pause", "name": "queue:emails", "csrf_token": token},
    )
    assert reply.status_code == 303


def test_zdelay_status_shows_what_is_paused_since_when_and_what_waits(app: Celery) -> None:
    since = celery_zdelay.pause("queue:emails", app=app)
    for i in range(2):
        app.tasks["tests.record"].apply_delayed((i,), countdown=0, queue="emails")
    with Companion(app) as companion:
        companion.release_due()

    text = run(app, "status").stdout
    (line,) = [line for line in text.splitlines() if "queue:emails" in line]
    assert "paused since" in line
    assert line.rstrip().endswith("2 waiting")
    document = json.loads(run(app, "status", "--json").stdout)
    (emails,) = [c for c in document["controls"] if c["name"] == "queue:emails"]
    assert (emails["paused_since_ms"], emails["waiting"]) == (since, 2)


def _post_parked(client: Client, path: str, **fields: str) -> str:
    token = token_in(client.get(path, headers=AUTH).get_data(as_text=True))
    action = "/actions/dead" if path == "/dead" else "/actions/parked"
    reply = client.post(action, headers=AUTH, data={"csrf_token": token, **fields})
    assert reply.status_code == 303, reply.get_data(as_text=True)[-1500:]
    return unquote_plus(reply.headers["Location"])


def test_a_cancel_and_a_reschedule_from_the_dashboard_are_audited_with_the_user(
    app: Celery, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    record = app.tasks["tests.record"]
    doomed, moved = (record.apply_delayed((i,), countdown=600).id for i in range(2))
    with caplog.at_level(logging.INFO, logger="celery_zdelay.audit"):
        # When alice cancels one task and reschedules another from the dashboard
        assert "cancelled 1 of 1" in _post_parked(client, "/parked", op="cancel", ids=doomed)
        location = _post_parked(
            client, "/parked", op="reschedule", ids=moved, eta="2100-01-01T00:00Z"
        )
        assert "rescheduled 1 of 1" in location

    # Then each has its audit line naming her, as from the CLI
    lines = [r.getMessage() for r in caplog.records if r.name == "celery_zdelay.audit"]
    assert lines == [
        f"Cancelled {doomed} by dashboard:alice",
        f"Rescheduled {moved}: due 2100-01-01T00:00:00Z by dashboard:alice",
    ]


def test_dead_letters_requeued_and_purged_from_the_dashboard_are_audited_with_the_user(
    app: Celery, store: Store, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    ids = [app.tasks["tests.record"].apply_delayed((i,), countdown=600).id for i in range(3)]
    for task_id in ids:
        make_dead_letter(store, task_id, "refused")
    with caplog.at_level(logging.INFO, logger="celery_zdelay.audit"):
        assert "requeued 1 of 1" in _post_parked(client, "/dead", op="requeue", ids=ids[0])
        assert "purged 1 of 1" in _post_parked(client, "/dead", op="purge", ids=ids[1])
        assert "purged 1" in _post_parked(client, "/dead", op="purge", scope="all")

    lines = [r.getMessage() for r in caplog.records if r.name == "celery_zdelay.audit"]
    assert lines == [
        f"Requeued {ids[0]}, due now by dashboard:alice",
        f"Purged 1 dead-lettered entries (asked: {ids[1]}) by dashboard:alice",
        "Purged every dead-lettered entry (1) by dashboard:alice",
    ]
