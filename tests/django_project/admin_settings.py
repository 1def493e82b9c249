"""Settings of the Django admin mount's tests: the admin's history on a real database.

The database is django-celery-beat's test project's (``ZDELAY_TEST_BEAT_DB``:
``sqlite:<path>`` or ``postgres:<database>``); the dashboard is mounted in
``tests.web_django_urls`` by the test's own code, behind the admin's login.
"""

from __future__ import annotations

from tests.beat_project.settings import DATABASES  # noqa: F401 (a setting)

SECRET_KEY = "celery-zdelay tests: not a secret"
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
]
ROOT_URLCONF = "tests.web_django_urls"
ALLOWED_HOSTS = ["testserver"]
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
