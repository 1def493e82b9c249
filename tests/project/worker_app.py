"""``celery -A tests.project.worker_app``: the test app, configured from the environment."""

from __future__ import annotations

import json
import os
from typing import Any

import redis
from celery.signals import task_received

from tests.project import RECEIVED_KEY, RECORD_RECEIVED_ENV, app_from_env
from tests.support.clock import redis_ms

app = app_from_env()

if os.environ.get(RECORD_RECEIVED_ENV) == "1":
    # Opt-in: one more Redis round trip per message, which the tests that
    # push thousands of tasks through a worker do not need to pay.
    _recorder = redis.Redis.from_url(os.environ["ZDELAY_TEST_RECORD"])

    @task_received.connect(weak=False)
    def _record_received(request: Any, **_: Any) -> None:
        received_ms = redis_ms(_recorder)
        _recorder.rpush(RECEIVED_KEY, json.dumps({"id": request.id, "redis_ms": received_ms}))


if any(os.environ.get(f"ZDELAY_TEST_OTEL_{kind}") for kind in ("FILE", "BROKEN", "BLOCKING")):
    # Spans of the worker (and of a companion), or a broken or hanging
    # tracing backend, for the tracing tests.
    import tests.project.otel  # noqa: F401

if os.environ.get("DJANGO_SETTINGS_MODULE") == "tests.beat_project.settings":
    # The django-celery-beat source tests: the companion reads the rows.
    import django

    django.setup()
