"""``zdelay limit``, ``zdelay pause`` and ``zdelay resume``: release control from the shell."""

from __future__ import annotations

import warnings
from typing import Any

import click
from celery.bin.base import CeleryOption

from .. import limits
from .._format import utc
from ._base import (
    CONTEXT_SETTINGS,
    EXIT_OK,
    F,
    ZDelayCommand,
    cli_user,
    echo_json,
    exit_codes,
    json_option,
)
from .companion import zdelay

__all__ = ["concurrency", "control_lines", "limit", "pause", "resume"]

_LIMIT_EPILOG = """\b
Examples:
  celery -A proj zdelay limit                         # list limits and pauses
  celery -A proj zdelay limit queue:emails 50/s
  celery -A proj zdelay limit task:proj.sms 10/m --burst 5
  celery -A proj zdelay limit queue:emails off        # remove it (the setting's too)

\b
A limit holds for every companion and shard together; companions apply a
change within 0.5 s, without a restart. Exit codes: 0 done; 78 bad name or rate.
"""

_CONCURRENCY_EPILOG = """\b
Examples:
  celery -A proj zdelay concurrency                         # list the controls
  celery -A proj zdelay concurrency task:proj.export 1
  celery -A proj zdelay concurrency limit_key:tenant:* 2    # 2 per tenant
  celery -A proj zdelay concurrency task:proj.export off    # remove it (the setting's too)

\b
At most N tasks of NAME released and not finished, for every companion and
shard together; stored in Redis, it wins over zdelay_concurrency. A new
number or a removal applies within 0.5 s; a name the setting does not have
applies 1 s after it is first set (workers learn it first). Exit codes: 0
done; 78 bad name or number.
"""

_PAUSE_EPILOG = """\b
Examples:
  celery -A proj zdelay pause queue:emails
  celery -A proj zdelay pause --task proj.sms
  celery -A proj zdelay resume queue:emails

\b
Paused tasks stay parked and are released, overdue first and under the
rate limit, on resume. A pause is stored in Redis: it survives companion
restarts, and every companion applies it within 0.5 s.
"""


def _name(name: str | None, queue: str | None, task: str | None) -> str:
    given = [n for n in (name, queue and f"queue:{queue}", task and f"task:{task}") if n]
    if len(given) != 1:
        raise click.UsageError("Give one of NAME (queue:<q> or task:<t>), --queue Q or --task T.")
    return given[0]


def _control_options(command: F) -> F:
    for option in (
        click.option(
            "--task",
            metavar="NAME",
            cls=CeleryOption,
            help_group="Control Options",
            help="The task name (same as NAME task:<name>).",
        ),
        click.option(
            "--queue",
            metavar="NAME",
            cls=CeleryOption,
            help_group="Control Options",
            help="The queue (same as NAME queue:<name>).",
        ),
    ):
        command = option(command)
    return click.argument("name", required=False, metavar="[NAME]")(command)


@zdelay.command(cls=ZDelayCommand, epilog=_LIMIT_EPILOG, context_settings=CONTEXT_SETTINGS)
@click.argument("name", required=False, metavar="[NAME]")
@click.argument("rate", required=False, metavar="[RATE]")
@click.option(
    "--burst",
    type=click.IntRange(1),
    cls=CeleryOption,
    help_group="Limit Options",
    help="Most tasks released at once (default: one second's worth of RATE).",
)
@json_option("the limits and pauses")
@click.pass_context
def limit(
    ctx: click.Context, name: str | None, rate: str | None, burst: int | None, as_json: bool
) -> None:
    """Set a global release rate limit of a queue or task, or list them all.

    NAME is queue:<queue>, task:<task name> or limit_key:<glob> (a bucket per
    distinct limit key the glob matches, e.g. limit_key:tenant:*); RATE is
    Celery's format (50/s, 10/m, 1000/h), or off to remove the limit.
    """
    app = ctx.obj.app
    if name is not None and rate is None:
        raise click.UsageError("Give a RATE (such as 50/s, or off) after the NAME.")
    if name is None:
        with exit_codes(ctx):
            found = limits.controls(app=app)
        if as_json:
            echo_json([info.as_json() for info in found])
        elif not found:
            click.echo("no rate limits, pauses or concurrency controls")
        else:
            click.echo("\n".join(control_lines(found)))
        ctx.exit(EXIT_OK)
    assert rate is not None
    with exit_codes(ctx), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", limits.UnknownControlWarning)
        new = limits.set_rate_limit(
            name,
            None if rate.lower() in ("off", "none") else rate,
            burst=burst,
            app=app,
            by=cli_user(),
        )
    for warning in caught:
        click.echo(f"Warning: {warning.message}", err=True)
    if new is None:
        click.echo(f"{name}: no rate limit")
    else:
        click.echo(f"{name}: {new.text} (burst {new.burst})")


