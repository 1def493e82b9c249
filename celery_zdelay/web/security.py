"""Who may talk to the dashboard: served hosts, origins, CSRF tokens, authentication.

A page of another site must not drive the dashboard. DNS rebinding points
a name the attacker owns at 127.0.0.1, so the operator's browser treats the
dashboard as that site's own origin: it may read pages (task ids, the
token) and post forms. Only the ``Host`` header tells such requests apart,
so every request naming a host the dashboard does not serve is refused
(:func:`host_allowed`); a state change whose ``Origin`` (or, without one,
``Referer``) is another site is refused too (:func:`foreign_origin`).

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
from urllib.parse import urlsplit

__all__ = [
    "CSRF_COOKIE",
    "CSRF_FIELD",
    "LOOPBACK_HOSTS",
    "BasicAuth",
    "ProxyHeaderAuth",
    "csrf_token",
    "foreign_origin",
    "host_allowed",
    "host_name",
    "new_csrf_cookie",
    "valid_csrf",
]

#: Cookie holding the browser's random CSRF value.
CSRF_COOKIE = "zdelay_csrf"
#: Form field holding the token.
CSRF_FIELD = "csrf_token"

#: Hosts served when no others are named: the loopback names, on any port.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")

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


def host_name(host: str) -> str:
    """Return the name in a ``Host`` header value, without port, lower case, without a final dot."""
    host = host.strip().lower()
    if host.startswith("["):
        name = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        name = host.partition(":")[0]
    else:
        name = host
    return name.rstrip(".")


def host_allowed(host: str, allowed: Iterable[str]) -> bool:
    """Whether the ``Host`` header value *host* names one of *allowed*.

    Entries are names or addresses (any port); ``.example.com`` also matches
    every subdomain, as in Django's ``ALLOWED_HOSTS``; ``*`` matches any host
    (for a mount whose framework checked the host already).
    """
    name = host_name(host)
    if not name:
        return False
    for given in allowed:
        if given == "*":
            return True
        entry = host_name(given)
        if name == entry:
            return True
        if entry.startswith(".") and (name == entry[1:] or name.endswith(entry)):
            return True
    return False


def foreign_origin(
    host: str, origin: str | None, referer: str | None, trusted: Iterable[str]
) -> str | None:
    """Return the foreign origin a state change came from, or None when it may act.

    The origin is the ``Origin`` header, or without one the scheme and host of
    the ``Referer``. It may act when its host (and port) is the request's
    *host* itself, or when it is one of *trusted* (``https://ops.example.com``,
    for a proxy that rewrites ``Host``). A request with neither header (curl,
    scripts) is left to the CSRF token; ``Origin: null`` (a sandboxed frame,
    a ``data:`` page) is foreign.
    """
    source = origin
    if source is None and referer:
        parts = urlsplit(referer)
        source = f"{parts.scheme}://{parts.netloc}" if parts.scheme and parts.netloc else "null"
    if source is None:
        return None
    source = source.strip()
    parts = urlsplit(source)
    if parts.scheme in ("http", "https") and parts.netloc.lower() == host.strip().lower():
        return None
    if source.rstrip("/").lower() in {t.rstrip("/").lower() for t in trusted}:
        return None
    return source


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
            # Who acts, for the audit line and tasks_cancelled (WSGI's own key).
            environ["REMOTE_USER"] = given.split(b":", 1)[0].decode("utf-8", "replace")
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
        user = environ.get(self.key, "").strip()
        if user:
            environ["REMOTE_USER"] = user
            return self.app(environ, start_response)
        start_response("403 Forbidden", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"The reverse proxy did not name an authenticated user.\n"]
