"""The shop's URLs: Django's admin, and the celery-zdelay dashboard inside it.

Staff users (the admin's own rule) see what is parked at ``/admin/zdelay/``
and may cancel, run or reschedule it; everyone else is sent to the admin's
login page. The dashboard's include comes before the admin's, whose
catch-all would otherwise answer ``/admin/zdelay/`` itself.
"""

from __future__ import annotations

from django.contrib import admin
from django.urls import include, path

from celery_zdelay.web.django import dashboard_urls
from example_project import celery_app

urlpatterns = [
    path("admin/zdelay/", include(dashboard_urls(celery_app, actions=True))),
    path("admin/", admin.site.urls),
]
