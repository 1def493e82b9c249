"""Mount the dashboard in a Django project, behind Django's own authentication.

::

    # urls.py
    from celery_zdelay.web.django import dashboard_urls
    from proj.celery import app

    urlpatterns = [
        path("admin/zdelay/", include(dashboard_urls(app, actions=True))),
        path("admin/", admin.site.urls),
    ]

By default only active staff users get in (``staff_member_required``,
which sends others to the admin login); pass ``permission="app.codename"``
to require a permission instead, or ``decorator=`` for any view decorator.

With ``"celery_zdelay.contrib.django"`` in ``INSTALLED_APPS`` before
``"django.contrib.admin"``, the admin index links to the dashboard; the
dashboard's header links back to the admin index.

A cancel, and a change of a rate limit or a pause, made through the mount
is written to the admin's history (``LogEntry``, by the user who made it,
when ``django.contrib.admin`` is installed) and names that user in the
audit line and in :data:`~celery_zdelay.signals.tasks_cancelled` and
:data:`~celery_zdelay.signals.control_changed` (``by="dashboard:<username>"``).

Hosts and origins follow Django's own rules: a request whose host is not in
``ALLOWED_HOSTS`` is refused by ``request.get_host()`` (a 400), and every
action passes Django's CSRF check (``Origin`` against the host and
``CSRF_TRUSTED_ORIGINS``, ``Referer`` over HTTPS, Django's token, which the
dashboard's forms carry besides their own).
"""

from __future__ import annotations

import contextvars
import io
import sys
from collections.abc import Callable
from typing import Any

from celery import Celery
from django.conf import settings
from django.contrib.admin.views.decorators import staff_member_required
from django.contrib.auth.decorators import permission_required
from django.http import HttpRequest, HttpResponse
from django.http.request import RawPostDataException
from django.middleware.csrf import get_token
from django.urls import NoReverseMatch, URLPattern, re_path, reverse
from django.views.decorators.csrf import csrf_protect

from .. import signals
from ..errors import ConfigurationError
from .app import FORM_FIELDS_KEY, HOME_KEY, Dashboard

__all__ = ["dashboard_urls", "dashboard_view"]


def dashboard_view(
    dashboard: Dashboard,
    *,
    permission: str | None = None,
    decorator: Callable[[Any], Any] | None = None,
) -> Callable[..., HttpResponse]:
    """Return a Django view serving *dashboard* under the URL it is included at."""
    if permission is not None and decorator is not None:
        # One of them would be dropped, and a dropped permission lets more people in.
        raise ConfigurationError(
            "Give the dashboard permission= or decorator=, not both; to require a "
            "permission with your decorator, wrap permission_required() in it."
        )

    # Django's CSRF check runs on every action, whether or not the project
    # has CsrfViewMiddleware: its Origin and Referer rules are the project's
    # (CSRF_TRUSTED_ORIGINS), and the dashboard's forms carry Django's token.
    @csrf_protect  # type: ignore[untyped-decorator]
    def view(request: HttpRequest, path: str = "") -> HttpResponse:
        # ALLOWED_HOSTS, as Django checks it (DisallowedHost: a 400). The
        # dashboard's own host check is off ("*") in this mount, so this is it.
        request.get_host()
        environ = dict(request.META)
        environ[FORM_FIELDS_KEY] = [("csrfmiddlewaretoken", get_token(request))]
        home = _admin_index()
        if home is not None:
            environ[HOME_KEY] = ("Django admin", home)
        prefix = request.path[: len(request.path) - len(path)].rstrip("/")
        environ["SCRIPT_NAME"] = prefix
        environ["PATH_INFO"] = "/" + path
        try:
            body = request.body
        except RawPostDataException:
            # Django's CSRF check parsed a multipart form from the stream: pass
            # on its fields (the dashboard's forms hold no files).
            body = request.POST.urlencode().encode()
            environ["CONTENT_TYPE"] = "application/x-www-form-urlencoded"
        environ["wsgi.input"] = io.BytesIO(body)
        environ["CONTENT_LENGTH"] = str(len(body))
        # What a WSGI server sets and an ASGI request's META lacks.
        environ.setdefault("wsgi.url_scheme", request.scheme)
        environ.setdefault("wsgi.errors", sys.stderr)
        user = getattr(request, "user", None)
        if user is not None and user.is_authenticated:
            environ["REMOTE_USER"] = user.get_username()
        captured: dict[str, Any] = {}

        def start_response(status: str, headers: list[tuple[str, str]], *exc: Any) -> None:
            captured["status"] = int(status.split(" ", 1)[0])
            captured["headers"] = headers

        token = _acting_user.set(user if user is not None and user.is_authenticated else None)
        try:
            body = b"".join(dashboard(environ, start_response))
        finally:
            _acting_user.reset(token)
        response = HttpResponse(body, status=captured["status"])
        for name, value in captured["headers"]:
            if name.lower() == "set-cookie":
                # Through Django's cookie jar, which its handlers and test client read.
                response.cookies.load(value)
            else:
                response[name] = value
        return response

    if decorator is not None:
        return decorator(view)  # type: ignore[no-any-return]
    if permission is not None:
        return permission_required(permission)(view)  # type: ignore[no-any-return]
    return staff_member_required(view)  # type: ignore[no-any-return]


