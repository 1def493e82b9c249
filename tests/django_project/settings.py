"""Django settings of the tests' project: the auth app's tables on SQLite.

``tests/contrib/django/test_django.py`` configures Django from these with a database file
of its own per test process; tests write real rows in real transactions.
"""

from __future__ import annotations

SECRET_KEY = "celery-zdelay tests: not a secret"
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
