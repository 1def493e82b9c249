"""The dashboard as a WSGI application: routing, pages and actions.

Pages are rendered on the server by Jinja2 with autoescaping on for every
template, so ids, task names, reprs and headers read from Redis reach the
browser as text, never as markup. Actions are POSTs carrying a CSRF token
(:mod:`.security`) and exist only when the dashboard was built with
``actions=True``; each answers with a redirect (post/redirect/get).
"""

from __future__ import annotations

import os
import re
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from importlib import resources
from typing import Any
from urllib.parse import urlencode

from celery import Celery
from jinja2 import Environment, PackageLoader
from markupsafe import Markup, escape
from werkzeug.exceptions import BadRequest, Forbidden, HTTPException, NotFound
from werkzeug.routing import Map, Rule
from werkzeug.wrappers import Request, Response

from .. import limits, steering
from .._format import ago, count, duration, relative_due, utc
from ..config import get_config
from ..errors import ConfigurationError, ZDelayError
from ..keys import validate_tag
from ..names import validate_task_id
from ..schedule import Due, due_from, parse_delay, parse_when
from ..store import Store, admin
from ..store.client import store_errors
from ..store.marks import tag_count
from ..task_history import HistoryEvent, describe, history_in
from . import queries
from .security import (
    CSRF_COOKIE,
    CSRF_FIELD,
    LOOPBACK_HOSTS,
    csrf_token,
    foreign_origin,
    host_allowed,
    host_name,
    new_csrf_cookie,
    valid_csrf,
)

__all__ = ["FORM_FIELDS_KEY", "HOME_KEY", "MAX_BULK", "Dashboard", "create_app"]

#: WSGI environ key a mount sets to (name, value) pairs every action form
#: carries besides the dashboard's own token (the Django mount: Django's
#: CSRF token, so Django's own CSRF check passes).
FORM_FIELDS_KEY = "celery_zdelay.form_fields"
#: WSGI environ key a mount sets to (label, url) of the site the dashboard
#: lives in, linked from its header (the Django mount: the admin index).
HOME_KEY = "celery_zdelay.home"

#: Most entries one action changes, so one click cannot hold a server thread
#: for long. An action on a filter that matches more changes nothing and
#: says so (narrow the filter, or use the CLI, which has no such bound):
#: "apply again for the rest" would take the first matches in due order
#: again, and a reschedule whose new time still matches would move the same
#: entries twice and never reach the rest.
MAX_BULK = 25_000
#: Entries per page of the parked listing.
PAGE_SIZE = 50
#: Characters of a repr shown in a listing cell (the entry page shows all of it).
CLIP = 120

_STATIC = {"dashboard.css": "text/css", "dashboard.js": "text/javascript"}
# Where an action may send the browser back to: a page of this app, nothing else.
_BACK = re.compile(r"^(?:|parked|dead|entry|periodic|control)(?:\?[^\\\s]*)?$")


def create_app(
    celery_app: Celery,
    *,
    actions: bool = False,
    secret_key: str | bytes | None = None,
    title: str = "celery-zdelay",
    allowed_hosts: Iterable[str] | None = None,
    trusted_origins: Iterable[str] = (),
) -> Dashboard:
    """Return the dashboard of *celery_app*'s store as a WSGI application.

    Read-only unless *actions* is true. *secret_key* signs the CSRF tokens:
    give the same one to every process serving the dashboard (the Django
    mount passes ``SECRET_KEY``); by default each process makes its own.

    *allowed_hosts* are the names (and addresses) browsers reach the
    dashboard by: a request naming any other ``Host`` is refused with a 400,
    which is what defeats DNS rebinding. Default: the loopback names
    (``localhost``, ``127.0.0.1``, ``::1``); ``.example.com`` matches its
    subdomains; ``"*"`` turns the check off, for a framework that checks
    hosts itself. An action whose ``Origin`` (or ``Referer``) is not the
    dashboard's own host is refused, unless it is one of *trusted_origins*
    (``"https://ops.example.com"``, for a proxy that rewrites ``Host``).
    """
    return Dashboard(
        celery_app,
        actions=actions,
        secret_key=secret_key,
        title=title,
        allowed_hosts=allowed_hosts,
        trusted_origins=trusted_origins,
    )


