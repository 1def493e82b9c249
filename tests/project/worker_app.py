"""``celery -A tests.project.worker_app``: the test app, configured from the environment."""

from __future__ import annotations

from tests.project import app_from_env

app = app_from_env()
