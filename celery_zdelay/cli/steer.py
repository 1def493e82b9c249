"""``zdelay cancel`` and ``zdelay reschedule``: by id, or in bulk by filter."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import click
from celery.bin.base import CeleryOption

from .. import steering
from .._format import counted, duration, relative_due, utc
from ..app_state import store_for
from ..errors import ConfigurationError
from ..schedule import Due, due_from, parse_delay
from ._base import (
    CONTEXT_SETTINGS,
    EXIT_NOT_FOUND,
    EXIT_OK,
    F,
    ZDelayCommand,
    cli_user,
    exit_codes,
    parse_ids,
    when_option,
)
from .companion import zdelay

__all__ = ["cancel", "reschedule"]


_CANCEL_EPILOG = """\b
Examples:
  celery -A proj zdelay cancel 6f1c2a3e-8d4b-4a51-9b7e-2f9d0c1a7e55
  celery -A proj zdelay cancel --task proj.reminders.send --due-before 1h --dry-run
  celery -A proj zdelay cancel --task proj.reminders.send --due-before 1h
  celery -A proj zdelay cancel --queue orders
  celery -A proj zdelay cancel --tag order:42

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
  celery -A proj zdelay reschedule --tag tenant:7 --countdown 1h
  celery -A proj zdelay reschedule 6f1c2a3e-8d4b-4a51-9b7e-2f9d0c1a7e55 \\
      --eta 2025-06-01T09:00:00+02:00

\b
Exit codes: 0 rescheduled (with filters: always, with the count); 3 the id
is not parked.
"""


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
                "--tag",
                metavar="TAG",
                cls=CeleryOption,
                help_group="Filter Options",
                help=f"{what} every parked task tagged TAG (apply_delayed(tags=[...])).",
            ),
            when_option("--due-before", "Only tasks due before WHEN (as for list)."),
            when_option("--due-after", "Only tasks due at or after WHEN (as for list)."),
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
    task: str | None,
    queue: str | None,
    due_before: Due | None,
    due_after: Due | None,
    tag: str | None = None,
) -> dict[str, Any] | None:
    """Return the filters given on the command line as control keyword arguments, or None."""
    if task is None and queue is None and due_before is None and due_after is None and tag is None:
        return None
    return {
        "task": task,
        "queue": queue,
        "tag": tag,
        "due_before": _as_when(due_before),
        "due_after": _as_when(due_after),
    }


def _as_when(due: Due | None) -> Any:
    if due is None:
        return None
    if due.mode == "r":
        return timedelta(milliseconds=due.ms)
    return datetime.fromtimestamp(due.ms / 1000, tz=timezone.utc)


@zdelay.command(cls=ZDelayCommand, epilog=_CANCEL_EPILOG, context_settings=CONTEXT_SETTINGS)
@click.argument("task_ids", nargs=-1, metavar="[ID...]", callback=parse_ids)
@_filter_options("Cancel")
@click.pass_context
def cancel(
    ctx: click.Context,
    task_ids: tuple[str, ...],
    task: str | None,
    queue: str | None,
    tag: str | None,
    due_before: Due | None,
    due_after: Due | None,
    dry_run: bool,
) -> None:
    """Cancel parked tasks, by id or by filter, before they are released.

    An id may be that of a parked chain's or group's result: the whole
    parked canvas is cancelled.
    """
    filters = _bulk_filters(task, queue, due_before, due_after, tag)
    if bool(task_ids) == (filters is not None):
        raise click.UsageError(
            "Give the ids to cancel, or filters (--task, --queue, --tag, --due-*)."
        )
    if dry_run and filters is None:
        raise click.UsageError(
            "--dry-run goes with filters; to see an id, run: celery -A proj zdelay list"
        )
    app = ctx.obj.app
    with exit_codes(ctx):
        if filters is not None:
            n = steering.cancel_matching(dry_run=dry_run, app=app, by=cli_user(), **filters)
            tasks = counted(n, "parked task", "parked tasks")
            click.echo(f"would cancel {tasks} (dry run)" if dry_run else f"cancelled {tasks}")
            ctx.exit(EXIT_OK)
        found = steering.cancel_ids(task_ids, app=app, by=cli_user())
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
    hint = "use seconds (600) or a duration such as 30s, 15m, 1h30m or -10m"
    try:
        delay = parse_delay(value, seconds=True)
    except ConfigurationError as exc:
        raise click.BadParameter(f"{exc} ({hint})") from None
    if delay is None:
        raise click.BadParameter(f"{value[:60]!r}: {hint}") from None
    return delay.ms / 1000


@zdelay.command(cls=ZDelayCommand, epilog=_RESCHEDULE_EPILOG, context_settings=CONTEXT_SETTINGS)
@click.argument("task_id", metavar="[ID]", required=False, callback=parse_ids)
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
    tag: str | None,
    due_before: Due | None,
    due_after: Due | None,
    dry_run: bool,
) -> None:
    """Move parked tasks, by id or by filter, to a new due time."""
    if (countdown is None) == (eta is None):
        raise click.UsageError("Give exactly one of --countdown DURATION or --eta ISO.")
    filters = _bulk_filters(task, queue, due_before, due_after, tag)
    if (task_id is None) == (filters is None):
        raise click.UsageError(
            "Give the id to reschedule, or filters (--task, --queue, --tag, --due-*)."
        )
    if dry_run and filters is None:
        raise click.UsageError(
            "--dry-run goes with filters; to see an id, run: celery -A proj zdelay list"
        )
    try:
        due_from(countdown=countdown, eta=eta)
    except ConfigurationError as exc:
        raise click.BadParameter(str(exc), param_hint="--countdown/--eta") from None
    app = ctx.obj.app
    with exit_codes(ctx):
        if filters is not None:
            n = steering.reschedule_matching(
                countdown=countdown, eta=eta, dry_run=dry_run, app=app, by=cli_user(), **filters
            )
            tasks = counted(n, "parked task", "parked tasks")
            click.echo(f"would reschedule {tasks} (dry run)" if dry_run else f"rescheduled {tasks}")
            ctx.exit(EXIT_OK)
        assert task_id is not None
        moved = steering.reschedule(task_id, countdown=countdown, eta=eta, app=app, by=cli_user())
        found = steering.lookup(task_id, app=app) if moved else None
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
