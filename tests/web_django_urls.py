"""ROOT_URLCONF of the Django mount's tests: each test fills ``urlpatterns`` itself.

The dashboard is built from the test's own Celery app (a private Redis),
which exists only once the test runs; test_web_other_sites.py mounts it here
and empties the list afterwards.
"""

from __future__ import annotations

from typing import Any

urlpatterns: list[Any] = []