@zdelay.command(cls=ZDelayCommand, epilog=_CONCURRENCY_EPILOG, context_settings=CONTEXT_SETTINGS)
@click.argument("name", required=False, metavar="[NAME]")
@click.argument("most", required=False, metavar="[N]")
@json_option("the limits, pauses and concurrency controls")
@click.pass_context
def concurrency(ctx: click.Context, name: str | None, most: str | None, as_json: bool) -> None:
    """Set how many tasks of a queue, task or limit key may run at once, or list the controls.

    NAME is queue:<queue>, task:<task name> or limit_key:<glob> (N per
    distinct limit key the glob matches); N is a whole number of at least
    1, or off to remove the control.
    """
    if name is None:
        ctx.invoke(limit, name=None, rate=None, burst=None, as_json=as_json)
        return
    if most is None:
        raise click.UsageError("Give a number N (such as 2, or off) after the NAME.")
    # Anything but off or a whole number goes as it is: the API refuses it, saying why.
    value: Any = (
        None
        if most.lower() in ("off", "none")
        else int(most)
        if most.isascii() and most.isdigit()
        else most
    )
    with exit_codes(ctx), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", limits.UnknownControlWarning)
        new = limits.set_concurrency(name, value, app=ctx.obj.app, by=cli_user())
    for warning in caught:
        click.echo(f"Warning: {warning.message}", err=True)
    click.echo(f"{name}: no concurrency control" if new is None else f"{name}: concurrency {new}")


@zdelay.command(cls=ZDelayCommand, epilog=_PAUSE_EPILOG, context_settings=CONTEXT_SETTINGS)
@_control_options
@click.pass_context
def pause(ctx: click.Context, name: str | None, queue: str | None, task: str | None) -> None:
    """Hold back the releases of a queue or task until resume."""
    control = _name(name, queue, task)
    with exit_codes(ctx), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", limits.UnknownControlWarning)
        since = limits.pause(control, app=ctx.obj.app, by=cli_user())
    for warning in caught:
        click.echo(f"Warning: {warning.message}", err=True)
    click.echo(f"paused {control} (since {utc(since)})")


@zdelay.command(cls=ZDelayCommand, epilog=_PAUSE_EPILOG, context_settings=CONTEXT_SETTINGS)
@_control_options
@click.pass_context
def resume(ctx: click.Context, name: str | None, queue: str | None, task: str | None) -> None:
    """Release a paused queue or task again, overdue tasks first."""
    control = _name(name, queue, task)
    with exit_codes(ctx):
        was = limits.resume(control, app=ctx.obj.app, by=cli_user())
    click.echo(f"resumed {control}" if was else f"{control} was not paused")


def control_lines(found: list[limits.ControlInfo]) -> list[str]:
    """Return one line per limited, paused or holding control (``limit``, ``status``)."""
    return [_describe(info) for info in found]


def _describe(info: limits.ControlInfo) -> str:
    parts = [f"  {info.name:<30}"]
    if info.limit is not None:
        parts.append(f"limit {info.limit.text} (burst {info.limit.burst}, {info.source})")
    else:
        parts.append("no limit")
    if info.concurrency is not None:
        each = " per key" if info.name.startswith("limit_key:") else ""
        keys = f" over {info.running_keys}{'+' if info.running_cut else ''} keys" if each else ""
        parts.append(
            f"concurrency {info.concurrency}{each} ({info.running} running{keys}, "
            f"{info.concurrency_source})"
        )
    if info.paused_since_ms is not None:
        parts.append(f"paused since {utc(info.paused_since_ms)}")
    parts.append(f"{info.waiting} waiting")
    if info.held_keys:
        # Counted, never listed: a glob may match a million keys.
        parts.append(f"over {info.held_keys} keys (a bucket each)")
    return "  ".join(parts)
