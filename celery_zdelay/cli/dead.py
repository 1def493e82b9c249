"""``zdelay dead list|requeue|purge``: entries that could not be published."""

from __future__ import annotations

import click
from celery.bin.base import CeleryOption

from .. import steering
from .._format import count, counted
from ..store import admin
from . import views
from ._base import (
    CONTEXT_SETTINGS,
    EXIT_CHECK_FAILED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    ZDelayCommand,
    ZDelayGroup,
    cli_user,
    echo_json,
    exit_codes,
    json_option,
    limit_option,
    open_store,
    parse_ids,
)
from .companion import zdelay

__all__ = ["dead"]

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


# -- dead letters -------------------------------------------------------------------


@zdelay.group(cls=ZDelayGroup, epilog=_DEAD_EPILOG, context_settings=CONTEXT_SETTINGS)
def dead() -> None:
    """Entries that could not be published: list, requeue or purge them."""


@dead.command(
    "list", cls=ZDelayCommand, epilog=_DEAD_LIST_EPILOG, context_settings=CONTEXT_SETTINGS
)
@limit_option()
@json_option("the entries")
@click.pass_context
def dead_list(ctx: click.Context, limit: int, as_json: bool) -> None:
    """List dead-lettered entries, most recent first, with the reason."""
    with open_store(ctx) as store:
        listing = admin.list_dead(store, limit=limit)
        show_shard = store.config.shards > 1
    if as_json:
        echo_json(views.dead_json(listing))
    else:
        click.echo(views.dead_text(listing, show_shard=show_shard))


@dead.command(
    "requeue", cls=ZDelayCommand, epilog=_DEAD_REQUEUE_EPILOG, context_settings=CONTEXT_SETTINGS
)
@click.argument("task_ids", nargs=-1, metavar="[ID...]", callback=parse_ids)
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
    app = ctx.obj.app
    with exit_codes(ctx):
        if requeue_all:
            requeued, left = steering.requeue_all_dead(app=app, by=cli_user())
            click.echo(f"requeued {counted(requeued, 'entry', 'entries')}, due now")
            if left:
                click.echo(
                    f"left {counted(left, 'entry', 'entries')} dead-lettered: no message, "
                    "or the id was parked again (see: zdelay dead list)"
                )
            ctx.exit(EXIT_OK)
        flags = steering.requeue_dead(task_ids, app=app, by=cli_user())
    for task_id, done in zip(task_ids, flags, strict=True):
        if done:
            click.echo(f"requeued      {task_id}, due now")
        else:
            click.echo(f"not requeued  {task_id} (not dead-lettered, no message, or parked again)")
    ctx.exit(EXIT_OK if all(flags) else EXIT_NOT_FOUND)


@dead.command(
    "purge", cls=ZDelayCommand, epilog=_DEAD_PURGE_EPILOG, context_settings=CONTEXT_SETTINGS
)
@click.argument("task_ids", nargs=-1, metavar="[ID...]", callback=parse_ids)
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
    app = ctx.obj.app
    with exit_codes(ctx):
        if task_ids:
            purged = steering.purge_dead(task_ids, app=app, by=cli_user())
            click.echo(f"purged {count(purged)} of {counted(len(task_ids), 'entry', 'entries')}")
            ctx.exit(EXIT_OK if purged == len(set(task_ids)) else EXIT_NOT_FOUND)
        with open_store(ctx) as store:
            total = admin.counts(store).dead
        if total == 0:
            click.echo("No dead-lettered entries.")
            ctx.exit(EXIT_OK)
        question = f"Delete all {counted(total, 'dead-lettered entry', 'dead-lettered entries')}?"
        if not yes and not click.confirm(question):
            click.echo("Nothing purged.")
            ctx.exit(EXIT_CHECK_FAILED)
        purged = steering.purge_dead(app=app, by=cli_user())
    click.echo(f"purged {counted(purged, 'entry', 'entries')}")
