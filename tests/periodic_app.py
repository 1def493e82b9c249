"""``celery -A tests.periodic_app``: the test app with a ``beat_schedule`` from the environment.

``ZDELAY_TEST_BEAT`` holds the schedule as JSON: each entry as in
``beat_schedule``, with ``"schedule"`` a number of seconds or
``{"crontab": {...crontab keyword arguments...}}``; any other value is
passed through as is (to test invalid schedules). ``"options":
"unserializable"`` becomes options that JSON cannot hold.
"""

from __future__ import annotations

import json
import os
from typing import Any

from celery.schedules import crontab

from tests.project import app_from_env

__all__ = ["BEAT_ENV", "app", "beat_schedule"]

BEAT_ENV = "ZDELAY_TEST_BEAT"


def beat_schedule(spec: dict[str, Any]) -> dict[str, Any]:
    """Return a Celery ``beat_schedule`` from its JSON form."""
    schedule = {}
    for name, raw in spec.items():
        entry = dict(raw)
        value = entry.get("schedule")
        if isinstance(value, dict) and "crontab" in value:
            entry["schedule"] = crontab(**value["crontab"])
        if entry.get("options") == "unserializable":
            entry["options"] = {"headers": {"made_by": object()}}
        schedule[name] = entry
    return schedule


app = app_from_env()
app.conf.beat_schedule = beat_schedule(json.loads(os.environ.get(BEAT_ENV, "{}")))
