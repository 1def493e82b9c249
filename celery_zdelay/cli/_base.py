"""What every ``zdelay`` subcommand shares: exit codes, layout, option parsing, errors.

Subcommand groups of other packages (``periodic``, ``web``) build on these
too: this is a private module of public names, imported as
``celery_zdelay.cli._base``.
"""

from __future__ import annotations

import getpass
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import click
from celery.bin.base import CeleryCommand, CeleryOption

from ..config import get_config
from ..errors import ConfigurationError, StoreRefusedError, ZDelayError
from ..names import validate_task_id
from ..schedule import Due, parse_when
from ..store import Store, admin

__all__ = [
    "CONTEXT_SETTINGS",
    "EXIT_CHECK_FAILED",
    "EXIT_CONFIG",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "ZDelayCommand",
    "ZDelayGroup",
    "any_relative",
    "cli_user",
    "echo_json",
    "exit_codes",
    "json_option",
    "limit_option",
    "open_store",
    "parse_ids",
    "parse_shards",
    "resolve_due",
    "when_option",
]

#: Clean exit, including after SIGTERM/SIGINT.
EXIT_OK = 0
#: A check failed (``status --check``), or a confirmation was declined.
EXIT_CHECK_FAILED = 1
#: The command line is wrong (click's own code for usage errors).
EXIT_USAGE = 2
#: An id given to ``cancel``, ``reschedule`` or ``dead requeue|purge`` was not found.
EXIT_NOT_FOUND = 3
#: The store (Redis) could not be reached, or refused for now (sysexits EX_UNAVAILABLE).
EXIT_UNAVAILABLE = 69
#: A setting or option is invalid (sysexits EX_CONFIG).
EXIT_CONFIG = 78

CONTEXT_SETTINGS = {"max_content_width": 100}

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
    try:
        return parse_when(value)
    except ConfigurationError as exc:
        raise click.BadParameter(
            f"{value!r}: use now, a duration such as 30s, 15m, 1h30m or -10m, "
            f"or an ISO 8601 time such as 2025-06-01T09:00:00Z ({exc})"
        ) from None


def parse_ids(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """Check the ids given as arguments by the rule of :mod:`celery_zdelay.names`."""
    if value is None:
        return None
    try:
        if isinstance(value, tuple):
            return tuple(validate_task_id(task_id, done="changed") for task_id in value)
        return validate_task_id(value, done="changed")
    except ConfigurationError as exc:
        raise click.BadParameter(str(exc)) from None


def parse_shards(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    if value is None:
        return None
    try:
        return sorted({int(part) for part in value.split(",") if part.strip()})
    except ValueError:
        raise click.BadParameter("use shard numbers separated by commas, e.g. 0,1,2") from None


def json_option(what: str) -> Callable[[F], F]:
    return click.option(
        "--json",
        "as_json",
        is_flag=True,
        cls=CeleryOption,
        help_group="Output Options",
        help=f"Print {what} as one JSON document (fields: docs/cli.rst).",
    )


def when_option(flag: str, help: str) -> Callable[[F], F]:
    """A due-time filter option (``--due-before``/``--due-after``), read by :func:`_parse_when`."""
    return click.option(
        flag,
        metavar="WHEN",
        callback=_parse_when,
        cls=CeleryOption,
        help_group="Filter Options",
        help=help,
    )


def limit_option() -> Callable[[F], F]:
    return click.option(
        "--limit",
        type=click.IntRange(1, admin.MAX_LIST_LIMIT),
        default=admin.DEFAULT_LIST_LIMIT,
        show_default=True,
        cls=CeleryOption,
        help_group="Output Options",
        help="Most entries to show.",
    )


@contextmanager
def open_store(ctx: click.Context) -> Iterator[Store]:
    """Open the app's store for one command and close it after."""
    with exit_codes(ctx):
        store = Store(get_config(ctx.obj.app))
        try:
            yield store
        finally:
            store.close()


def any_relative(*whens: Due | None) -> bool:
    return any(w is not None and w.mode == "r" for w in whens)


def resolve_due(when: Due | None, now_ms: int) -> int | None:
    if when is None:
        return None
    return now_ms + when.ms if when.mode == "r" else when.ms


def cli_user() -> str:
    """Who steers from the command line (cancel, limit, ...), for the audit line and signal."""
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # no user name in a bare container
        return "cli"


def echo_json(document: Any) -> None:
    click.echo(json.dumps(document, indent=2, sort_keys=False))


class exit_codes:
    """Turn celery-zdelay errors into a message and a named exit code."""

    def __init__(self, ctx: click.Context) -> None:
        self.ctx = ctx

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if isinstance(exc, ConfigurationError):
            click.echo(f"Error: {exc}", err=True)
            self.ctx.exit(EXIT_CONFIG)
        if isinstance(exc, ZDelayError) and (exc.transient or isinstance(exc, StoreRefusedError)):
            # Unreachable, or refusing (out of memory, read-only, busy, an ACL
            # user without a command a script runs: the message says which).
            click.echo(f"Error: {exc}", err=True)
            self.ctx.exit(EXIT_UNAVAILABLE)
