"""The demo's Celery app: a Redis broker, and celery-zdelay parking delayed tasks.

Run by ``python -m example_project.demo``; the broker (and store) URL comes
from ``REDIS_URL``.
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery

app = Celery(
    "example_project",
    broker=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
    task_cls="celery_zdelay:Task",
)
app.conf.update(worker_hijack_root_logger=False, broker_connection_retry_on_startup=True)

_runs = redis.Redis.from_url(app.conf.broker_url)


@app.task(bind=True)
def remind(self, customer: str, due_ms: int) -> None:
    """Pretend to send a reminder; record when it ran, on the Redis clock."""
    seconds, micros = _runs.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    _runs.rpush(
        "demo:runs",
        json.dumps({"id": self.request.id, "customer": customer, "late_ms": now_ms - due_ms}),
    )
    time.sleep(0)
