"""``celery -A tests.project.worker_app``: the test app, configured from the environment."""

from __future__ import annotations

import itertools
import json
import os
import signal
from typing import Any

import redis
from celery.signals import task_received

from celery_zdelay import signals as zdelay_signals
from tests.project import KILL_ON_PARKED_ENV, RECEIVED_KEY, RECORD_RECEIVED_ENV, app_from_env
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


if os.environ.get(KILL_ON_PARKED_ENV):
    # A crash at a chosen point: after the Nth park, before what follows it.
    _parks = itertools.count(1)
    _kill_at = int(os.environ[KILL_ON_PARKED_ENV])

    @zdelay_signals.tasks_parked.connect(weak=False)
    def _kill_on_parked(**_: Any) -> None:
        if next(_parks) >= _kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


if any(os.environ.get(f"ZDELAY_TEST_OTEL_{kind}") for kind in ("FILE", "BROKEN", "BLOCKING")):
    # Spans of the worker (and of a companion), or a broken or hanging
    # tracing backend, for the tracing tests.
    import tests.project.otel  # noqa: F401

# The django-celery-beat source tests (DJANGO_SETTINGS_MODULE set): Django
# is set up by Celery's Django fixup as the companion imports the app's
# modules, as in a project that does not call django.setup() itself; a
# companion that read the rows before that failed "Apps aren't loaded yet".
