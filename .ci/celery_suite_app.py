"""The companion's app for ``make celery-suite``: the broker Celery's tests use.

The companion only moves parked messages to the broker; it needs no task
of the suite, only the broker (``TEST_BROKER``), where the store lives too.
"""

from __future__ import annotations

import os

from celery import Celery

import celery_zdelay  # noqa: F401

app = Celery("celery_suite", broker=os.environ["TEST_BROKER"])
