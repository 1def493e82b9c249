"""What workers hold on their ETA timers, as the migration guide reads it."""

from __future__ import annotations

from datetime import datetime

from celery import Celery


def held_etas(app: Celery) -> dict[str, float]:
    """Task id -> eta (epoch s) of the ETA tasks every worker holds (``inspect scheduled``)."""
    replies = app.control.inspect(timeout=2.0).scheduled() or {}
    return {
        held["request"]["id"]: datetime.fromisoformat(held["eta"]).timestamp()
        for tasks in replies.values()
        for held in tasks
    }
