"""A dashboard token is good only with the cookie it was made for; strangers stay out.

Pins each line of ``celery_zdelay/web/security.py`` that mutation testing
found unguarded (see docs/mutation.rst): the token is an HMAC of the
browser's cookie under the dashboard's secret, and the two WSGI guards let
in exactly the requests they promise to.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Callable
from typing import Any

import pytest

from celery_zdelay.web.security import (
    BasicAuth,
    ProxyHeaderAuth,
    csrf_token,
    new_csrf_cookie,
    valid_csrf,
)

pytestmark = pytest.mark.timeout(30)

SECRET = b"dashboard secret"


def _inner(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"inside"]


def _call(app: Any, **environ: str) -> tuple[str, dict[str, str], bytes]:
    seen: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        seen["status"], seen["headers"] = status, dict(headers)

    body = b"".join(app(environ, start_response))
    return seen["status"], seen["headers"], body


def _basic(credentials: str, scheme: str = "Basic") -> str:
    return f"{scheme} {base64.b64encode(credentials.encode()).decode()}"


def test_a_token_is_the_hmac_of_the_cookie_under_the_secret_and_nothing_else() -> None:
    cookie = new_csrf_cookie()
    expected = hmac.new(SECRET, b"zdelay-csrf\0" + cookie.encode(), hashlib.sha256).hexdigest()
    assert csrf_token(SECRET, cookie) == expected
    assert csrf_token(b"another secret", cookie) != expected
    assert csrf_token(SECRET, cookie + "x") != expected


def test_a_valid_token_sent_with_another_browsers_cookie_is_refused() -> None:
    mine, theirs = new_csrf_cookie(), new_csrf_cookie()
    assert mine != theirs
    assert valid_csrf(SECRET, mine, csrf_token(SECRET, mine))
    assert not valid_csrf(SECRET, theirs, csrf_token(SECRET, mine))
    assert not valid_csrf(b"another secret", mine, csrf_token(SECRET, mine))


@pytest.mark.parametrize(("cookie", "token"), [(None, "x"), ("", "x"), ("c", None), ("c", "")])
def test_a_missing_cookie_or_token_is_refused(cookie: str | None, token: str | None) -> None:
    assert not valid_csrf(SECRET, cookie, token)
    if not cookie:
        # Not even with the token an empty cookie would have: no cookie proves nothing.
        assert not valid_csrf(SECRET, cookie, csrf_token(SECRET, ""))


def test_cookies_are_long_random_and_url_safe() -> None:
    cookies = {new_csrf_cookie() for _ in range(50)}
    assert len(cookies) == 50
    for cookie in cookies:
        assert len(cookie) >= 43
        assert set(cookie) <= set(
            "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
        )


def test_basic_auth_lets_in_the_one_user_with_its_password_only() -> None:
    app = BasicAuth(_inner, "ops", "s3cret")
    assert _call(app, HTTP_AUTHORIZATION=_basic("ops:s3cret"))[0] == "200 OK"
    # The scheme is case-insensitive (RFC 7617).
    assert _call(app, HTTP_AUTHORIZATION=_basic("ops:s3cret", "basic"))[0] == "200 OK"
    for header in (
        _basic("ops:wrong"),
        _basic("other:s3cret"),
        _basic("ops:s3cret", "Bearer"),
        "Basic not*base64",
        "",
    ):
        status, headers, body = _call(app, HTTP_AUTHORIZATION=header)
        assert status == "401 Unauthorized", header
        assert headers["WWW-Authenticate"] == 'Basic realm="zdelay", charset="UTF-8"'
        assert body == b"Log in to see the celery-zdelay dashboard.\n"
    status, headers, _ = _call(app)
    assert status == "401 Unauthorized"


def test_basic_auth_refuses_credentials_that_are_not_strict_base64() -> None:
    app = BasicAuth(_inner, "ops", "s3cret")
    encoded = base64.b64encode(b"ops:s3cret").decode()
    # A lenient decoder would drop the stray characters and let these in.
    for mangled in (encoded[:4] + "*" + encoded[4:], encoded[:4] + "\n" + encoded[4:]):
        assert _call(app, HTTP_AUTHORIZATION=f"Basic {mangled}")[0] == "401 Unauthorized"
    # WSGI hands headers over as latin-1 text: a non-ASCII one is refused, not a crash.
    assert _call(app, HTTP_AUTHORIZATION="Basic b3BzOnMzY3JldA==\u00e9")[0] == "401 Unauthorized"


def test_basic_auth_names_its_realm() -> None:
    app = BasicAuth(_inner, "ops", "s3cret", realm="shop")
    _, headers, _ = _call(app)
    assert headers["WWW-Authenticate"] == 'Basic realm="shop", charset="UTF-8"'


def test_the_proxy_header_lets_in_only_requests_that_name_a_user() -> None:
    app = ProxyHeaderAuth(_inner, "X-Forwarded-User")
    assert _call(app, HTTP_X_FORWARDED_USER="alice") == (
        "200 OK",
        {"Content-Type": "text/plain"},
        b"inside",
    )
    for environ in ({}, {"HTTP_X_FORWARDED_USER": "  "}, {"HTTP_X_FORWARDED_USER": ""}):
        status, _, body = _call(app, **environ)
        assert status == "403 Forbidden"
        assert body == b"The reverse proxy did not name an authenticated user.\n"
    # Another header is not the one the proxy sets.
    assert _call(app, HTTP_X_USER="alice")[0] == "403 Forbidden"
