"""Django integration: tasks parked when the database transaction commits.

Install with ``pip install celery-zdelay[django]`` and use the task class for
every task of the app::

    app = Celery("proj", task_cls="celery_zdelay.contrib.django:Task")
"""

from __future__ import annotations

from .task import Task

__all__ = ["Task"]
