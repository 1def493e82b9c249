"""CSRF tokens for the dashboard's forms, and the standalone server's authentication.

Every action is a POST that must carry a token bound to a cookie of the same
browser (signed double submit): a page on another site can make the browser
send the cookie, but cannot read it, so it cannot forge the token. Tokens are
HMACs under the dashboard's secret, so a cookie planted from a sibling domain
gives no valid token either.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "CSRF_COOKIE",
    "CSRF_FIELD",
    "BasicAuth",
    "ProxyHeaderAuth",
    "csrf_token",
    "new_csrf_cookie",
    "valid_csrf",
]

#: Cookie holding the browser's random CSRF value.
CSRF_COOKIE = "zdelay_csrf"
#: Form field holding the token.
CSRF_FIELD = "csrf_token"

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def new_csrf_cookie() -> str:
    """Return a fresh random cookie value."""
    return secrets.token_urlsafe(32)


def csrf_token(secret: bytes, cookie: str) -> str:
    """Return the form token that goes with *cookie*."""
    return hmac.new(secret, b"zdelay-csrf\0" + cookie.encode(), hashlib.sha256).hexdigest()


def valid_csrf(secret: bytes, cookie: str | None, token: str | None) -> bool:
    """Whether *token* was made for *cookie* under *secret* (in constant time)."""
    if not cookie or not token:
        return False
    return hmac.compare_digest(csrf_token(secret, cookie), token)


class BasicAuth:
    """WSGI middleware: HTTP basic authentication with one user and password."""

    def __init__(self, app: WSGIApp, user: str, password: str, realm: str = "zdelay") -> None:
        self.app = app
        self.expected = f"{user}:{password}".encode()
        self.realm = realm

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        header = environ.get("HTTP_AUTHORIZATION", "")
        scheme, _, encoded = header.partition(" ")
        try:
            given = base64.b64decode(encoded.strip(), validate=True)
        except (binascii.Error, ValueError):
            given = b""
        if scheme.lower() == "basic" and hmac.compare_digest(given, self.expected):
            return self.app(environ, start_response)
        start_response(
            "401 Unauthorized",
            [
                ("Content-Type", "text/plain; charset=utf-8"),
                ("WWW-Authenticate", f'Basic realm="{self.realm}", charset="UTF-8"'),
            ],
        )
        return [b"Log in to see the celery-zdelay dashboard.\n"]


class ProxyHeaderAuth:
    """WSGI middleware: let in requests whose reverse proxy named a user in *header*.

    Only safe behind a proxy that authenticates every request and removes the
    header from what clients send; the standalone server binds 127.0.0.1 by
    default so that only such a proxy reaches it.
    """

    def __init__(self, app: WSGIApp, header: str) -> None:
        self.app = app
        self.key = "HTTP_" + header.upper().replace("-", "_")

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if environ.get(self.key, "").strip():
            return self.app(environ, start_response)
        start_response("403 Forbidden", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"The reverse proxy did not name an authenticated user.\n"]
