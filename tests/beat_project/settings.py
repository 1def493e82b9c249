"""Settings of the django-celery-beat test project (see the package docstring)."""

from __future__ import annotations

import os

import django

SECRET_KEY = "celery-zdelay tests: not a secret"
INSTALLED_APPS = ["django.contrib.contenttypes", "django_celery_beat"]
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"

_kind, _, _name = os.environ.get("ZDELAY_TEST_BEAT_DB", "sqlite::memory:").partition(":")
if _kind == "postgres":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": _name,
            "USER": "postgres",
            "HOST": "127.0.0.1",
            "PORT": "5432",
        }
    }
else:
    # The test and the companion both write (a row edit, last_run_at): on a
    # loaded machine SQLite's default 5 s lock wait was seen to run out. And a
    # row's save runs django-celery-beat's update_or_create of its change
    # marker, a read then a write in one transaction: begun deferred, its
    # write finds the companion's write lock and SQLite answers "database is
    # locked" at once, without waiting (waiting could deadlock). Begun
    # IMMEDIATE (Django 5.1+), it takes the write lock first, and waits.
    options: dict[str, object] = {"timeout": 30}
    if django.VERSION >= (5, 1):
        options["transaction_mode"] = "IMMEDIATE"
    DATABASES = {
        "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": _name, "OPTIONS": options}
    }
