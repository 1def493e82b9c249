"""``zdelay status`` and ``zdelay list``: what is parked, late, in flight, dead."""

from __future__ import annotations

import click
from celery.bin.base import CeleryOption

from ..errors import ConfigurationError
from ..keys import validate_tag
from ..limits import controls
from ..periodic.views import (
    schedule_json,
    schedule_lines,
    status_schedules,
    unserved_problems,
)
from ..schedule import Due
from ..store import admin
from ..store.marks import CHECK_SAMPLE, check_marks, repair_marks
from . import views
from ._base import (
    CONTEXT_SETTINGS,
    EXIT_CHECK_FAILED,
    EXIT_OK,
    ZDelayCommand,
    any_relative,
    echo_json,
    json_option,
    limit_option,
    open_store,
    resolve_due,
    when_option,
)
from .companion import zdelay
from .limit import control_lines

__all__ = ["list_", "status"]

#: ``status --check`` fails when an entry is overdue by more than this (seconds).
DEFAULT_MAX_OVERDUE_S = 60.0

_STATUS_EPILOG = """\b
Examples:
  celery -A proj zdelay status
  celery -A proj zdelay status --per-shard
  celery -A proj zdelay status --json | jq .overdue
  celery -A proj zdelay status --check --max-overdue 120   # alert (docs/operations.rst)

\b
Exit codes: 0 ok; 1 --check failed; 69 Redis unreachable; 78 bad setting.
"""

_LIST_EPILOG = """\b
Examples:
  celery -A proj zdelay list
  celery -A proj zdelay list --task proj.orders.cancel_unpaid --limit 20
  celery -A proj zdelay list --task 'proj.orders.*' --due-before 1h
  celery -A proj zdelay list --queue orders
  celery -A proj zdelay list --due-before now              # overdue entries
  celery -A proj zdelay list --due-after 2025-06-01T00:00:00Z --json
  celery -A proj zdelay list --tag order:42 --json

\b
WHEN is "now", a duration from now (30s, 15m, 1h30m, -10m, 2d) or an ISO 8601
time (naive times are UTC). Entries due in [--due-after, --due-before) match.
"""


# -- status ---------------------------------------------------------------------


@zdelay.command(cls=ZDelayCommand, epilog=_STATUS_EPILOG, context_settings=CONTEXT_SETTINGS)
@json_option("the status")
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
    "entries sit on shards beyond zdelay_shards, an entry is overdue by more than "
    "--max-overdue, the key and tag index disagrees with the entries, or periodic "
    "schedules are stored that no live companion serves.",
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
    max_overdue_ms = round(max_overdue * 1000)
    with open_store(ctx) as store:
        current = admin.status(store)
        schedules = status_schedules(store)
        held = controls(app=ctx.obj.app)
        problems = (
            admin.check(current, max_overdue_ms=max_overdue_ms, active_schedules=schedules.active)
            if check
            else None
        )
        if problems is not None:
            problems += [
                f"key/tag index, shard {item.shard}: {item.detail} "
                "(fix: celery -A proj zdelay repair)"
                for item in check_marks(store, sample=CHECK_SAMPLE)
            ]
            problems += unserved_problems(store)
    shards = len(current.counts.shards)
    if as_json:
        document = views.status_json(
            current, shards=shards, problems=problems, max_overdue_ms=max_overdue_ms
        )
        document["periodic"] = [schedule_json(info) for info in schedules.shown]
        document["periodic_stored"] = schedules.stored
        document["controls"] = [info.as_json() for info in held]
        echo_json(document)
    elif problems is not None:
        click.echo(views.check_text(problems, current))
    else:
        click.echo(views.status_text(current, shards=shards, per_shard=per_shard))
        if schedules.shown:
            click.echo("\nPeriodic schedules:\n" + "\n".join(schedule_lines(schedules.shown)))
        if schedules.stored > len(schedules.shown):
            click.echo(
                f"... the {len(schedules.shown)} soonest to run of {schedules.stored} "
                f"({schedules.paused} paused): celery -A proj zdelay periodic list shows all"
            )
        if held:
            click.echo("\nRate limits and pauses:\n" + "\n".join(control_lines(held)))
    ctx.exit(EXIT_CHECK_FAILED if problems else EXIT_OK)


# -- list -----------------------------------------------------------------------


@zdelay.command("list", cls=ZDelayCommand, epilog=_LIST_EPILOG, context_settings=CONTEXT_SETTINGS)
@click.option(
    "--task",
    metavar="NAME",
    cls=CeleryOption,
    help_group="Filter Options",
    help="Only entries of this task: a name or a glob pattern such as 'proj.orders.*'.",
)
@click.option(
    "--queue",
    metavar="NAME",
    cls=CeleryOption,
    help_group="Filter Options",
    help="Only entries routed to this queue: a name or a glob pattern.",
)
@click.option(
    "--tag",
    metavar="TAG",
    callback=lambda ctx, param, value: _checked_tag(value),
    cls=CeleryOption,
    help_group="Filter Options",
    help="Only entries tagged TAG (apply_delayed(tags=[...])), read through the tag index.",
)
@when_option("--due-before", "Only entries due before WHEN.")
@when_option("--due-after", "Only entries due at or after WHEN.")
@limit_option()
@json_option("the entries")
@click.pass_context
def list_(
    ctx: click.Context,
    task: str | None,
    queue: str | None,
    tag: str | None,
    due_before: Due | None,
    due_after: Due | None,
    limit: int,
    as_json: bool,
) -> None:
    """List parked entries in due order: task, id, due time, queue, arguments.

    Arguments are Celery's argsrepr/kwargsrepr headers; message bodies are
    never decoded.
    """
    with open_store(ctx) as store:
        now_ms = store.time_ms() if any_relative(due_before, due_after) else 0
        listing = admin.list_parked(
            store,
            task=task,
            queue=queue,
            due_after_ms=resolve_due(due_after, now_ms),
            due_before_ms=resolve_due(due_before, now_ms),
            limit=limit,
            tag=tag,
        )
        show_shard = store.config.shards > 1
    if as_json:
        echo_json(views.listing_json(listing))
    else:
        click.echo(views.listing_text(listing, show_shard=show_shard))


def _checked_tag(tag: str | None) -> str | None:
    """Refuse a tag no task can carry, as ``cancel --tag`` does, rather than list nothing."""
    if tag is None:
        return None
    try:
        return validate_tag(tag)
    except ConfigurationError as exc:
        raise click.BadParameter(str(exc), param_hint="--tag") from None


# -- repair -----------------------------------------------------------------

_REPAIR_EPILOG = """\b
Examples:
  celery -A proj zdelay status --check
  celery -A proj zdelay repair

\b
Exit codes: 0 the index agrees with the entries (after the repair); 1 some
disagreement is left (run it again: producers and companions were busy).
"""


@zdelay.command(
    "repair", cls=ZDelayCommand, epilog=_REPAIR_EPILOG, context_settings=CONTEXT_SETTINGS
)
@click.pass_context
def repair(ctx: click.Context) -> None:
    """Make the key and tag index agree with the parked entries again.

    The store's scripts keep it exact; it drifts only when something else
    changed the keys (a hand edit, an eviction, a restore of an old dump).
    Stale keys, tags and records are removed; missing tags are added.
    """
    with open_store(ctx) as store:
        fixed = repair_marks(store)
        left = check_marks(store)
    click.echo(f"repaired {fixed} index entr{'y' if fixed == 1 else 'ies'}")
    for item in left:
        click.echo(f"still wrong, shard {item.shard}: {item.detail}")
    ctx.exit(EXIT_CHECK_FAILED if left else EXIT_OK)
