"""No other site can read or drive the dashboard, over plain HTTP.

Given a dashboard with actions on a real socket and a task parked, when a
request names a host the dashboard does not serve (DNS rebinding: a page of
``attacker.example`` whose name now resolves to 127.0.0.1), then it gets a
400 with neither the task id, nor a cookie, nor a token, and its POST
changes nothing; when an action comes from a foreign ``Origin`` or
``Referer``, or carries a valid token with another browser's cookie, then it
is refused and changes nothing; the same in the Flask mount, and in the
Django mount by Django's own ``ALLOWED_HOSTS`` and CSRF rules. The
standalone server refuses ``--actions`` without authentication unless
``--no-auth`` says so, and then warns.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from werkzeug.test import Client

from celery_zdelay.store import Store
from celery_zdelay.web import create_app
from tests.helpers import CeleryProcess
from tests.support.cli import run
from tests.support.store import is_parked
from tests.web_support import cookie_of, raw_request, serve, token_in

pytestmark = pytest.mark.timeout(90)

ATTACKER = "attacker.example"


def _cancel(
    url: str, task_id: str, *, token: str, headers: dict[str, str]
) -> tuple[int, dict[str, str], str]:
    """POST the dashboard's cancel of *task_id* with this CSRF token and these headers."""
    form = {"csrf_token": token, "op": "cancel", "ids": task_id}
    return raw_request(url, "POST", "/actions/parked", headers=headers, form=form)


def test_a_rebound_host_gets_no_page_no_cookie_no_token_and_cannot_cancel(
    app: Celery, store: Store
) -> None:
    parked = app.tasks["tests.record"].apply_delayed(("keep me",), countdown=600)
    with serve(app) as served:
        port = served.server.server_port
        rebound = {"Host": f"{ATTACKER}:{port}", "Origin": f"http://{ATTACKER}:{port}"}
        for path in ("/", f"/entry?id={parked.id}", "/parked", "/dead", "/periodic"):
            status, headers, body = raw_request(served.url, "GET", path, headers=rebound)
            assert status == 400, (path, status)
            assert parked.id not in body
            assert "set-cookie" not in headers
            assert "csrf_token" not in body
            assert "allowed-host" in body  # says how to serve a name on purpose
        # The attacker's page took a cookie and token from a page it cannot
        # read, as it would have before: the POST is refused all the same.
        status, headers, body = raw_request(served.url, "GET", "/parked")
        assert status == 200
        cookie, token = cookie_of(headers), token_in(body)
        status, _, _ = _cancel(
            served.url, parked.id, token=token, headers={**rebound, "Cookie": cookie}
        )
        assert status == 400
        assert is_parked(store, parked.id)
        # Names the dashboard serves by default: loopback, any port, any case.
        for host in (f"127.0.0.1:{port}", f"LOCALHOST:{port}", f"[::1]:{port}", "localhost."):
            status, _, _ = raw_request(served.url, "GET", "/", headers={"Host": host})
            assert status == 200, host


def test_an_action_from_a_foreign_origin_or_referer_is_refused_and_changes_nothing(
    app: Celery, store: Store
) -> None:
    parked = app.tasks["tests.record"].apply_delayed(("keep me",), countdown=600)
    with serve(app) as served:
        status, headers, body = raw_request(served.url, "GET", "/parked")
        session, token = {"Cookie": cookie_of(headers)}, token_in(body)
        own = served.url  # http://127.0.0.1:<port>
        for foreign in (
            {"Origin": f"http://{ATTACKER}"},
            {"Origin": "null"},
            {"Origin": own.replace("127.0.0.1", "127.0.0.1.nip.io")},
            {"Referer": f"http://{ATTACKER}/page"},
            {"Origin": f"http://{ATTACKER}", "Referer": own + "/parked"},
        ):
            status, _, body = _cancel(
                served.url, parked.id, token=token, headers={**session, **foreign}
            )
            assert status == 403, foreign
            assert "nothing was changed" in body
            assert is_parked(store, parked.id)
        # From the dashboard's own page, the same action works.
        status, headers, _ = _cancel(
            served.url,
            parked.id,
            token=token,
            headers={**session, "Origin": own, "Referer": own + "/parked"},
        )
        assert status == 303
        assert "cancelled+1+of+1" in headers["location"]
        assert not is_parked(store, parked.id)


