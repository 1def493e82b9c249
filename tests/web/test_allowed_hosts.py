"""The dashboard serves only the hosts it names, and acts only for its own origin.

Pins each line of the host and origin checks in
``celery_zdelay/web/security.py`` that mutation testing found unguarded
(see docs/mutation.rst): :func:`host_name` reads the name a ``Host`` header
gives (port, case, brackets and a final dot dropped), :func:`host_allowed`
matches it exactly or as a subdomain of a ``.domain`` entry and nothing
else, and :func:`foreign_origin` lets a state change act only when its
``Origin`` (else its ``Referer``) is the request's own host or a trusted
origin. The checks are pure functions, so these tests need no server; the
same refusals through a served dashboard are in test_web_other_sites.py.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import pytest

from celery_zdelay.web.security import (
    LOOPBACK_HOSTS,
    BasicAuth,
    foreign_origin,
    host_allowed,
    host_name,
)

pytestmark = pytest.mark.timeout(30)

HOST = "localhost:8000"


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("example.com", "example.com"),
        ("example.com:8080", "example.com"),
        (" Example.COM.:8080 ", "example.com"),
        ("[::1]:8000", "::1"),
        ("[::1]", "::1"),
        ("::1", "::1"),
        ("[FE80::1]:80", "fe80::1"),
        ("localhost.", "localhost"),
        ("", ""),
    ],
)
def test_the_host_name_is_the_header_without_port_case_brackets_or_final_dot(
    header: str, name: str
) -> None:
    assert host_name(header) == name


def test_the_loopback_names_are_served_on_any_port_in_any_case() -> None:
    for header in ("localhost", "LOCALHOST:8000", "127.0.0.1:1", "[::1]:8000", "::1", "localhost."):
        assert host_allowed(header, LOOPBACK_HOSTS), header
    # The entries are read like headers too: a port or a case in them does not matter.
    assert host_allowed("ops.example.com:443", ["OPS.Example.com:8443"])


@pytest.mark.parametrize(
    "header",
    [
        "attacker.example",
        "notlocalhost",  # ends with an allowed name, is not it
        "localhost.attacker.example",  # starts with it
        "127.0.0.2",
        "[::2]:8000",
    ],
)
def test_a_host_not_named_is_refused(header: str) -> None:
    assert not host_allowed(header, LOOPBACK_HOSTS)


def test_a_dot_entry_serves_the_domain_and_its_subdomains_and_nothing_else() -> None:
    allowed = [".example.com"]
    for header in ("example.com", "ops.example.com:8000", "a.b.EXAMPLE.com"):
        assert host_allowed(header, allowed), header
    for header in ("badexample.com", "example.com.attacker.example", "xample.com", "com", "other"):
        assert not host_allowed(header, allowed), header
    # Without the dot, an entry is one name: its subdomains are not served.
    assert not host_allowed("ops.example.com", ["example.com"])


def test_a_star_serves_every_host_but_an_empty_one() -> None:
    assert host_allowed("anything.example:1", ["*"])
    assert host_allowed("anything.example", ["localhost", "*"])
    # No name at all is never a host the dashboard serves, whatever the entries say.
    for header in ("", " ", ":8000", "[]:8000", "."):
        assert not host_allowed(header, ["*"]), header
        assert not host_allowed(header, ["", "."]), header


def test_no_entries_serve_no_host() -> None:
    assert not host_allowed("localhost", [])


@pytest.mark.parametrize(
    ("origin", "referer"),
    [
        ("http://localhost:8000", None),
        ("https://LOCALHOST:8000", None),
        (" http://localhost:8000 ", None),
        (None, "http://localhost:8000/parked?page=2"),
        # The Origin decides when both are sent; a stale Referer does not.
        ("http://localhost:8000", "http://attacker.example/page"),
        # A request with neither header (curl, a script) is left to the CSRF token.
        (None, None),
        (None, ""),
    ],
)
def test_a_state_change_from_the_dashboards_own_origin_may_act(
    origin: str | None, referer: str | None
) -> None:
    assert foreign_origin(HOST, origin, referer, ()) is None


@pytest.mark.parametrize(
    ("origin", "referer", "reported"),
    [
        ("http://attacker.example", None, "http://attacker.example"),
        ("http://localhost:8001", None, "http://localhost:8001"),  # another port is another site
        ("http://localhost", None, "http://localhost"),
        ("ftp://localhost:8000", None, "ftp://localhost:8000"),  # not a web origin
        ("null", None, "null"),  # a sandboxed frame, a data: page
        (" null ", "http://localhost:8000/", "null"),
        (None, "https://attacker.example/a/page?x=1", "https://attacker.example"),
        # A Referer that names no site is reported as "null", never as acting.
        (None, "/parked", "null"),
        (None, "http:///parked", "null"),
        (None, "//localhost:8000/parked", "null"),
        # The Origin decides when both are sent; the dashboard's own Referer does not help.
        ("http://attacker.example", "http://localhost:8000/parked", "http://attacker.example"),
    ],
)
def test_a_state_change_from_another_origin_is_refused_and_named(
    origin: str | None, referer: str | None, reported: str
) -> None:
    assert foreign_origin(HOST, origin, referer, ()) == reported


def test_a_trusted_origin_may_act_whatever_the_host_header_says() -> None:
    trusted = ["https://ops.example.com/", "https://other.example.com"]
    for origin in (
        "https://ops.example.com",
        "HTTPS://OPS.example.com/",
        "https://other.example.com/",
    ):
        assert foreign_origin("10.0.0.5:8000", origin, None, trusted) is None, origin
    assert foreign_origin("10.0.0.5:8000", None, "https://ops.example.com/x", trusted) is None
    for origin in ("https://attacker.example", "http://ops.example.com", "https://ops.example.co"):
        assert foreign_origin("10.0.0.5:8000", origin, None, trusted) == origin, origin


def _inner(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [environ["REMOTE_USER"].encode()]


def test_basic_auth_names_the_user_who_acts_not_the_password() -> None:
    app = BasicAuth(_inner, "ops", "pass:with:colons")
    seen: dict[str, str] = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        seen["status"] = status

    header = "Basic " + base64.b64encode(b"ops:pass:with:colons").decode()
    body = b"".join(app({"HTTP_AUTHORIZATION": header}, start_response))
    assert seen["status"] == "200 OK"
    assert body == b"ops"
