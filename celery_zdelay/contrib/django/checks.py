"""Django system checks: celery-zdelay's settings, read as Celery will read them.

``manage.py check`` (and every ``runserver``/``migrate``) reports a misspelt
``CELERY_ZDELAY_*`` name, an invalid value, and a missing
``CELERY_ZDELAY_REDIS_URL`` when the broker is not Redis, before a worker
or companion ever starts.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from django.core.checks import CheckMessage, Error, register

from ...config import get_config, unknown_settings
from ...errors import ConfigurationError

__all__ = ["NAMESPACE", "check_settings"]

#: The namespace Celery's Django guide configures the app with.
NAMESPACE = "CELERY"


@register()  # type: ignore[untyped-decorator]
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Validate the ``CELERY_ZDELAY_*`` settings; one error per problem."""
    app = Celery("celery-zdelay-check", set_as_current=False, fixups=[])
    try:
        app.config_from_object("django.conf:settings", namespace=NAMESPACE)
        problems = [Error(message, id="celery_zdelay.E001") for message in unknown_settings(app)]
        if problems:
            return problems
        try:
            _ = get_config(app).redis_url
        except ConfigurationError as exc:
            return [Error(str(exc), id="celery_zdelay.E002")]
        return []
    finally:
        app.close()