def test_a_valid_token_sent_with_another_browsers_cookie_is_refused(
    app: Celery, store: Store
) -> None:
    # Each browser's token is bound to its own cookie: a token read from one
    # browser's page does not work with another's cookie, however valid both are.
    parked = app.tasks["tests.record"].apply_delayed(("keep me",), countdown=600)
    with serve(app) as served:
        _, first_headers, first_page = raw_request(served.url, "GET", "/parked")
        _, second_headers, second_page = raw_request(served.url, "GET", "/parked")
        first, second = cookie_of(first_headers), cookie_of(second_headers)
        assert first != second
        status, _, body = _cancel(
            served.url, parked.id, token=token_in(first_page), headers={"Cookie": second}
        )
        assert status == 403
        assert "CSRF" in body
        assert is_parked(store, parked.id)
        status, _, _ = _cancel(
            served.url, parked.id, token=token_in(second_page), headers={"Cookie": second}
        )
        assert status == 303
        assert not is_parked(store, parked.id)


def test_hosts_named_on_purpose_are_served_and_subdomains_only_when_asked(app: Celery) -> None:
    client = Client(create_app(app, allowed_hosts=["ops.example.com", ".internal.example"]))
    assert client.get("/", headers={"Host": "ops.example.com"}).status_code == 200
    assert client.get("/", headers={"Host": "dash.internal.example:8080"}).status_code == 200
    assert client.get("/", headers={"Host": "internal.example"}).status_code == 200
    assert client.get("/", headers={"Host": "evil-ops.example.com"}).status_code == 400
    assert client.get("/", headers={"Host": "localhost"}).status_code == 400
    assert client.get("/", headers={"Host": ""}).status_code == 400


def test_a_flask_mount_refuses_foreign_hosts_and_origins(app: Celery, store: Store) -> None:
    from flask import Flask

    from celery_zdelay.web.flask import mount

    site = Flask("shop")
    site.config["SECRET_KEY"] = "flask secret"
    parked = app.tasks["tests.record"].apply_delayed((1,), countdown=600)
    dashboard = mount(site, app, "/zdelay", actions=True, wrap=lambda d: d)
    try:
        client = Client(site)
        rebound = {"Host": f"{ATTACKER}:5000"}
        reply = client.get(f"/zdelay/entry?id={parked.id}", headers=rebound)
        assert reply.status_code == 400
        assert parked.id not in reply.get_data(as_text=True)
        token = token_in(client.get("/zdelay/parked").get_data(as_text=True))
        form = {"csrf_token": token, "op": "cancel", "ids": parked.id}
        reply = client.post(
            "/zdelay/actions/parked", data=form, headers={"Origin": f"http://{ATTACKER}"}
        )
        assert reply.status_code == 403
        assert is_parked(store, parked.id)
        reply = client.post(
            "/zdelay/actions/parked", data=form, headers={"Origin": "http://localhost"}
        )
        assert reply.status_code == 303
        assert not is_parked(store, parked.id)
    finally:
        dashboard.close()
    # Flask's own TRUSTED_HOSTS, when set, are the hosts the mount serves.
    other = Flask("other")
    other.config.update(SECRET_KEY="x", TRUSTED_HOSTS=["shop.example"])
    mounted = mount(other, app, "/zdelay", wrap=lambda d: d)
    try:
        assert mounted.allowed_hosts == ("shop.example",)
    finally:
        mounted.close()


