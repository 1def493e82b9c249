"""``celery -A proj zdelay``: run the companion, and inspect or steer the store.

The command only parses options and wires the pieces together; the work is
done by :mod:`celery_zdelay.companion`, :mod:`celery_zdelay.store.admin` and
:mod:`celery_zdelay.metrics`, and the printing by :mod:`celery_zdelay._views`.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

import click
from celery.bin.base import LOG_LEVEL, CeleryCommand, CeleryOption, handle_preload_options

from . import _views, control
from ._format import count, counted, duration, parse_duration_ms, relative_due, utc
from ._logjson import JsonFormatter
from .config import get_config
from .errors import ConfigurationError, StoreUnavailableError
from .parking import store_for
from .periodic.views import schedule_json, schedule_lines, store_schedules
from .schedule import Due, due_from
from .store import Store, admin
from .web.cli import web

__all__ = [
    "EXIT_CHECK_FAILED",
    "EXIT_CONFIG",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "zdelay",
]

#: Clean exit, including after SIGTERM/SIGINT.
EXIT_OK = 0
#: A check failed (``status --check``), or a confirmation was declined.
EXIT_CHECK_FAILED = 1
#: The command line is wrong (click's own code for usage errors).
EXIT_USAGE = 2
#: An id given to ``cancel``, ``reschedule`` or ``dead requeue|purge`` was not found.
EXIT_NOT_FOUND = 3
#: The store (Redis) could not be reached (sysexits EX_UNAVAILABLE).
EXIT_UNAVAILABLE = 69
#: A setting or option is invalid (sysexits EX_CONFIG).
EXIT_CONFIG = 78

#: ``status --check`` fails when an entry is overdue by more than this (seconds).
DEFAULT_MAX_OVERDUE_S = 60.0

logger = logging.getLogger(__name__)

_LOG_FORMAT = "[%(asctime)s: %(levelname)s/%(name)s] %(message)s"

_EPILOG = """\b
Examples:
  celery -A proj zdelay                      run the companion
  celery -A proj zdelay -l DEBUG             ... logging every batch
  celery -A proj zdelay --shards 0,1         ... releasing shards 0 and 1 only
  celery -A proj zdelay --metrics-port 9808  ... serving Prometheus metrics
  celery -A proj zdelay --log-format json    ... logging JSON lines
  celery -A proj zdelay --beat               ... serving beat_schedule too
  celery -A proj zdelay status               what is parked, late, in flight, dead
  celery -A proj zdelay list --limit 20      the next 20 entries due
  celery -A proj zdelay dead list            what could not be published, and why
"""

_STATUS_EPILOG = """\b
Examples:
  celery -A proj zdelay status
  celery -A proj zdelay status --per-shard
  celery -A proj zdelay status --json | jq .overdue
  celery -A proj zdelay status --check --max-overdue 120   # Kubernetes probe

\b
Exit codes: 0 ok; 1 --check failed; 69 Redis unreachable; 78 bad setting.
"""

_LIST_EPILOG = """\b
Examples:
  celery -A proj zdelay list
  celery -A proj zdelay list --task proj.orders.cancel_unpaid --limit 20
  celery -A proj zdelay list --task 'proj.orders.*' --due-before 1h
  celery -A proj zdelay list --due-before now              # overdue entries
  celery -A proj zdelay list --due-after 2025-06-01T00:00:00Z --json

\b
WHEN is "now", a duration from now (30s, 15m, 1h30m, -10m, 2d) or an ISO 8601
time (naive times are UTC). Entries due in [--due-after, --due-before) match.
"""

_CANCEL_EPILOG = """\b
Examples:
  celery -A proj zdelay cancel 6f1c2a3e-8d4b-4a51-9b7e-2f9d0c1a7e55
  celery -A proj zdelay cancel --task proj.reminders.send --due-before 1h --dry-run
  celery -A proj zdelay cancel --task proj.reminders.send --due-before 1h
  celery -A proj zdelay cancel --queue orders

