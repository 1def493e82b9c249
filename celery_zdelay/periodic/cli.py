"""``celery -A proj zdelay periodic``: list and steer the periodic schedules.

Only parses and prints; the work is :mod:`celery_zdelay.periodic.api`.
"""

from __future__ import annotations

import json
from typing import Any

import click
from celery.bin.base import CeleryOption
from celery.schedules import crontab

from ..cli._base import (
    CONTEXT_SETTINGS,
    EXIT_NOT_FOUND,
    EXIT_OK,
    ZDelayCommand,
    ZDelayGroup,
    echo_json,
    exit_codes,
    json_option,
)
from ..cli.companion import zdelay
from . import api
from .definition import MAX_OVERLAP_TIMEOUT_SECONDS, MISSED_POLICIES, OVERLAP_POLICIES
from .views import schedule_json, schedule_lines, unserved_lines

__all__ = ["periodic"]

_EPILOG = """\b
Examples:
  celery -A proj zdelay periodic list
  celery -A proj zdelay periodic pause nightly-report
  celery -A proj zdelay periodic resume nightly-report
  celery -A proj zdelay periodic run nightly-report
  celery -A proj zdelay periodic pause "Send daily report"   # a django-celery-beat row
  celery -A proj zdelay periodic add cleanup --task proj.tasks.cleanup --every 3600
  celery -A proj zdelay periodic add report --task proj.tasks.report --crontab '0 3 * * *'
  celery -A proj zdelay periodic remove cleanup
  celery -A proj zdelay periodic backfill cleanup --since 2026-07-01T00:00:00Z
  celery -A proj zdelay periodic sync --force     # make this beat_schedule the stored one

\b
NAME is a schedule's name, or a django-celery-beat row's name in the admin
(its schedule name is that with '_' for spaces: both work).

\b
Exit codes: 0 done; 3 no schedule has that name; 69 Redis unreachable;
78 invalid entry.
"""


@zdelay.group(cls=ZDelayGroup, epilog=_EPILOG, context_settings=CONTEXT_SETTINGS)
def periodic() -> None:
    """Periodic tasks the companions serve (zdelay_beat / --beat): list and steer them."""


def _examples(*lines: str) -> str:
    return "\b\nExamples:\n" + "".join(
        f"  celery -A proj zdelay periodic {line}\n" for line in lines
    )


@periodic.command(
    "list",
    cls=ZDelayCommand,
    context_settings=CONTEXT_SETTINGS,
    epilog=_examples("list", "list --json | jq '.schedules[] | {name, next_run_ms}'"),
)
@json_option("the schedules")
@click.pass_context
def list_(ctx: click.Context, as_json: bool) -> None:
    """List the stored schedules with their next and last run, and whether paused.

    Then the entries no companion serves (a django-celery-beat row with an
    unknown task, an invalid crontab...), each with why.
    """
    with exit_codes(ctx):
        now_ms, infos = api.schedules(ctx.obj.app)
        unserved = api.unserved(ctx.obj.app)
    if as_json:
        echo_json(
            {
                "now_ms": now_ms,
                "schedules": [schedule_json(i) for i in infos],
                "unserved": [{"name": n, "reason": r} for n, r in sorted(unserved.items())],
            }
        )
        return
    if not infos and not unserved:
        click.echo("No periodic schedules stored (set zdelay_beat and beat_schedule, or add one).")
        return
    click.echo("\n".join(schedule_lines(infos) + unserved_lines(unserved)))


def _named(verb: str, action: Any) -> Any:
    @click.argument("name")
    @click.pass_context
    def command(ctx: click.Context, name: str) -> None:
        with exit_codes(ctx):
            done = action(name, app=ctx.obj.app)
        if not done:
            click.echo(
                f"No periodic schedule is named {name!r} (see: zdelay periodic list).", err=True
            )
            ctx.exit(EXIT_NOT_FOUND)
        click.echo(f"{verb} {name}")
        ctx.exit(EXIT_OK)

    return command


periodic.command(
    "pause",
    cls=ZDelayCommand,
    context_settings=CONTEXT_SETTINGS,
    help="Pause a schedule until resumed; what it parked is cancelled.",
    epilog=_examples(
        "pause nightly-report", 'pause "Send daily report"   # a row, by its admin name'
    ),
)(_named("paused", api.pause))
periodic.command(
    "resume",
    cls=ZDelayCommand,
    context_settings=CONTEXT_SETTINGS,
    help="Resume a paused schedule from now; occurrences while paused do not run.",
    epilog=_examples("resume nightly-report"),
)(_named("resumed", api.resume))
periodic.command(
    "remove",
    cls=ZDelayCommand,
    context_settings=CONTEXT_SETTINGS,
    help="Remove a schedule and cancel what it parked.",
    epilog=_examples("remove clean-up"),
)(_named("removed", api.remove))


