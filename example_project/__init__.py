"""A small Django shop on Celery and celery-zdelay.

An order left unpaid for the payment window (30 minutes) is cancelled by a
task parked when the order was created; paying cancels that task. Run the
whole story with ``python -m example_project.demo`` (``make demo``).
"""

from __future__ import annotations

# Django's convention: the Celery app is loaded with the project, so
# ``celery -A example_project worker`` finds it and @shared_task binds to it.
from .celery import app as celery_app

__all__ = ["celery_app"]