\b
Exit codes: 0 all cancelled (with filters: always, with the count); 3 some
id was not parked (unknown, released, or being released right now).
"""

_RESCHEDULE_EPILOG = """\b
Examples:
  celery -A proj zdelay reschedule 6f1c2a3e-8d4b-4a51-9b7e-2f9d0c1a7e55 --countdown 600
  celery -A proj zdelay reschedule 6f1c2a3e-8d4b-4a51-9b7e-2f9d0c1a7e55 --countdown 5m
  celery -A proj zdelay reschedule 6f1c2a3e-8d4b-4a51-9b7e-2f9d0c1a7e55 --countdown 0
  celery -A proj zdelay reschedule --task proj.reminders.send --countdown 2h --dry-run
  celery -A proj zdelay reschedule 6f1c2a3e-8d4b-4a51-9b7e-2f9d0c1a7e55 \\
      --eta 2025-06-01T09:00:00+02:00

\b
Exit codes: 0 rescheduled (with filters: always, with the count); 3 the id
is not parked.
"""

_DEAD_EPILOG = """\b
Examples:
  celery -A proj zdelay dead list
  celery -A proj zdelay dead requeue 6f1c2a3e-8d4b-4a51-9b7e-2f9d0c1a7e55
  celery -A proj zdelay dead requeue --all
  celery -A proj zdelay dead purge --yes
"""

_DEAD_LIST_EPILOG = """\b
Examples:
  celery -A proj zdelay dead list
  celery -A proj zdelay dead list --limit 10
  celery -A proj zdelay dead list --json | jq -r '.entries[] | "\\(.id) \\(.reason)"'
"""

_DEAD_REQUEUE_EPILOG = """\b
Examples:
  celery -A proj zdelay dead requeue 6f1c2a3e-8d4b-4a51-9b7e-2f9d0c1a7e55
  celery -A proj zdelay dead requeue --all

\b
Requeued entries are due at once, with the message they were parked with.
Exit codes: 0 all requeued; 3 some id was not dead-lettered, had no message,
or was parked again meanwhile.
"""

_DEAD_PURGE_EPILOG = """\b
Examples:
  celery -A proj zdelay dead purge 6f1c2a3e-8d4b-4a51-9b7e-2f9d0c1a7e55
  celery -A proj zdelay dead purge            # all of them, after a question
  celery -A proj zdelay dead purge --yes      # all of them, no question

\b
Exit codes: 0 purged; 1 you answered no; 3 some id was not dead-lettered.
"""

_CONTEXT = {"max_content_width": 100}

F = TypeVar("F", bound=Callable[..., Any])


def _format_options(
    command: click.Command, ctx: click.Context, formatter: click.HelpFormatter
) -> None:
    """Write the options under their help groups, as Celery's own commands do.

    Arguments are left out: they are named in the usage line, and newer
    click versions would list them under "Options" with no text.
    """
    sections: dict[str, list[tuple[str, str]]] = {}
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
        if record is not None:
            group = getattr(param, "help_group", None) or "Options"
            sections.setdefault(str(group), []).append(record)
    for name, records in sections.items():
        with formatter.section(name):
            formatter.write_dl(records)


class ZDelayCommand(CeleryCommand):  # type: ignore[misc]
    """A command laid out like Celery's own (option help groups)."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        _format_options(self, ctx, formatter)


