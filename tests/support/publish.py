"""Task messages as the companion hands them to a publisher, and what a publisher said.

The publishers' kill tests (generic, Redis broker, confirming) drive a
publisher directly with these, against a real broker, with no store,
worker or companion.
"""

from __future__ import annotations

import uuid
from typing import Any

from celery_zdelay.companion.publish.generic import PublishOutcome
from celery_zdelay.entry import TaskMessage

__all__ = ["ids", "settled", "task_message"]


def task_message(
    task_id: str,
    queue: str,
    *,
    exchange: str = "",
    routing_key: str | None = None,
    priority: int = 0,
    body: bytes | None = None,
    headers: dict[str, Any] | None = None,
    properties: dict[str, Any] | None = None,
) -> TaskMessage:
    """A task message for *queue* (routed by its name unless *routing_key*), which it
    names to be declared; *headers* and *properties* are added to the usual ones."""
    return TaskMessage(
        body=b'[["%s"], {}, {}]' % task_id.encode() if body is None else body,
        content_type="application/json",
        content_encoding="utf-8",
        headers={"lang": "py", "task": "tests.add", "id": task_id, **(headers or {})},
        properties={"correlation_id": task_id, "delivery_mode": 2, **(properties or {})},
        priority=priority,
        exchange=exchange,
        routing_key=queue if routing_key is None else routing_key,
        declare=[queue] if queue else [],
    )


def ids(prefix: str, n: int) -> list[str]:
    """*n* task ids of the test's own, starting with *prefix*."""
    return [f"{prefix}-{i}-{uuid.uuid4().hex[:6]}" for i in range(n)]


def settled(outcome: PublishOutcome) -> tuple[list[int], dict[int, str], BaseException | None]:
    """(accepted, rejected, error): the whole of a publisher's answer, to compare at once."""
    return outcome.accepted, outcome.rejected, outcome.error