#: The Django user a request through the mount acts for, while it is served.
_acting_user: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "celery_zdelay_django_user", default=None
)


def _log_cancellations(sender: Any, task_ids: list[str], **_: Any) -> None:
    """Write the admin's history of a cancel made through the mount, one row per task."""
    user = _acting_user.get()
    if user is None or not task_ids:
        return
    from django.apps import apps

    if not apps.is_installed("django.contrib.admin"):
        return
    from django.contrib.admin.models import DELETION, LogEntry

    LogEntry.objects.bulk_create(
        [
            LogEntry(
                user_id=user.pk,
                content_type=None,
                object_id=task_id,
                object_repr=f"parked task {task_id}"[:200],
                action_flag=DELETION,
                change_message="Cancelled before release, from the celery-zdelay dashboard.",
            )
            for task_id in task_ids
        ]
    )


signals.tasks_cancelled.connect(
    _log_cancellations, weak=False, dispatch_uid="celery_zdelay.web.django.log_cancellations"
)


def _log_control_change(sender: Any, name: str, change: str, **_: Any) -> None:
    """Write the admin's history of a limit or pause changed through the mount."""
    user = _acting_user.get()
    if user is None:
        return
    from django.apps import apps

    if not apps.is_installed("django.contrib.admin"):
        return
    from django.contrib.admin.models import CHANGE, LogEntry

    LogEntry.objects.create(
        user_id=user.pk,
        content_type=None,
        object_id=name,
        object_repr=f"release control {name}"[:200],
        action_flag=CHANGE,
        change_message=f"{change}, from the celery-zdelay dashboard.",
    )


signals.control_changed.connect(
    _log_control_change, weak=False, dispatch_uid="celery_zdelay.web.django.log_control_change"
)


def _admin_index() -> str | None:
    """Return the URL of the admin index, or None when the project has no admin."""
    try:
        return str(reverse("admin:index"))
    except NoReverseMatch:
        return None


def dashboard_urls(
    celery_app: Celery,
    *,
    actions: bool = False,
    permission: str | None = None,
    decorator: Callable[[Any], Any] | None = None,
) -> list[URLPattern]:
    """Return URL patterns serving the dashboard of *celery_app*; ``include()`` them."""
    dashboard = Dashboard(
        celery_app,
        actions=actions,
        secret_key=settings.SECRET_KEY,
        allowed_hosts=["*"],
        check_origin=False,
    )
    view = dashboard_view(dashboard, permission=permission, decorator=decorator)
    return [re_path(r"^(?P<path>.*)$", view, name="zdelay-dashboard")]