@periodic.command(
    "run",
    cls=ZDelayCommand,
    context_settings=CONTEXT_SETTINGS,
    epilog=_examples("run nightly-report"),
)
@click.argument("name")
@click.pass_context
def run(ctx: click.Context, name: str) -> None:
    """Run a schedule's task once now, outside its schedule."""
    with exit_codes(ctx):
        _require_schedule(ctx, name)
        task_id = api.run_now(name, app=ctx.obj.app)
    click.echo(f"sent {task_id}")


def _require_schedule(ctx: click.Context, name: str) -> None:
    """Exit with EXIT_NOT_FOUND, saying so, when no schedule is named *name*.

    Named by its name or the one people know it by (a django-celery-beat
    row's name in the admin): see api.stored_name.
    """
    if api.stored_name(name, app=ctx.obj.app) is None:
        click.echo(f"No periodic schedule is named {name!r} (see: zdelay periodic list).", err=True)
        ctx.exit(EXIT_NOT_FOUND)


def _json_arg(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    if value is None:
        return None
    try:
        return json.loads(value)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}") from None


@periodic.command(
    "add",
    cls=ZDelayCommand,
    context_settings=CONTEXT_SETTINGS,
    epilog=_examples(
        "add clean-up --task proj.tasks.clean_up --every 3600",
        "add report --task proj.tasks.report --crontab '0 3 * * *' --args '[\"sales\"]'",
        'add poll --task proj.tasks.poll --every 10 --options \'{"queue": "io"}\' --missed skip',
        "add sync --task proj.tasks.sync --every 60 --overlap skip --overlap-timeout 900",
    ),
)
@click.argument("name")
@click.option(
    "--task", required=True, cls=CeleryOption, help_group="Entry Options", help="Task name."
)
@click.option(
    "--every",
    type=click.FloatRange(min=0, min_open=True),
    metavar="SECONDS",
    cls=CeleryOption,
    help_group="Entry Options",
    help="Run every SECONDS.",
)
@click.option(
    "--crontab",
    "cron",
    metavar="'M H DOM MON DOW'",
    cls=CeleryOption,
    help_group="Entry Options",
    help="Run on a crontab (five fields, in the app's timezone).",
)
@click.option(
    "--args", callback=_json_arg, cls=CeleryOption, help_group="Entry Options", help="JSON list."
)
@click.option(
    "--kwargs",
    callback=_json_arg,
    cls=CeleryOption,
    help_group="Entry Options",
    help="JSON object.",
)
@click.option(
    "--options",
    callback=_json_arg,
    cls=CeleryOption,
    help_group="Entry Options",
    help="JSON object of apply_async options (queue, priority, expires...).",
)
@click.option(
    "--missed",
    type=click.Choice(MISSED_POLICIES),
    default="once",
    show_default=True,
    cls=CeleryOption,
    help_group="Entry Options",
    help="Occurrences no companion released in time (all were down): once runs one "
    "for the whole gap (as beat), skip none, all each.",
)
@click.option(
    "--jitter",
    type=click.FloatRange(min=0, max=86_400),
    default=0.0,
    metavar="SECONDS",
    cls=CeleryOption,
    help_group="Entry Options",
    help="Run each occurrence up to SECONDS after its time, at an offset of its own "
    "(the same on every companion): spreads schedules due at the same moment.",
)
@click.option(
    "--timezone",
    "zone",
    metavar="ZONE",
    cls=CeleryOption,
    help_group="Entry Options",
    help="With --crontab: its time zone (IANA name, e.g. Europe/Paris) instead of the app's.",
)
@click.option(
    "--start",
    metavar="TIME",
    cls=CeleryOption,
    help_group="Entry Options",
    help="No occurrence before this ISO time (UTC unless it has an offset).",
)
@click.option(
    "--end",
    metavar="TIME",
    cls=CeleryOption,
    help_group="Entry Options",
    help="No occurrence after this ISO time (UTC unless it has an offset).",
)
@click.option(
    "--max-runs",
    type=click.IntRange(min=1),
    cls=CeleryOption,
    help_group="Entry Options",
    help="Run at most this many occurrences (counted per definition; a change starts again).",
)
@click.option(
    "--one-off",
    is_flag=True,
    cls=CeleryOption,
    help_group="Entry Options",
    help="Run the next occurrence only (as --max-runs 1).",
)
@click.option(
    "--overlap",
    type=click.Choice(OVERLAP_POLICIES),
    default="allow",
    show_default=True,
    cls=CeleryOption,
    help_group="Entry Options",
    help="An occurrence due while the previous run is unfinished: allow runs it (as beat), "
    "skip drops it, buffer_one runs it once that run ends (one waits, others are skipped).",
)
@click.option(
    "--overlap-timeout",
    type=click.FloatRange(min=0, min_open=True, max=MAX_OVERLAP_TIMEOUT_SECONDS),
    metavar="SECONDS",
    cls=CeleryOption,
    help_group="Entry Options",
    help="With --overlap skip or buffer_one: a run no worker reported finished (killed) "
    "stops blocking after SECONDS (default: zdelay_max_run_seconds).",
)
@click.pass_context
def add(
    ctx: click.Context,
    name: str,
    task: str,
    every: float | None,
    cron: str | None,
    args: Any,
    kwargs: Any,
    options: Any,
    missed: str,
    jitter: float,
    zone: str | None,
    start: str | None,
    end: str | None,
    max_runs: int | None,
    one_off: bool,
    overlap: str,
    overlap_timeout: float | None,
) -> None:
    """Add (or replace) a schedule, stored in Redis for every companion."""
    if (every is None) == (cron is None):
        raise click.UsageError("give --every SECONDS or --crontab 'M H DOM MON DOW'")
    schedule: Any = every
    if cron is not None:
        fields = cron.split()
        if len(fields) != 5:
            raise click.BadParameter("five fields: minute hour day-of-month month day-of-week")
        try:
            schedule = crontab(
                minute=fields[0],
                hour=fields[1],
                day_of_month=fields[2],
                month_of_year=fields[3],
                day_of_week=fields[4],
            )
        except Exception as exc:
            raise click.BadParameter(f"{cron!r}: {exc}") from None
    with exit_codes(ctx):
        changed = api.add(
            name,
            app=ctx.obj.app,
            task=task,
            schedule=schedule,
            args=args or (),
            kwargs=kwargs,
            options=options,
            missed=missed,
            jitter=jitter,
            timezone=zone,
            start=start,
            end=end,
            max_runs=max_runs,
            one_off=one_off,
            overlap=overlap,
            overlap_timeout=overlap_timeout,
        )
    click.echo(f"{'added' if changed else 'unchanged'} {name}")


