"""The Django app: add ``"celery_zdelay.contrib.django"`` to ``INSTALLED_APPS``."""

from __future__ import annotations

from django.apps import AppConfig

__all__ = ["ZDelayAppConfig"]


class ZDelayAppConfig(AppConfig):  # type: ignore[misc]
    """Registers celery-zdelay's system checks (see :mod:`.checks`)."""

    name = "celery_zdelay.contrib.django"
    label = "celery_zdelay"
    verbose_name = "celery-zdelay"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers the checks)
