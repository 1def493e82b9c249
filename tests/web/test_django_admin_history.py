"""The Django admin's history of limits and pauses changed through the Django mount.

Given the dashboard mounted in a Django project with the admin (SQLite and
PostgreSQL), when a staff user sets, changes and removes a rate limit and
pauses and resumes a queue through it, then each change is an admin
``LogEntry`` by that user saying what changed; a refused form, a resume of
a name that was not paused and a change made outside the mount (Python)
write none.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from tests.support.django_beat import django_run

pytestmark = pytest.mark.timeout(120)

#: Run in a Django process on the test's database (see ``django_run``).
_CHANGES = """
import os, re
from celery import Celery
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client
from django.urls import include, path

from celery_zdelay import limits
from celery_zdelay.web.django import dashboard_urls
from tests import web_django_urls

call_command("migrate", verbosity=0)
store = os.environ["ZDELAY_TEST_STORE"]
app = Celery("adminhistory", broker=store, task_cls="celery_zdelay:Task", set_as_current=False)
app.conf.zdelay_redis_url = store
web_django_urls.urlpatterns[:] = [path("admin/zdelay/", include(dashboard_urls(app, actions=True)))]
client = Client()
client.force_login(User.objects.create_user("ops", is_staff=True))
page = client.get("/admin/zdelay/control").content.decode()
token = re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)


def act(**form):
    reply = client.post("/admin/zdelay/actions/control", {"csrf_token": token, **form})
    return reply.status_code


statuses = [
    act(op="limit", name="queue:celery", rate="50/s", burst="10"),
    act(op="limit", name="queue:celery", rate="fast"),  # refused: nothing changed
    act(op="pause", name="queue:celery"),
    act(op="resume", name="queue:celery"),
    act(op="resume", name="queue:celery"),  # was not paused: nothing changed
    act(op="unlimit", name="queue:celery"),
]
limits.pause("task:tests.record", app=app, by="support:alice")  # outside the mount
print(json.dumps({
    "statuses": statuses,
    "entries": [
        [e.user.username, e.action_flag == CHANGE, e.object_id, e.object_repr, e.change_message]
        for e in LogEntry.objects.order_by("pk")
    ],
}))
"""


def test_limit_and_pause_changes_through_the_django_mount_are_in_the_admins_history(
    database: str,
    app: Celery,
) -> None:
    # Breaks if: _log_control_change is not connected, or limits.py stops
    # sending control_changed (or sends it for a change that did not happen).
    done: dict[str, Any] = django_run(
        database,
        _CHANGES,
        settings="tests.django_project.admin_settings",
        env={"ZDELAY_TEST_STORE": app.conf.zdelay_redis_url},
    )
    assert done["statuses"] == [303, 400, 303, 303, 303, 303]
    entries = done["entries"]
    assert [e[:4] for e in entries] == [
        ["ops", True, "queue:celery", "release control queue:celery"],
    ] * 4
    messages = [e[4] for e in entries]
    assert messages[0] == (
        "Rate limit of queue:celery set to 50/s (burst 10), from the celery-zdelay dashboard."
    )
    assert messages[1].startswith("Paused queue:celery (since ")
    assert messages[2] == "Resumed queue:celery, from the celery-zdelay dashboard."
    assert messages[3] == "Rate limit of queue:celery removed, from the celery-zdelay dashboard."