class Dashboard:
    """The WSGI application :func:`create_app` returns."""

    def __init__(
        self,
        celery_app: Celery,
        *,
        actions: bool = False,
        secret_key: str | bytes | None = None,
        title: str = "celery-zdelay",
        allowed_hosts: Iterable[str] | None = None,
        trusted_origins: Iterable[str] = (),
        check_origin: bool = True,
    ) -> None:
        self.celery_app = celery_app
        self.actions = actions
        self.title = title
        self.allowed_hosts = tuple(LOOPBACK_HOSTS if allowed_hosts is None else allowed_hosts)
        if not self.allowed_hosts:
            raise ConfigurationError(
                "The dashboard's allowed_hosts is empty, so it would refuse every request: "
                "name the hosts browsers reach it by, or leave it None for the loopback names."
            )
        if isinstance(trusted_origins, str):
            # A string is an iterable of one-letter "origins": almost surely a slip.
            raise ConfigurationError(
                f"trusted_origins takes a list of origins, such as [{trusted_origins!r}]."
            )
        self.trusted_origins = tuple(trusted_origins)
        # Off only where the framework that mounts it checks origins itself
        # (the Django mount: Django's CSRF check, with its trusted origins).
        self.check_origin = check_origin
        if secret_key is None:
            self.secret = os.urandom(32)
        else:
            self.secret = secret_key.encode() if isinstance(secret_key, str) else secret_key
            if not self.secret:
                # Anyone could sign tokens for a cookie they planted.
                raise ConfigurationError(
                    "The dashboard's secret_key is empty: give a long random one, "
                    "or None for a new key per process."
                )
        self._store: Store | None = None
        self._closed = False
        self._lock = threading.Lock()
        self.env = Environment(
            loader=PackageLoader("celery_zdelay.web", "templates"),
            autoescape=True,
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.env.filters.update(
            count=count,
            duration=duration,
            utc=utc,
            clip=_clip,
            breakable=_breakable,
            release_path=_release_path,
        )
        self.env.globals.update(relative_due=relative_due, ago=ago)
        self.urls = Map(
            [
                Rule("/", endpoint="overview", methods=["GET"]),
                Rule("/overview.part", endpoint="overview_part", methods=["GET"]),
                Rule("/parked", endpoint="parked", methods=["GET"]),
                Rule("/entry", endpoint="entry", methods=["GET"]),
                Rule("/dead", endpoint="dead", methods=["GET"]),
                Rule("/periodic", endpoint="periodic", methods=["GET"]),
                Rule("/control", endpoint="control", methods=["GET"]),
                Rule("/actions/parked", endpoint="act_parked", methods=["POST"]),
                Rule("/actions/dead", endpoint="act_dead", methods=["POST"]),
                Rule("/actions/periodic", endpoint="act_periodic", methods=["POST"]),
                Rule("/actions/control", endpoint="act_control", methods=["POST"]),
                Rule("/static/<name>", endpoint="static", methods=["GET"]),
            ],
            strict_slashes=False,
        )

    @property
    def store(self) -> Store:
        """The store, opened on first use and shared by every request thread.

        Opened anew when the app's ``zdelay_*`` settings were set anew, so
        the dashboard always reads the store the app parks in.
        """
        config = get_config(self.celery_app)
        with self._lock:
            if self._closed:
                # A request thread outliving its server must not open a store
                # that nothing would close.
                raise ConfigurationError("The dashboard was closed: build a new one.")
            if self._store is not None and self._store.config is not config:
                self._store.close()
                self._store = None
            if self._store is None:
                self._store = Store(config)
            return self._store

    def close(self) -> None:
        """Close the store's connections; the dashboard answers 503 from then on."""
        with self._lock:
            self._closed = True
            if self._store is not None:
                self._store.close()
                self._store = None

    # -- WSGI -------------------------------------------------------------------

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        request = Request(environ)
        response = self.handle(request)
        return response(environ, start_response)

    def handle(self, request: Request) -> Response:
        if not host_allowed(request.host, self.allowed_hosts):
            # Before anything is read or a cookie set: a rebound name must
            # get neither a page nor a token.
            return self._refuse_host(request)
        started = time.perf_counter()
        timer = _Timer(lambda: get_config(self.celery_app).redis_url)
        adapter = self.urls.bind_to_environ(request.environ)
        cookie = request.cookies.get(CSRF_COOKIE)
        fresh_cookie = None if cookie else new_csrf_cookie()
        context = _Context(self, request, timer, cookie or fresh_cookie or "")
        try:
            endpoint, values = adapter.match()
            view = getattr(self, f"view_{endpoint}")
            response: Response = view(context, **values)
        except HTTPException as exc:
            response = self._error(context, exc)
        except ZDelayError as exc:
            response = self._render(context, "error.html", status=503, error=str(exc))
        if fresh_cookie:
            response.set_cookie(
                CSRF_COOKIE,
                fresh_cookie,
                path=request.script_root + "/",
                httponly=True,
                samesite="Strict",
                secure=request.scheme == "https",
            )
        total_ms = (time.perf_counter() - started) * 1000
        response.headers["Server-Timing"] = f"store;dur={timer.ms:.2f}, total;dur={total_ms:.2f}"
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "same-origin"
        response.headers["X-Frame-Options"] = "DENY"
        response.headers.setdefault(
            "Content-Security-Policy",
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
            "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        )
        response.headers.setdefault("Cache-Control", "no-store")
        return response

    # -- pages -------------------------------------------------------------------

    def view_overview(self, ctx: _Context) -> Response:
        return self._render(ctx, "overview.html", **self._overview(ctx))

    def view_overview_part(self, ctx: _Context) -> Response:
        return self._render(ctx, "_overview_body.html", **self._overview(ctx))

    def _overview(self, ctx: _Context) -> dict[str, Any]:
        span = ctx.request.args.get("span", "day")
        if span not in (*queries.TIMELINE_SPANS, "all"):
            span = "day"
        with ctx.timer():
            store = self.store
            counts = admin.counts(store)
            companions = admin.companions(store, now_ms=counts.now_ms)
            line = queries.timeline(store, span)
            # Held tasks are not in the due sets the counts read: said apart.
            held = limits.controls(app=self.celery_app)
        return {
            "counts": counts,
            "held": sum(c.waiting for c in held),
            "paused": sum(c.paused_since_ms is not None for c in held),
            "limited": sum(c.limit is not None for c in held),
            "companions": companions,
            "timeline": line,
            "span": span,
            "spans": [*queries.TIMELINE_SPANS, "all"],
            "chart": _chart(line),
            "now_ms": counts.now_ms,
        }

    def view_parked(self, ctx: _Context) -> Response:
        filters, problems = _filters(ctx.request.args, self.store.time_ms)
        raw_cursor = ctx.request.args.get("cursor", "")
        cursor = queries.Cursor.decode(raw_cursor) if raw_cursor else None
        if raw_cursor and cursor is None:
            raise BadRequest(
                f"cursor={raw_cursor[:40]!r} is not a place in the listing: follow the "
                "page's 'next page' link, or drop cursor= to start from the first page."
            )
        with ctx.timer():
            page = queries.parked_page(self.store, filters, after=cursor, limit=PAGE_SIZE)
            # Above the first page, as the counts call them overdue once due.
            flying = [] if cursor else queries.in_flight(self.store, filters)
            tagged = tag_count(self.store, filters.tag) if filters.tag else None
        query = _filter_query(ctx.request.args)
        next_url = None
        if page.next is not None:
            next_url = "parked?" + urlencode({**query, "cursor": page.next.encode()})
        return self._render(
            ctx,
            "parked.html",
            page=page,
            in_flight=flying,
            tagged=tagged,
            filters=filters,
            form=ctx.request.args,
            problems=problems,
            next_url=next_url,
            first_url="parked?" + urlencode(query) if cursor else None,
            back="parked?" + urlencode({**query, **({"cursor": raw_cursor} if cursor else {})}),
            now_ms=page.now_ms,
            max_bulk=MAX_BULK,
        )

    def view_entry(self, ctx: _Context) -> Response:
        task_id = ctx.request.args.get("id", "")
        if not task_id:
            raise BadRequest("Give the task id: entry?id=...")
        try:
            validate_task_id(task_id, done="changed")
        except ConfigurationError as exc:
            raise BadRequest(str(exc)) from None
        with ctx.timer():
            detail = queries.entry_detail(self.store, task_id)
            # A task that is gone answers with its history ("did it fire?").
            events = history_in(self.store, task_id)
            now_ms = self.store.time_ms()
        status = 200 if detail is not None or events else 404
        return self._render(
            ctx,
            "entry.html",
            status=status,
            task_id=task_id,
            entry=detail,
            history=[_history_row(event) for event in events],
            history_ms=self.store.config.history_ms,
            now_ms=now_ms,
            back="entry?" + urlencode({"id": task_id}),
        )

    def view_dead(self, ctx: _Context) -> Response:
        with ctx.timer():
            listing = queries.dead_page(self.store, limit=100)
            total = admin.counts(self.store).dead
        return self._render(
            ctx, "dead.html", listing=listing, total=total, now_ms=listing.now_ms, back="dead"
        )

    def view_periodic(self, ctx: _Context) -> Response:
        from .. import periodic

        with ctx.timer():
            now_ms, schedules = periodic.schedules(self.celery_app)
            unserved = sorted(periodic.unserved(self.celery_app).items())
        return self._render(
            ctx,
            "periodic.html",
            schedules=schedules,
            unserved=unserved,
            now_ms=now_ms,
            back="periodic",
        )

    def view_control(self, ctx: _Context) -> Response:
        with ctx.timer():
            found = limits.controls(app=self.celery_app)
            now_ms = self.store.time_ms()
        return self._render(
            ctx,
            "control.html",
            controls=found,
            names=_control_names(self.celery_app),
            now_ms=now_ms,
            back="control",
        )

    def view_static(self, ctx: _Context, name: str) -> Response:
        if name not in _STATIC:
            raise NotFound()
        data = resources.files("celery_zdelay.web").joinpath("static").joinpath(name).read_bytes()
        response = Response(data, mimetype=_STATIC[name])
        response.headers["Cache-Control"] = "public, max-age=300"
        return response

    # -- actions -----------------------------------------------------------------

    def view_act_parked(self, ctx: _Context) -> Response:
        form = self._checked_form(ctx)
        op = form.get("op", "")
        if op not in ("cancel", "run", "reschedule"):
            raise BadRequest(f"Unknown action {op!r}: use cancel, run or reschedule.")
        due = Due("r", 0)
        if op == "reschedule":
            try:
                due = _due_from_form(form)
            except ConfigurationError as exc:
                return self._back(ctx, form, f"Not rescheduled: {exc}")
        verb = {"cancel": "cancelled", "run": "released now", "reschedule": "rescheduled"}[op]
        with ctx.timer():
            # Every id is chosen before the first is changed: the action
            # applies to what matched when the operator confirmed it, never
            # to an entry it moved itself (a new time that still matches).
            ids = self._targets(form)
            if ids is None:
                return self._back(
                    ctx,
                    form,
                    f"Nothing {verb}: more than {count(MAX_BULK)} entries match, more than "
                    "one action changes. Narrow the filter (a due window, a task name), "
                    "or use the command line, which takes every match: celery -A proj "
                    f"zdelay {'cancel' if op == 'cancel' else 'reschedule'} --help",
                )
            # Through the steering module, as the CLI and the Python API: the
            # audit line, tasks_cancelled (REVOKED, Celery events) and who acted.
            by = _who(ctx)
            if op == "cancel":
                done = sum(steering.cancel_ids(ids, app=self.celery_app, by=by))
            else:
                done = sum(steering.reschedule_ids(ids, due, app=self.celery_app, by=by))
        message = f"{verb} {done} of {len(ids)}"
        if len(ids) > done:
            message += " (the others were no longer parked)"
        return self._back(ctx, form, message)

    def view_act_dead(self, ctx: _Context) -> Response:
        form = self._checked_form(ctx)
        op = form.get("op", "")
        if op not in ("requeue", "purge"):
            raise BadRequest(f"Unknown action {op!r}: use requeue or purge.")
        everything = form.get("scope") == "all"
        ids = _form_ids(form)
        app, by = self.celery_app, _who(ctx)
        # Through the steering module, as the CLI: the same audit line.
        with ctx.timer():
            if op == "requeue" and everything:
                done, left = steering.requeue_all_dead(app=app, by=by)
                message = f"requeued {done}, due now" + (f"; {left} could not be" if left else "")
            elif op == "requeue":
                done = sum(steering.requeue_dead(ids, app=app, by=by))
                message = f"requeued {done} of {len(ids)}, due now"
            elif everything:
                message = f"purged {steering.purge_dead(app=app, by=by)}"
            else:
                message = f"purged {steering.purge_dead(ids, app=app, by=by)} of {len(ids)}"
        return self._back(ctx, form, message)

    def view_act_periodic(self, ctx: _Context) -> Response:
        from .. import periodic

        form = self._checked_form(ctx)
        op, name = form.get("op", ""), form.get("name", "")
        with ctx.timer():
            if op == "pause":
                done = periodic.pause(name, app=self.celery_app)
                message = f"paused {name}" if done else f"no schedule is named {name}"
            elif op == "resume":
                done = periodic.resume(name, app=self.celery_app)
                message = f"resumed {name}" if done else f"no schedule is named {name}"
            elif op == "run":
                try:
                    task_id = periodic.run_now(name, app=self.celery_app)
                except ConfigurationError as exc:
                    message = str(exc)
                else:
                    message = f"{name} runs now as {task_id}"
            else:
                raise BadRequest(f"Unknown action {op!r}: use pause, resume or run.")
        return self._back(ctx, form, message)

    def view_act_control(self, ctx: _Context) -> Response:
        form = self._checked_form(ctx)
        op, name = form.get("op", ""), (form.get("name") or "").strip()
        if op not in _CONTROL_OPS:
            raise BadRequest(f"Unknown action {op!r}: use {', '.join(_CONTROL_OPS)}.")
        by = _who(ctx)
        # Through the public functions the CLI calls: the same checks, the
        # same wake-up of every companion, the same audit line.
        with ctx.timer(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", limits.UnknownControlWarning)
            try:
                if op == "limit":
                    new = limits.set_rate_limit(
                        name,
                        _rate_from_form(form),
                        burst=_burst_from_form(form),
                        app=self.celery_app,
                        by=by,
                    )
                    message = f"{name}: " + (
                        f"limit {new.text} (burst {new.burst})" if new else "no rate limit"
                    )
                elif op == "unlimit":
                    limits.set_rate_limit(name, None, app=self.celery_app, by=by)
                    message = f"{name}: no rate limit"
                elif op == "concurrency":
                    most = limits.set_concurrency(
                        name, _most_from_form(form), app=self.celery_app, by=by
                    )
                    message = f"{name}: concurrency {most}"
                elif op == "unconcurrency":
                    limits.set_concurrency(name, None, app=self.celery_app, by=by)
                    message = f"{name}: no concurrency control"
                elif op == "pause":
                    since = limits.pause(name, app=self.celery_app, by=by)
                    message = f"paused {name} (since {utc(since)})"
                else:
                    was = limits.resume(name, app=self.celery_app, by=by)
                    message = f"resumed {name}" if was else f"{name} was not paused"
            except ConfigurationError as exc:
                raise BadRequest(
                    f"Nothing was changed: {exc} Go back, correct the form and send it again."
                ) from exc
        for warning in caught:
            if issubclass(warning.category, limits.UnknownControlWarning):
                message += f". Warning: {warning.message}"
        return self._back(ctx, form, message)

    def _checked_form(self, ctx: _Context) -> Any:
        if not self.actions:
            raise Forbidden(
                "This dashboard is read-only. Build it with create_app(app, actions=True) "
                "or run: celery -A proj zdelay web --actions"
            )
        request = ctx.request
        foreign = self.check_origin and foreign_origin(
            request.host,
            request.headers.get("Origin"),
            request.headers.get("Referer"),
            self.trusted_origins,
        )
        if foreign:
            raise Forbidden(
                f"This action came from {foreign[:100]!r}, not from the dashboard's own "
                "pages: nothing was changed. If a reverse proxy serves the dashboard under "
                "another origin, add it to trusted_origins (--trusted-origin)."
            )
        form = request.form
        cookie = request.cookies.get(CSRF_COOKIE)
        if not valid_csrf(self.secret, cookie, form.get(CSRF_FIELD)):
            raise Forbidden(
                "The form's CSRF token is missing or wrong: nothing was changed. "
                "Reload the page and try again."
            )
        return form

    def _targets(self, form: Any) -> list[str] | None:
        """Return every id an action applies to, or None when more than MAX_BULK match."""
        if form.get("scope") != "filter":
            ids = _form_ids(form)
            return ids if len(ids) <= MAX_BULK else None
        filters, problems = _filters(form, self.store.time_ms)
        if problems:
            raise BadRequest("; ".join(problems))
        found: list[str] = []
        cursor = None
        while len(found) <= MAX_BULK:
            page = queries.parked_page(self.store, filters, after=cursor, limit=1000)
            found += [entry.task_id for entry in page.entries]
            if page.next is None:
                return found if len(found) <= MAX_BULK else None
            cursor = page.next
        return None

    # -- helpers -----------------------------------------------------------------

    def _back(self, ctx: _Context, form: Any, message: str) -> Response:
        back = form.get("back", "")
        if not _BACK.match(back):
            back = ""
        if back.startswith("entry") and form.get("op") in ("cancel", "purge"):
            # The entry is gone: its page would greet a success with a red
            # "Not found". Back to the listing it was in, with the id said.
            back = "dead" if form.get("op") == "purge" else "parked"
            ids = queries.as_ids(form.getlist("ids"))
            if len(ids) == 1:
                message = f"{message}: {ids[0][:200]}"
        separator = "&" if "?" in back else "?"
        target = f"{ctx.request.script_root}/{back}{separator}{urlencode({'msg': message})}"
        return Response(status=303, headers={"Location": target})

    def _render(
        self, ctx: _Context, template: str, *, status: int = 200, **values: Any
    ) -> Response:
        html = self.env.get_template(template).render(
            title=self.title,
            root=ctx.request.script_root,
            actions=self.actions,
            csrf_field=CSRF_FIELD,
            csrf=csrf_token(self.secret, ctx.cookie),
            message=ctx.request.args.get("msg"),
            form_fields=ctx.request.environ.get(FORM_FIELDS_KEY, ()),
            home=ctx.request.environ.get(HOME_KEY),
            **values,
        )
        return Response(html, status=status, mimetype="text/html")

    def _refuse_host(self, request: Request) -> Response:
        name = host_name(request.host)[:100]
        text = (
            f"400 Bad Request: this dashboard does not serve the host {name!r}. If that is "
            "the name you reach it by, add it: create_app(app, allowed_hosts=[...]) or "
            "celery -A proj zdelay web --allowed-host NAME.\n"
        )
        response = Response(text, status=400, mimetype="text/plain")
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Cache-Control"] = "no-store"
        return response

    def _error(self, ctx: _Context, exc: HTTPException) -> Response:
        return self._render(
            ctx, "error.html", status=exc.code or 500, error=exc.description or exc.name
        )


class _Timer:
    """Adds up the time spent on the store during one request: Redis round trips,
    and reading entries' headers. Sent as ``Server-Timing: store;dur=...``."""

    def __init__(self, url: Callable[[], str]) -> None:
        self.ms = 0.0
        self._url = url

    @contextmanager
    def __call__(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            # Connection failures become StoreUnavailableError: a 503 page that
            # names the store (password hidden) and says what to check.
            with store_errors(self._url()):
                yield
        finally:
            self.ms += (time.perf_counter() - started) * 1000


def _who(ctx: _Context) -> str:
    """Who acts from the dashboard: ``dashboard:<user>`` when authentication named one."""
    user = ctx.request.environ.get("REMOTE_USER")
    return f"dashboard:{user}" if user else "dashboard"


class _Context:
    def __init__(self, dashboard: Dashboard, request: Request, timer: _Timer, cookie: str) -> None:
        self.dashboard = dashboard
        self.request = request
        self.timer = timer
        self.cookie = cookie


def _filters(args: Any, now_ms: Callable[[], int]) -> tuple[queries.Filters, list[str]]:
    """Read the listing's filter fields; return them and what could not be read.

    A duration (15m, -1h) counts from *now_ms*, the Redis clock due times
    are read on, as the CLI's filters do: a web host whose clock is off must
    not shift what "overdue" or "due in the next hour" selects.
    """
    problems = []
    bounds: list[int | None] = []
    for name in ("due_after", "due_before"):
        text = (args.get(name) or "").strip()
        if not text:
            bounds.append(None)
            continue
        try:
            bounds.append(_when_ms(text, now_ms))
        except ConfigurationError as exc:
            problems.append(
                f"{name}: use a duration from now (15m, -1h, 2d) or an ISO 8601 time, "
                f"got {text[:60]!r} ({exc})"
            )
            bounds.append(None)
    tag = (args.get("tag") or "").strip()
    if tag:
        try:
            validate_tag(tag)
        except ConfigurationError as exc:
            problems.append(f"tag: {exc}".replace(" Nothing was written.", ""))
            tag = ""
    return (
        queries.Filters(
            task=(args.get("task") or "").strip(),
            queue=(args.get("queue") or "").strip(),
            id_prefix=(args.get("id") or "").strip(),
            due_after_ms=bounds[0],
            due_before_ms=bounds[1],
            tag=tag,
        ),
        problems,
    )


def _form_ids(form: Any) -> list[str]:
    """Return the ids an action names, each checked as an id (:mod:`celery_zdelay.names`).

    Raises:
        BadRequest: one breaks the rule; nothing was changed.
    """
    ids = queries.as_ids(form.getlist("ids"))
    try:
        return [validate_task_id(task_id, done="changed") for task_id in ids]
    except ConfigurationError as exc:
        raise BadRequest(str(exc)) from None


def _filter_query(args: Any) -> dict[str, str]:
    names = ("task", "queue", "id", "tag", "due_after", "due_before")
    return {name: args.get(name) for name in names if args.get(name)}


def _when_ms(text: str, now_ms: Callable[[], int]) -> int:
    due = parse_when(text)
    return now_ms() + due.ms if due.mode == "r" else due.ms


#: The operations of the control page's forms.
_CONTROL_OPS = ("limit", "unlimit", "concurrency", "unconcurrency", "pause", "resume")


def _rate_from_form(form: Any) -> str:
    rate = (form.get("rate") or "").strip()
    if not rate:
        raise ConfigurationError(
            "give a rate in Celery's format, such as 50/s, 10/m or 1000/h "
            "(to remove a limit, use its Remove button)."
        )
    return rate


def _burst_from_form(form: Any) -> int | None:
    if not (form.get("burst") or "").strip():
        return None
    return _tasks_from_form(form, "burst", "leave it empty for one second's worth of the rate")


def _most_from_form(form: Any) -> int:
    return _tasks_from_form(
        form, "most", "to remove a control, use its Remove concurrency button", what="concurrency"
    )


def _tasks_from_form(form: Any, field: str, hint: str, *, what: str | None = None) -> int:
    """The whole number of tasks (at least 1) in *field*; else an error that says *hint*."""
    text = (form.get(field) or "").strip()
    if not text.isascii() or not text.isdigit() or len(text) > 12 or int(text) < 1:
        raise ConfigurationError(
            f"the {what or field} must be a whole number of tasks of at least 1, "
            f"got {text[:40]!r} ({hint})."
        )
    return int(text)


def _control_names(celery_app: Celery) -> list[str]:
    """The control names the app knows, offered as the control form's suggestions."""
    queues = {*celery_app.amqp.queues, celery_app.conf.task_default_queue}
    tasks = {name for name in celery_app.tasks if not name.startswith("celery.")}
    return [f"queue:{q}" for q in sorted(queues)] + [f"task:{t}" for t in sorted(tasks)]


def _due_from_form(form: Any) -> Due:
    delay = (form.get("delay") or "").strip()
    eta = (form.get("eta") or "").strip()
    if bool(delay) == bool(eta):
        raise ConfigurationError("give either a delay (such as 15m) or a date, not both")
    if delay:
        due = parse_delay(delay)
        if due is None:
            raise ConfigurationError(f"{delay[:60]!r} is not a delay: use 30s, 15m, 1h30m or 2d")
        return due
    return due_from(eta=eta)


def _release_path(handoff: str) -> tuple[str, str]:
    """Say how a companion releases, from its heartbeat's ``handoff`` field, as (path, why).

    "off (the broker is amqp, not Redis)" read as a fault; it is the normal
    path for every broker but a Redis one on the store's server.
    """
    text = handoff.strip()
    if text.startswith("on"):
        return "atomic handoff", "one Redis script, exactly once"
    if text.startswith("off"):
        why = text[3:].strip().removeprefix("(").removesuffix(")")
        return "publish to the broker", f"{why}: no atomic handoff" if why else ""
    return text, ""


def _history_row(event: HistoryEvent) -> dict[str, Any]:
    """One row of an entry's history table."""
    at_ms = round(event.at.timestamp() * 1000)
    return {
        "event": event.event,
        "at_ms": at_ms,
        "at": event.at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at_ms % 1000:03d}Z",
        "detail": describe(event),
    }


def _clip(value: Any, limit: int = CLIP) -> str:
    text = "" if value is None else str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


#: Where a long name or id may break across lines: after ``_ . : /`` before
#: a letter (``Send_daily_report``, ``proj.tasks.report``, ``periodic:name:v1:``),
#: never inside a time or a number (``…:v1:2026-07-01T03:00:00.000Z``).
_BREAK_AFTER = re.compile(r"(?<=[_.:/])(?=[^\W\d_])")


#: Names up to this long stay whole: a column holds them (what the browser tests check).
_WHOLE = 24


def _breakable(value: Any, limit: int = CLIP) -> Markup:
    """*value* clipped and escaped, with ``<wbr>`` where a long name or id may break.

    A long name without spaces (a schedule's, a dotted task's) then wraps
    between its parts in a narrow column instead of mid-word; a short one is
    left as it is.
    """
    text = _clip(value, limit)
    if len(text) <= _WHOLE:
        return escape(text)
    return Markup("<wbr>").join(_BREAK_AFTER.split(text))


def _chart(line: queries.Timeline) -> dict[str, Any]:
    """Lay the timeline's bars out for the server-rendered SVG chart."""
    width, height, gap = 720, 160, 2
    bars = line.bars
    peak = max(line.peak, 1)
    step = width / max(len(bars), 1)
    laid = []
    for index, bar in enumerate(bars):
        h = 0 if bar.count == 0 else max(round(bar.count / peak * height), 2)
        laid.append(
            {
                "x": round(index * step + gap / 2, 1),
                "y": height - h,
                "w": round(max(step - gap, 1), 1),
                "h": h,
                "bar": bar,
                "overdue": bar.start_ms is None,
            }
        )
    # About six labelled ticks, as offsets from now ("+6h"), under bar edges.
    every = max(len(bars) // 6, 1)
    ticks = [
        {"x": round(index * step, 1), "label": "+" + duration(bar.start_ms - line.now_ms)}
        for index, bar in enumerate(bars)
        if bar.start_ms is not None and index > 1 and (index - 1) % every == 0
    ]
    return {"width": width, "height": height, "bars": laid, "peak": line.peak, "ticks": ticks}