class ZDelayGroup(CeleryCommand, click.Group):  # type: ignore[misc]
    """A click group laid out like Celery's own commands (option help groups)."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        _format_options(self, ctx, formatter)
        self.format_commands(ctx, formatter)


def _parse_when(ctx: click.Context, param: click.Parameter, value: str | None) -> Due | None:
    """Read ``now``, a duration from now (``15m``, ``-10s``) or an ISO 8601 time."""
    if value is None:
        return None
    text = value.strip()
    if text.lower() == "now":
        return Due("r", 0)
    offset = parse_duration_ms(text)
    if offset is not None:
        return Due("r", offset)
    try:
        return due_from(eta=text)
    except ConfigurationError:
        raise click.BadParameter(
            f"{value!r}: use now, a duration such as 30s, 15m, 1h30m or -10m, "
            "or an ISO 8601 time such as 2025-06-01T09:00:00Z"
        ) from None


def _parse_shards(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    if value is None:
        return None
    try:
        return sorted({int(part) for part in value.split(",") if part.strip()})
    except ValueError:
        raise click.BadParameter("use shard numbers separated by commas, e.g. 0,1,2") from None


def _json_option(what: str) -> Callable[[F], F]:
    return click.option(
        "--json",
        "as_json",
        is_flag=True,
        cls=CeleryOption,
        help_group="Output Options",
        help=f"Print {what} as one JSON document (fields: docs/cli.rst).",
    )


# -- the companion --------------------------------------------------------------


@click.group(
    cls=ZDelayGroup,
    invoke_without_command=True,
    epilog=_EPILOG,
    context_settings=_CONTEXT,
)
@click.option(
    "--shards",
    cls=CeleryOption,
    callback=_parse_shards,
    help_group="Companion Options",
    help="Shard numbers to release, separated by commas (default: all).",
)
@click.option(
    "-l",
    "--loglevel",
    cls=CeleryOption,
    default="INFO",
    type=LOG_LEVEL,
    help_group="Companion Options",
    help="Logging level.",
)
@click.option(
    "--log-format",
    cls=CeleryOption,
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help_group="Companion Options",
    help="json: one JSON object per line (time, level, logger, message, task_id...).",
)
@click.option(
    "--beat",
    is_flag=True,
    cls=CeleryOption,
    help_group="Companion Options",
    help="Also serve beat_schedule (periodic tasks), as zdelay_beat = True does; "
    "replaces celery beat (docs/beat.rst).",
)
@click.option(
    "--metrics-port",
    cls=CeleryOption,
    type=click.IntRange(0, 65535),
    help_group="Metrics Options",
    help="Serve Prometheus metrics on this port (0: any free port). "
    "Needs the prometheus extra of celery-zdelay.",
)
@click.option(
    "--metrics-addr",
    cls=CeleryOption,
    default="0.0.0.0",
    show_default=True,
    help_group="Metrics Options",
    help="Address the metrics server listens on.",
)
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def zdelay(
    ctx: click.Context,
    shards: list[int] | None,
    loglevel: Any,
    log_format: str,
    beat: bool,
    metrics_port: int | None,
    metrics_addr: str,
) -> None:
    """Release parked delayed tasks to the broker when they are due.

    Without a subcommand, runs the companion until SIGTERM or SIGINT, then
    finishes the batch in hand and exits 0. The subcommands inspect and
    steer what is parked.
    """
    if ctx.invoked_subcommand is not None:
        return
    app = ctx.obj.app
    # Our own loggers at the level asked for; libraries stay at WARNING. A
    # project that configured logging itself (in the module -A imports) keeps
    # its handlers: basicConfig does nothing once the root logger has one.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(_LOG_FORMAT)
    )
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    logging.getLogger("celery_zdelay").setLevel(loglevel)

    from .companion import Companion

    stopping = threading.Event()
    started: list[Companion] = []

    def request_stop(signum: int, frame: Any) -> None:
        stopping.set()
        for companion in started:
            companion.stop()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    with _exit_codes(ctx):
        created = _companion_once_the_store_answers(
            lambda: Companion(app, shards=shards, beat=beat or None), stopping
        )
        if created is None:
            ctx.exit(EXIT_OK)
        companion = created
        started.append(companion)
        if stopping.is_set():
            companion.stop()
        invalid = [s for s in companion.shards if s not in companion.store.shards]
        if invalid:
            raise ConfigurationError(
                f"--shards {','.join(map(str, invalid))}: zdelay_shards is "
                f"{companion.config.shards}, so shards run from 0 to {companion.config.shards - 1}."
            )
        metrics = None
        if metrics_port is not None:
            from .metrics import serve_metrics

            metrics = serve_metrics(companion, port=metrics_port, addr=metrics_addr)
        try:
            companion.run()
        finally:
            if metrics is not None:
                metrics.close()
    ctx.exit(EXIT_OK)


#: Longest pause between attempts to reach a store that is down at start (seconds).
MAX_START_PAUSE_S = 30.0


def _companion_once_the_store_answers(create: Callable[[], Any], stopping: threading.Event) -> Any:
    """Create the companion, waiting for the store if it is down; None if asked to stop.

    The companion keeps running through store outages, and one at start is
    no different: it says so, retries with backoff, and starts when the store
    answers, so a companion started before Redis (or during a failover) does
    not need its supervisor to restart it. A bad setting still fails at once.
    """
    pause = 1.0
    failed = False
    while not stopping.is_set():
        try:
            companion = create()
        except StoreUnavailableError as exc:
            failed = True
            logger.error(
                "%s The companion starts when the store answers; next try in %g s.", exc, pause
            )
            stopping.wait(pause)
            pause = min(pause * 2, MAX_START_PAUSE_S)
            continue
        if failed:
            logger.info("The store answers again: starting the companion.")
        return companion
    return None


# -- status ---------------------------------------------------------------------


@zdelay.command(cls=ZDelayCommand, epilog=_STATUS_EPILOG, context_settings=_CONTEXT)
@_json_option("the status")
@click.option(
    "--per-shard",
    "--shards",
    "per_shard",
    is_flag=True,
    cls=CeleryOption,
    help_group="Output Options",
    help="Also show the counts of each shard.",
)
@click.option(
    "--check",
    is_flag=True,
    cls=CeleryOption,
    help_group="Check Options",
    help="Print OK or FAIL and exit 1 when no companion is alive, a shard has none, "
    "entries sit on shards beyond zdelay_shards, or an entry is overdue by more than "
    "--max-overdue.",
)
@click.option(
    "--max-overdue",
    type=click.FloatRange(0),
    default=DEFAULT_MAX_OVERDUE_S,
    show_default=True,
    metavar="SECONDS",
    cls=CeleryOption,
    help_group="Check Options",
    help="Oldest overdue entry --check accepts.",
)
@click.pass_context
def status(
    ctx: click.Context, as_json: bool, per_shard: bool, check: bool, max_overdue: float
) -> None:
    """Show what is parked, overdue, in flight and dead; live companions; Redis safety."""
    with _store(ctx) as store:
        current = admin.status(store)
        _, schedules = store_schedules(store)
    shards = len(current.counts.shards)
    max_overdue_ms = round(max_overdue * 1000)
    problems = admin.check(current, max_overdue_ms=max_overdue_ms) if check else None
    if as_json:
        document = _views.status_json(
            current, shards=shards, problems=problems, max_overdue_ms=max_overdue_ms
        )
        document["periodic"] = [schedule_json(info) for info in schedules]
        _echo_json(document)
    elif problems is not None:
        click.echo(_views.check_text(problems, current))
    else:
        click.echo(_views.status_text(current, shards=shards, per_shard=per_shard))
        if schedules:
            click.echo("\nPeriodic schedules:\n" + "\n".join(schedule_lines(schedules)))
    ctx.exit(EXIT_CHECK_FAILED if problems else EXIT_OK)


# -- list -----------------------------------------------------------------------


@zdelay.command("list", cls=ZDelayCommand, epilog=_LIST_EPILOG, context_settings=_CONTEXT)
@click.option(
    "--task",
    metavar="NAME",
    cls=CeleryOption,
    help_group="Filter Options",
    help="Only entries of this task: a name or a glob pattern such as 'proj.orders.*'.",
)
@click.option(
    "--due-before",
    metavar="WHEN",
    callback=_parse_when,
    cls=CeleryOption,
    help_group="Filter Options",
    help="Only entries due before WHEN.",
)
@click.option(
    "--due-after",
    metavar="WHEN",
    callback=_parse_when,
    cls=CeleryOption,
    help_group="Filter Options",
    help="Only entries due at or after WHEN.",
)
@click.option(
    "--limit",
    type=click.IntRange(1, admin.MAX_LIST_LIMIT),
    default=admin.DEFAULT_LIST_LIMIT,
    show_default=True,
    cls=CeleryOption,
    help_group="Output Options",
    help="Most entries to show.",
)
@_json_option("the entries")
@click.pass_context
def list_(
    ctx: click.Context,
    task: str | None,
    due_before: Due | None,
    due_after: Due | None,
    limit: int,
    as_json: bool,
) -> None:
    """List parked entries in due order: task, id, due time, queue, arguments.

    Arguments are Celery's argsrepr/kwargsrepr headers; message bodies are
    never decoded.
    """
    with _store(ctx) as store:
        now_ms = store.time_ms() if _relative(due_before, due_after) else 0
        listing = admin.list_parked(
            store,
            task=task,
            due_after_ms=_resolve(due_after, now_ms),
            due_before_ms=_resolve(due_before, now_ms),
            limit=limit,
        )
        show_shard = store.config.shards > 1
    if as_json:
        _echo_json(_views.listing_json(listing))
    else:
        click.echo(_views.listing_text(listing, show_shard=show_shard))


# -- cancel and reschedule ----------------------------------------------------------


def _filter_options(what: str) -> Callable[[F], F]:
    """The --task/--queue/--due-before/--due-after/--dry-run options of bulk commands."""

    def decorate(command: F) -> F:
        options = [
            click.option(
                "--task",
                metavar="NAME",
                cls=CeleryOption,
                help_group="Filter Options",
                help=f"{what} every parked task of this name or glob pattern ('proj.orders.*').",
            ),
            click.option(
                "--queue",
                metavar="NAME",
                cls=CeleryOption,
                help_group="Filter Options",
                help=f"{what} every parked task routed to this queue (name or glob pattern).",
            ),
            click.option(
                "--due-before",
                metavar="WHEN",
                callback=_parse_when,
                cls=CeleryOption,
                help_group="Filter Options",
                help="Only tasks due before WHEN (as for list).",
            ),
            click.option(
                "--due-after",
                metavar="WHEN",
                callback=_parse_when,
                cls=CeleryOption,
                help_group="Filter Options",
                help="Only tasks due at or after WHEN (as for list).",
            ),
            click.option(
                "--dry-run",
                is_flag=True,
                cls=CeleryOption,
                help_group="Filter Options",
                help="Only count the matching tasks; change nothing.",
            ),
        ]
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def _bulk_filters(
    task: str | None, queue: str | None, due_before: Due | None, due_after: Due | None
) -> dict[str, Any] | None:
    """Return the filters given on the command line as control keyword arguments, or None."""
    if task is None and queue is None and due_before is None and due_after is None:
        return None
    return {
        "task": task,
        "queue": queue,
        "due_before": _as_when(due_before),
        "due_after": _as_when(due_after),
    }


def _as_when(due: Due | None) -> Any:
    if due is None:
        return None
    if due.mode == "r":
        return timedelta(milliseconds=due.ms)
    return datetime.fromtimestamp(due.ms / 1000, tz=timezone.utc)


@zdelay.command(cls=ZDelayCommand, epilog=_CANCEL_EPILOG, context_settings=_CONTEXT)
@click.argument("task_ids", nargs=-1, metavar="[ID...]")
@_filter_options("Cancel")
@click.pass_context
def cancel(
    ctx: click.Context,
    task_ids: tuple[str, ...],
    task: str | None,
    queue: str | None,
    due_before: Due | None,
    due_after: Due | None,
    dry_run: bool,
) -> None:
    """Cancel parked tasks, by id or by filter, before they are released.

    An id may be that of a parked chain's or group's result: the whole
    parked canvas is cancelled.
    """
    filters = _bulk_filters(task, queue, due_before, due_after)
    if bool(task_ids) == (filters is not None):
        raise click.UsageError("Give the ids to cancel, or filters (--task, --queue, --due-*).")
    app = ctx.obj.app
    with _exit_codes(ctx):
        if filters is not None:
            n = control.cancel_matching(dry_run=dry_run, app=app, **filters)
            tasks = counted(n, "parked task", "parked tasks")
            click.echo(f"would cancel {tasks} (dry run)" if dry_run else f"cancelled {tasks}")
            ctx.exit(EXIT_OK)
        found = [control.cancel(task_id, app=app) for task_id in task_ids]
    for task_id, was_parked in zip(task_ids, found, strict=True):
        if was_parked:
            click.echo(f"cancelled   {task_id}")
        else:
            click.echo(f"not parked  {task_id} (unknown, released, or being released)")
    ctx.exit(EXIT_OK if all(found) else EXIT_NOT_FOUND)


def _parse_countdown(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    """Read seconds (``600``) or a duration as ``list --due-before`` takes it (``5m``, ``-10s``)."""
    if value is None:
        return None
    text = value.strip()
    offset = parse_duration_ms(text)
    if offset is not None:
        return offset / 1000
    try:
        return float(text)
    except ValueError:
        raise click.BadParameter(
            f"{value!r}: use seconds (600) or a duration such as 30s, 15m, 1h30m or -10m"
        ) from None


@zdelay.command(cls=ZDelayCommand, epilog=_RESCHEDULE_EPILOG, context_settings=_CONTEXT)
@click.argument("task_id", metavar="[ID]", required=False)
@click.option(
    "--countdown",
    metavar="DURATION",
    callback=_parse_countdown,
    cls=CeleryOption,
    help_group="When Options",
    help="Due this long from now: seconds (600) or a duration (30s, 5m, 1h30m).",
)
@click.option(
    "--eta",
    metavar="ISO",
    cls=CeleryOption,
    help_group="When Options",
    help="Due at this ISO 8601 time (naive times are UTC).",
)
@_filter_options("Reschedule")
@click.pass_context
def reschedule(
    ctx: click.Context,
    task_id: str | None,
    countdown: float | None,
    eta: str | None,
    task: str | None,
    queue: str | None,
    due_before: Due | None,
    due_after: Due | None,
    dry_run: bool,
) -> None:
    """Move parked tasks, by id or by filter, to a new due time."""
    if (countdown is None) == (eta is None):
        raise click.UsageError("Give exactly one of --countdown DURATION or --eta ISO.")
    filters = _bulk_filters(task, queue, due_before, due_after)
    if (task_id is None) == (filters is None):
        raise click.UsageError("Give the id to reschedule, or filters (--task, --queue, --due-*).")
    try:
        due_from(countdown=countdown, eta=eta)
    except ConfigurationError as exc:
        raise click.BadParameter(str(exc), param_hint="--countdown/--eta") from None
    app = ctx.obj.app
    with _exit_codes(ctx):
        if filters is not None:
            n = control.reschedule_matching(
                countdown=countdown, eta=eta, dry_run=dry_run, app=app, **filters
            )
            tasks = counted(n, "parked task", "parked tasks")
            click.echo(f"would reschedule {tasks} (dry run)" if dry_run else f"rescheduled {tasks}")
            ctx.exit(EXIT_OK)
        assert task_id is not None
        moved = control.reschedule(task_id, countdown=countdown, eta=eta, app=app)
        found = control.lookup(task_id, app=app) if moved else None
        now_ms = store_for(app).time_ms()
    if not moved:
        click.echo(f"not parked  {task_id} (unknown, released, or being released)")
        ctx.exit(EXIT_NOT_FOUND)
    if found is None or found.due_ms is None:
        click.echo(f"rescheduled {task_id}")
        ctx.exit(EXIT_OK)
    if found.due_ms < now_ms:
        click.echo(
            f"rescheduled {task_id}: due {utc(found.due_ms)}, "
            f"{duration(now_ms - found.due_ms)} ago: that is in the past, so it is released at once"
        )
    else:
        click.echo(
            f"rescheduled {task_id}: due {relative_due(found.due_ms, now_ms)} ({utc(found.due_ms)})"
        )


# -- dead letters -------------------------------------------------------------------


@zdelay.group(cls=ZDelayGroup, epilog=_DEAD_EPILOG, context_settings=_CONTEXT)
def dead() -> None:
    """Entries that could not be published: list, requeue or purge them."""


@dead.command("list", cls=ZDelayCommand, epilog=_DEAD_LIST_EPILOG, context_settings=_CONTEXT)
@click.option(
    "--limit",
    type=click.IntRange(1, admin.MAX_LIST_LIMIT),
    default=admin.DEFAULT_LIST_LIMIT,
    show_default=True,
    cls=CeleryOption,
    help_group="Output Options",
    help="Most entries to show.",
)
@_json_option("the entries")
@click.pass_context
def dead_list(ctx: click.Context, limit: int, as_json: bool) -> None:
    """List dead-lettered entries, most recent first, with the reason."""
    with _store(ctx) as store:
        listing = admin.list_dead(store, limit=limit)
        show_shard = store.config.shards > 1
    if as_json:
        _echo_json(_views.dead_json(listing))
    else:
        click.echo(_views.dead_text(listing, show_shard=show_shard))


@dead.command("requeue", cls=ZDelayCommand, epilog=_DEAD_REQUEUE_EPILOG, context_settings=_CONTEXT)
@click.argument("task_ids", nargs=-1, metavar="[ID...]")
@click.option(
    "--all",
    "requeue_all",
    is_flag=True,
    cls=CeleryOption,
    help_group="Requeue Options",
    help="Requeue every dead-lettered entry.",
)
@click.pass_context
def dead_requeue(ctx: click.Context, task_ids: tuple[str, ...], requeue_all: bool) -> None:
    """Park dead-lettered entries again, due now, with their original message."""
    if bool(task_ids) == requeue_all:
        raise click.UsageError("Give the ids to requeue, or --all.")
    with _store(ctx) as store:
        if requeue_all:
            requeued, left = admin.requeue_all_dead(store)
            click.echo(f"requeued {counted(requeued, 'entry', 'entries')}, due now")
            if left:
                click.echo(
                    f"left {counted(left, 'entry', 'entries')} dead-lettered: no message, "
                    "or the id was parked again (see: zdelay dead list)"
                )
            ctx.exit(EXIT_OK)
        flags = admin.requeue_dead(store, task_ids)
    for task_id, done in zip(task_ids, flags, strict=True):
        if done:
            click.echo(f"requeued      {task_id}, due now")
        else:
            click.echo(f"not requeued  {task_id} (not dead-lettered, no message, or parked again)")
    ctx.exit(EXIT_OK if all(flags) else EXIT_NOT_FOUND)


@dead.command("purge", cls=ZDelayCommand, epilog=_DEAD_PURGE_EPILOG, context_settings=_CONTEXT)
@click.argument("task_ids", nargs=-1, metavar="[ID...]")
@click.option(
    "-y",
    "--yes",
    is_flag=True,
    cls=CeleryOption,
    help_group="Purge Options",
    help="Purge everything without asking.",
)
@click.pass_context
def dead_purge(ctx: click.Context, task_ids: tuple[str, ...], yes: bool) -> None:
    """Delete dead-lettered entries for good: the given ids, or all of them."""
    with _store(ctx) as store:
        if task_ids:
            purged = admin.purge_dead(store, task_ids)
            click.echo(f"purged {count(purged)} of {counted(len(task_ids), 'entry', 'entries')}")
            ctx.exit(EXIT_OK if purged == len(set(task_ids)) else EXIT_NOT_FOUND)
        total = admin.counts(store).dead
        if total == 0:
            click.echo("No dead-lettered entries.")
            ctx.exit(EXIT_OK)
        question = f"Delete all {counted(total, 'dead-lettered entry', 'dead-lettered entries')}?"
        if not yes and not click.confirm(question):
            click.echo("Nothing purged.")
            ctx.exit(EXIT_CHECK_FAILED)
        purged = admin.purge_dead(store)
    click.echo(f"purged {counted(purged, 'entry', 'entries')}")


# The dashboard (celery_zdelay.web); its extra is imported only when it runs.
zdelay.add_command(web)


# -- helpers --------------------------------------------------------------------


@contextmanager
def _store(ctx: click.Context) -> Iterator[Store]:
    """Open the app's store for one command and close it after."""
    with _exit_codes(ctx):
        store = Store(get_config(ctx.obj.app))
        try:
            yield store
        finally:
            store.close()


def _relative(*whens: Due | None) -> bool:
    return any(w is not None and w.mode == "r" for w in whens)


def _resolve(when: Due | None, now_ms: int) -> int | None:
    if when is None:
        return None
    return now_ms + when.ms if when.mode == "r" else when.ms


def _echo_json(document: Any) -> None:
    click.echo(json.dumps(document, indent=2, sort_keys=False))


class _exit_codes:
    """Turn celery-zdelay errors into a message and a named exit code."""

    def __init__(self, ctx: click.Context) -> None:
        self.ctx = ctx

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if isinstance(exc, ConfigurationError):
            click.echo(f"Error: {exc}", err=True)
            self.ctx.exit(EXIT_CONFIG)
        if isinstance(exc, StoreUnavailableError):
            click.echo(f"Error: {exc}", err=True)
            self.ctx.exit(EXIT_UNAVAILABLE)


def _add_subcommand_groups() -> None:
    # Imported here: the group modules build on the helpers above.
    from .periodic.cli import periodic

    zdelay.add_command(periodic)


_add_subcommand_groups()