def test_a_flask_mount_with_actions_and_no_wrap_warns(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    from flask import Flask

    from celery_zdelay.web.flask import mount

    site = Flask("shop")
    site.config["SECRET_KEY"] = "flask secret"
    with caplog.at_level(logging.WARNING, logger="celery_zdelay.web.flask"):
        mount(site, app, "/zdelay", actions=True).close()
    assert "Flask's own login checks do not run" in caplog.text


def test_actions_without_authentication_need_no_auth_and_then_warn(
    app: Celery, processes: list[CeleryProcess]
) -> None:

    result = run(app, "web", "--port", "0", "--actions")
    assert result.exit_code == 2
    assert "--no-auth" in result.output
    # Said knowingly: it serves, warns, and still serves only its own hosts.
    server = CeleryProcess(app, "zdelay", "web", "--port", "0", "--actions", "--no-auth").start()
    processes.append(server)
    server.wait_for_log("dashboard on http://")
    assert "ACTIONS WITHOUT AUTHENTICATION" in server.log()
    found = re.search(r"dashboard on (http://[^/]+)/", server.log())
    assert found is not None, server.log()
    url = found.group(1)
    status, _, _ = raw_request(url, "GET", "/")
    assert status == 200
    port = url.rsplit(":", 1)[1]
    status, _, _ = raw_request(url, "GET", "/", headers={"Host": f"{ATTACKER}:{port}"})
    assert status == 400


# -- Django --------------------------------------------------------------------


@pytest.fixture
def django_urls(app: Celery) -> Iterator[Any]:
    """The dashboard mounted at /ops/ of a Django project (tests.web_django_urls)."""
    import django
    from django.conf import settings
    from django.test.utils import override_settings
    from django.urls import clear_url_caches, include, path

    if not settings.configured:
        from tests.django_project import settings as project

        settings.configure(**{n: getattr(project, n) for n in dir(project) if n.isupper()})
    django.setup()
    from celery_zdelay.web.django import dashboard_urls
    from tests import web_django_urls

    web_django_urls.urlpatterns[:] = [
        path("ops/", include(dashboard_urls(app, actions=True, decorator=lambda view: view)))
    ]
    with override_settings(
        ROOT_URLCONF="tests.web_django_urls",
        ALLOWED_HOSTS=["shop.example"],
        CSRF_TRUSTED_ORIGINS=["https://admin.shop.example"],
    ):
        clear_url_caches()
        yield web_django_urls
    web_django_urls.urlpatterns.clear()
    clear_url_caches()


def test_a_django_mount_follows_allowed_hosts_and_djangos_csrf(
    app: Celery, store: Store, django_urls: Any
) -> None:
    from django.test import Client as DjangoClient

    parked = app.tasks["tests.record"].apply_delayed((1,), countdown=600)
    client = DjangoClient(enforce_csrf_checks=True, HTTP_HOST="shop.example")
    # A host outside ALLOWED_HOSTS: Django's 400, no page.
    reply = client.get(f"/ops/entry?id={parked.id}", HTTP_HOST=f"{ATTACKER}:8000")
    assert reply.status_code == 400
    assert parked.id.encode() not in reply.content
    page = client.get("/ops/parked").content.decode()
    assert parked.id in page
    form = {
        "csrf_token": token_in(page),
        "csrfmiddlewaretoken": re.findall(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)[0],
        "op": "cancel",
        "ids": parked.id,
    }
    # Django's CSRF check: a foreign Origin, then no Django token at all.
    reply = client.post("/ops/actions/parked", form, HTTP_ORIGIN=f"http://{ATTACKER}")
    assert reply.status_code == 403
    without = {k: v for k, v in form.items() if k != "csrfmiddlewaretoken"}
    reply = client.post("/ops/actions/parked", without, HTTP_ORIGIN="http://shop.example")
    assert reply.status_code == 403
    assert is_parked(store, parked.id)
    # The project's own origin, and one of its CSRF_TRUSTED_ORIGINS, may act.
    reply = client.post("/ops/actions/parked", form, HTTP_ORIGIN="http://shop.example")
    assert reply.status_code == 303, reply.content[:300]
    assert not is_parked(store, parked.id)
    second = app.tasks["tests.record"].apply_delayed((2,), countdown=600)
    reply = client.post(
        "/ops/actions/parked",
        {**form, "ids": second.id},
        HTTP_ORIGIN="https://admin.shop.example",
        secure=True,
    )
    assert reply.status_code == 303, reply.content[:300]
    assert not is_parked(store, second.id)
