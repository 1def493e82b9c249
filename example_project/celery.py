"""The shop's Celery app, configured from Django settings (``CELERY_*``).

Every task is a ``celery_zdelay.contrib.django.Task``: Celery's Django task
with ``apply_delayed`` and ``apply_delayed_on_commit``. Run the processes
with::

    celery -A example_project worker
    celery -A example_project zdelay
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")

app = Celery("example_project", task_cls="celery_zdelay.contrib.django:Task")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
