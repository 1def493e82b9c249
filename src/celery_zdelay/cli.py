"""``celery -A proj zdelay``: run the companion, and inspect or steer the store.

The command only parses options and wires the pieces together; the work is
done by :mod:`celery_zdelay.companion` and :mod:`celery_zdelay.store`.
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import Any

import click
from celery.bin.base import LOG_LEVEL, CeleryCommand, CeleryOption, handle_preload_options

from .errors import ConfigurationError, StoreUnavailableError

__all__ = ["EXIT_CONFIG", "EXIT_OK", "EXIT_UNAVAILABLE", "zdelay"]

#: Clean exit, including after SIGTERM/SIGINT.
EXIT_OK = 0
#: A check failed (``status --check``).
EXIT_CHECK_FAILED = 1
#: The store (Redis) could not be reached (sysexits EX_UNAVAILABLE).
EXIT_UNAVAILABLE = 69
#: A setting or option is invalid (sysexits EX_CONFIG).
EXIT_CONFIG = 78

_LOG_FORMAT = "[%(asctime)s: %(levelname)s/%(name)s] %(message)s"

_EPILOG = """\b
Examples:
  celery -A proj zdelay                      run the companion
  celery -A proj zdelay -l DEBUG             ... logging every batch
  celery -A proj zdelay --shards 0,1         ... releasing shards 0 and 1 only
"""


class ZDelayGroup(CeleryCommand, click.Group):  # type: ignore[misc]
    """A click group laid out like Celery's own commands (option help groups)."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        CeleryCommand.format_options(self, ctx, formatter)
        self.format_commands(ctx, formatter)


def _parse_shards(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    if value is None:
        return None
    try:
        return sorted({int(part) for part in value.split(",") if part.strip()})
    except ValueError:
        raise click.BadParameter("use shard numbers separated by commas, e.g. 0,1,2") from None


@click.group(
    cls=ZDelayGroup,
    invoke_without_command=True,
    epilog=_EPILOG,
    context_settings={"max_content_width": 100},
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
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def zdelay(ctx: click.Context, shards: list[int] | None, loglevel: Any) -> None:
    """Release parked delayed tasks to the broker when they are due.

    Without a subcommand, runs the companion until SIGTERM or SIGINT, then
    finishes the batch in hand and exits 0.
    """
    if ctx.invoked_subcommand is not None:
        return
    app = ctx.obj.app
    # Our own loggers at the level asked for; libraries stay at WARNING.
    logging.basicConfig(level=logging.WARNING, format=_LOG_FORMAT, stream=sys.stderr)
    logging.getLogger("celery_zdelay").setLevel(loglevel)

    from .companion import Companion

    with _exit_codes(ctx):
        companion = Companion(app, shards=shards)
        invalid = [s for s in companion.shards if s not in companion.store.shards]
        if invalid:
            raise ConfigurationError(
                f"--shards {','.join(map(str, invalid))}: zdelay_shards is "
                f"{companion.config.shards}, so shards run from 0 to {companion.config.shards - 1}."
            )

        def request_stop(signum: int, frame: Any) -> None:
            companion.stop()

        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)
        companion.run()
    ctx.exit(EXIT_OK)


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
