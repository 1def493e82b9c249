"""``celery -A proj zdelay``: run the companion (the group every subcommand hangs on)."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import click
from celery.bin.base import LOG_LEVEL, CeleryOption, handle_preload_options

from .._logjson import JsonFormatter
from ..companion.metrics import DEFAULT_METRICS_ADDR
from ..errors import ConfigurationError, ZDelayError
from ._base import CONTEXT_SETTINGS, EXIT_OK, ZDelayGroup, exit_codes, parse_shards

__all__ = ["zdelay"]

logger = logging.getLogger("celery_zdelay.cli")

_LOG_FORMAT = "[%(asctime)s: %(levelname)s/%(name)s] %(message)s"

_EPILOG = """\b
Examples:
  celery -A proj zdelay                      run the companion
  celery -A proj zdelay -l DEBUG             ... logging every batch
  celery -A proj zdelay --shards 0,1         ... releasing shards 0 and 1 only
  celery -A proj zdelay --metrics-port 9808  ... serving Prometheus metrics on loopback
  celery -A proj zdelay --log-format json    ... logging JSON lines
  celery -A proj zdelay --beat               ... serving beat_schedule too
  celery -A proj zdelay status               what is parked, late, in flight, dead
  celery -A proj zdelay list --limit 20      the next 20 entries due
  celery -A proj zdelay dead list            what could not be published, and why
"""


# -- the companion --------------------------------------------------------------


@click.group(
    cls=ZDelayGroup,
    invoke_without_command=True,
    epilog=_EPILOG,
    context_settings=CONTEXT_SETTINGS,
)
@click.option(
    "--shards",
    cls=CeleryOption,
    callback=parse_shards,
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
    "-s",
    "--schedule",
    "beat_schedule_file",
    cls=CeleryOption,
    metavar="PATH",
    help_group="Companion Options",
    help="celery beat's schedule file (as celery beat -s; default: beat_schedule_filename, "
    "celerybeat-schedule): with --beat, an entry stored for the first time goes on from "
    "its last run there, so the switch from celery beat loses and doubles no tick.",
)
@click.option(
    "--since",
    "beat_since",
    cls=CeleryOption,
    metavar="TIME",
    type=click.DateTime(formats=["%Y-%m-%dT%H:%M:%S%z", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M:%S"]),
    help_group="Companion Options",
    help="With --beat and no celery beat schedule file: when celery beat last ran the "
    "entries (ISO time, UTC unless it has an offset); entries stored for the first time "
    "go on from then.",
)
@click.option(
    "-S",
    "--scheduler",
    cls=CeleryOption,
    help_group="Companion Options",
    help="With --beat, where the schedules come from, as celery beat -S: 'django' serves "
    "django-celery-beat's PeriodicTask rows (sets beat_scheduler).",
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
    default=DEFAULT_METRICS_ADDR,
    show_default=True,
    help_group="Metrics Options",
    help="Address the metrics server listens on; 0.0.0.0 (or the pod's address) "
    "for a Prometheus on another host.",
)
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def zdelay(
    ctx: click.Context,
    shards: list[int] | None,
    loglevel: Any,
    log_format: str,
    beat: bool,
    beat_schedule_file: str | None,
    beat_since: datetime | None,
    scheduler: str | None,
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
    if scheduler is not None:
        app.conf.beat_scheduler = scheduler
    # Our own loggers at the level asked for; libraries stay at WARNING. A
    # project that configured logging itself (in the module -A imports) keeps
    # its handlers: basicConfig does nothing once the root logger has one.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(_LOG_FORMAT)
    )
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    logging.getLogger("celery_zdelay").setLevel(loglevel)

    from ..companion import Companion

    if beat_schedule_file:
        app.conf.beat_schedule_filename = beat_schedule_file
    if beat_since is not None:
        from ..periodic.takeover import set_since

        if beat_since.tzinfo is None:
            beat_since = beat_since.replace(tzinfo=timezone.utc)
        set_since(app, int(beat_since.timestamp() * 1000))

    stopping = threading.Event()
    started: list[Companion] = []

    def request_stop(signum: int, frame: Any) -> None:
        stopping.set()
        for companion in started:
            companion.stop()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    with exit_codes(ctx):
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
            from ..companion.metrics import serve_metrics

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
        except ZDelayError as exc:
            if not exc.transient:
                raise  # a bad setting fails at once
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
