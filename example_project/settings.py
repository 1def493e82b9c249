"""Django settings of the example shop.

``REDIS_URL`` is Celery's broker and, because it is Redis, also where
celery-zdelay parks delayed tasks. ``SHOP_DATABASE`` is the SQLite file.
``SHOP_PAYMENT_WINDOW_SECONDS`` is how long an order may stay unpaid: 30
minutes, or a few seconds in the demo.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent

SECRET_KEY = os.environ.get("SHOP_SECRET_KEY", "example only: not a secret")
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
INSTALLED_APPS = [
    # Before the admin: its admin/index.html links the admin to the dashboard.
    "celery_zdelay.contrib.django",
    "django.contrib.admin",
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django.contrib.sessions",
    "django.contrib.messages",
    "example_project.shop",
]
# The admin, and the celery-zdelay dashboard under /admin/zdelay/ (urls.py).
ROOT_URLCONF = "example_project.urls"
STATIC_URL = "static/"
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("SHOP_DATABASE", str(BASE_DIR / "shop.sqlite3")),
        # The demo process and the worker write the same file: wait for the
        # other's write lock rather than fail with "database is locked".
        "OPTIONS": {"timeout": 20},
    }
}
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

#: How long an order may stay unpaid before it is cancelled.
SHOP_PAYMENT_WINDOW = timedelta(
    seconds=float(os.environ.get("SHOP_PAYMENT_WINDOW_SECONDS", "1800"))
)

#: How often the periodic clean-up runs, and how late an order must be for it.
SHOP_SWEEP_SECONDS = float(os.environ.get("SHOP_SWEEP_SECONDS", "3600"))
SHOP_SWEEP_GRACE = timedelta(hours=1)

CELERY_BROKER_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_IGNORE_RESULT = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# Parked tasks live in the broker's Redis; set CELERY_ZDELAY_REDIS_URL to
# park them elsewhere (it must be set when the broker is RabbitMQ).

# The companions serve the periodic tasks: no celery beat process.
CELERY_ZDELAY_BEAT = True
CELERY_BEAT_SCHEDULE = {
    "shop-sweep": {
        "task": "shop.sweep_stale_orders",
        "schedule": SHOP_SWEEP_SECONDS,
        # A sweep slowed down by a big backlog must not run twice at once
        # (both would cancel the same orders): a tick due meanwhile is
        # skipped, and counted in `zdelay periodic list`. A sweep whose
        # worker died stops blocking after 10 minutes.
        "zdelay_overlap": "skip",
        "zdelay_overlap_timeout": 600,
    },
}
