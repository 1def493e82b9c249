"""``celery -A proj zdelay history ID``: what happened to a task, after it is gone.

In-process through click, against a real Redis; ``--json`` fields are
checked against docs/cli.rst in ``test_cli_docs.py``.
"""

from __future__ import annotations

import json
import re

import pytest
from celery import Celery

from celery_zdelay.cli import EXIT_NOT_FOUND, EXIT_OK, EXIT_USAGE
from celery_zdelay.cli._base import cli_user
from tests.support.cli import lines, run

pytestmark = pytest.mark.timeout(60)

AT = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"


def test_a_task_cancelled_from_the_command_line_shows_parked_then_cancelled_by_the_user(
    app: Celery,
) -> None:
    # Given a task parked an hour ahead, cancelled with zdelay cancel
    result = app.tasks["tests.record"].apply_delayed((1,), countdown=3600)
    assert run(app, "cancel", result.id).exit_code == EXIT_OK

    # When its history is asked for, once it is gone
    shown = run(app, "history", result.id)

    # Then it reads, oldest first, parked (how, due when) then cancelled by whom
    assert shown.exit_code == EXIT_OK
    parked, cancelled = lines(shown)
    assert re.fullmatch(rf"{AT}  parked       plain call, due \S+Z", parked), parked
    assert re.fullmatch(rf"{AT}  cancelled    id, by {re.escape(cli_user())}", cancelled), cancelled


def test_json_gives_each_event_with_its_fields(app: Celery) -> None:
    result = app.tasks["tests.record"].apply_delayed((1,), countdown=3600, tags=["order:9"])
    run(app, "cancel", "--tag", "order:9")

    document = json.loads(run(app, "history", result.id, "--json").stdout)

    assert document["task_id"] == result.id
    assert [(e["event"], e["call"], e["reason"]) for e in document["events"]] == [
        ("parked", "keyed", None),
        ("cancelled", None, "tag"),
    ]
    assert document["events"][1]["by"] == cli_user()


def test_an_id_with_no_history_exits_3_and_says_so(app: Celery) -> None:
    shown = run(app, "history", "never-parked")

    assert shown.exit_code == EXIT_NOT_FOUND
    assert lines(shown) == ["no history  never-parked (never parked, expired, or not recorded)"]
    empty = run(app, "history", "never-parked", "--json")
    assert empty.exit_code == EXIT_NOT_FOUND
    assert json.loads(empty.stdout) == {"task_id": "never-parked", "events": []}


def test_an_id_no_task_may_have_is_refused_as_usage(app: Celery) -> None:
    shown = run(app, "history", "bad\nid")

    assert shown.exit_code == EXIT_USAGE