@periodic.command(
    "backfill",
    cls=ZDelayCommand,
    context_settings=CONTEXT_SETTINGS,
    epilog=_examples(
        "backfill nightly-report --since 2026-07-01T00:00:00Z",
        "backfill poll --since 2026-07-01T08:00:00Z --until 2026-07-01T09:00:00Z",
    ),
)
@click.argument("name")
@click.option(
    "--since",
    required=True,
    metavar="TIME",
    cls=CeleryOption,
    help_group="Backfill Options",
    help="Start of the window, an ISO time (UTC unless it has an offset).",
)
@click.option(
    "--until",
    metavar="TIME",
    cls=CeleryOption,
    help_group="Backfill Options",
    help="End of the window (default: now).",
)
@click.pass_context
def backfill(ctx: click.Context, name: str, since: str, until: str | None) -> None:
    """Run now, once each, the occurrences of a window that were missed.

    Missed: left out by the missed policy while no companion or broker served
    the schedule (the last 1,000 of each schedule are remembered). Each runs
    under its own occurrence id, once: running the same backfill again runs
    nothing more.
    """
    with exit_codes(ctx):
        _require_schedule(ctx, name)
        parked = api.backfill(name, app=ctx.obj.app, since=since, until=until)
    for task_id in parked:
        click.echo(f"sent {task_id}")
    click.echo(f"backfilled {len(parked)} missed occurrences of {name}")


@periodic.command(
    "sync",
    cls=ZDelayCommand,
    context_settings=CONTEXT_SETTINGS,
    epilog=_examples("sync", "sync --force     # roll back to this beat_schedule"),
)
@click.option(
    "--force",
    is_flag=True,
    cls=CeleryOption,
    help_group="Sync Options",
    help="Store it even if a newer beat_schedule replaced it (a rollback).",
)
@click.pass_context
def sync(ctx: click.Context, force: bool) -> None:
    """Store this app's beat_schedule in Redis now, as a starting companion does."""
    with exit_codes(ctx):
        status = api.sync(ctx.obj.app, force=force)
    messages = {
        "same": "beat_schedule already stored",
        "done": "beat_schedule stored",
        "older": "not stored: a newer beat_schedule replaced this one (use --force to roll back)",
    }
    click.echo(messages[status])
    ctx.exit(EXIT_OK if status != "older" else 1)
