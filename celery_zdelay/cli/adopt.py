"""``zdelay adopt``: take the ETA tasks sent the native way from their queues into the store."""

from __future__ import annotations

from typing import Any

import click
from celery.bin.base import CeleryOption

from .._format import count, relative_due, table, utc
from ..adoption import REASONS, AdoptReport, QueueReport, adopt
from ..app_state import store_for
from ..errors import QueueInUseError, QueueNotFoundError, ZDelayError
from ..store import admin
from ._base import (
    CONTEXT_SETTINGS,
    EXIT_CHECK_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    ZDelayCommand,
    echo_json,
    exit_codes,
    json_option,
)
from .companion import zdelay

__all__ = ["adopt_"]

_ADOPT_EPILOG = """\b
Examples:
  celery -A proj zdelay adopt --queue celery --dry-run
  celery -A proj zdelay adopt --queue celery
  celery -A proj zdelay adopt --queue celery --queue orders --json
  celery -A proj zdelay adopt --delayed-delivery      # RabbitMQ's delay queues
  celery -A proj zdelay adopt --redis-plus            # celery-redis-plus's sorted sets

\b
Stop the workers of those queues first: a running worker holds the ETA
tasks it took in memory (docs/migrating.rst). The delay queues of Celery's
native delayed delivery (RabbitMQ quorum queues) are consumed by no worker;
stop the workers of celery-redis-plus too (a message one popped is left to
it). Exit codes: 0 done (with --dry-run: counted, every message back in its
queue); 1 a worker consumes one of the queues; 2 a queue the broker and the
app do not know, no delay queue, or no queue of celery-redis-plus; 69 the
broker or the store cannot be reached; 78 the store is not configured, or
--redis-plus with a broker that is not Redis.
"""


@zdelay.command("adopt", cls=ZDelayCommand, epilog=_ADOPT_EPILOG, context_settings=CONTEXT_SETTINGS)
@click.option(
    "--queue",
    "queues",
    metavar="NAME",
    multiple=True,
    cls=CeleryOption,
    help_group="Adopt Options",
    help="A queue to take ETA tasks from (repeat it for more queues).",
)
@click.option(
    "--delayed-delivery",
    is_flag=True,
    cls=CeleryOption,
    help_group="Adopt Options",
    help=(
        "Also take the ETA tasks waiting in the delay queues of Celery's native delayed "
        "delivery (RabbitMQ quorum queues: celery_delayed_27 .. celery_delayed_0)."
    ),
)
@click.option(
    "--redis-plus",
    is_flag=True,
    cls=CeleryOption,
    help_group="Adopt Options",
    help=(
        "Also take the ETA tasks waiting in celery-redis-plus's keys of the broker's Redis "
        "(messages_index:<queue>: delayed, or queued and taken by no worker)."
    ),
)
@click.option(
    "--dry-run",
    is_flag=True,
    cls=CeleryOption,
    help_group="Adopt Options",
    help="Only count what would be adopted and what put back; every message goes back.",
)
@click.option(
    "--force",
    is_flag=True,
    cls=CeleryOption,
    help_group="Adopt Options",
    help="Skip the check that no worker consumes the queues.",
)
@json_option("what was adopted and put back")
@click.pass_context
def adopt_(
    ctx: click.Context,
    queues: tuple[str, ...],
    delayed_delivery: bool,
    redis_plus: bool,
    dry_run: bool,
    force: bool,
    as_json: bool,
) -> None:
    """Move ETA tasks sent with apply_async(countdown=/eta=) from their queues into the store."""
    app = ctx.obj.app
    if not queues and not delayed_delivery and not redis_plus:
        raise click.UsageError(
            "Give --queue NAME (repeat it for more), --delayed-delivery or --redis-plus."
        )
    with exit_codes(ctx):
        try:
            report = adopt(
                app,
                queues,
                dry_run=dry_run,
                force=force,
                delayed_delivery=delayed_delivery,
                redis_plus=redis_plus,
            )
        except QueueNotFoundError as exc:
            click.echo(f"Error: {exc}", err=True)
            ctx.exit(EXIT_USAGE)
        except QueueInUseError as exc:
            click.echo(f"Error: {exc}", err=True)
            ctx.exit(EXIT_CHECK_FAILED)
        warning = None
        if not dry_run and any(q.adopted for q in report.queues):
            try:
                warning = admin.no_companion_warning(store_for(app))
            except ZDelayError:  # adopted already: never fail the report for this
                warning = None
    if as_json:
        echo_json(_document(report))
    else:
        _show(report)
    if warning is not None:
        click.echo(f"Warning: {warning}", err=True)
    ctx.exit(EXIT_OK)


def _show(report: AdoptReport) -> None:
    adopted = "WOULD ADOPT" if report.dry_run else "ADOPTED"
    note = " (dry run: nothing parked, every message back in its queue)" if report.dry_run else ""
    click.echo(f"Broker: {report.broker}{note}")
    rows = [
        [
            q.queue,
            count(q.waiting),
            count(q.read),
            count(q.adopted),
            count(q.adopted_before),
            count(q.put_back_total),
            _latest(q, report.now_ms),
        ]
        for q in report.queues
    ]
    headers = ["QUEUE", "WAITING", "READ", adopted, "ADOPTED BEFORE", "PUT BACK", "LATEST ETA"]
    click.echo(table(headers, rows, right={1, 2, 3, 4, 5}))
    reasons = [
        [q.queue, count(n), REASONS[reason]]
        for q in report.queues
        for reason, n in sorted(q.put_back.items())
    ]
    if reasons:
        click.echo("\nPut back as they were, for the workers:")
        click.echo(table(None, [["", *row] for row in reasons], right={2}))
    for q in report.queues:
        if q.restored:
            click.echo(
                f"\n{q.queue}: {count(q.restored)} given back first: a consumer took them more "
                "than visibility_timeout ago and never acknowledged them (kombu's rule)."
            )
        if q.unacked:
            back = f" from {utc(q.unacked_back_ms)}" if q.unacked_back_ms is not None else ""
            click.echo(
                f"\n{q.queue}: {count(q.unacked)} still unacknowledged in the broker, taken by a "
                "consumer that runs or that was killed; the broker gives them back "
                f"visibility_timeout after they were taken{back}: run adopt again then."
            )


def _latest(queue: QueueReport, now_ms: int) -> str:
    if queue.latest_eta_ms is None:
        return "-"
    return f"{utc(queue.latest_eta_ms)} ({relative_due(queue.latest_eta_ms, now_ms)})"


def _document(report: AdoptReport) -> dict[str, Any]:
    return {
        "broker": report.broker,
        "dry_run": report.dry_run,
        "queues": [
            {
                "queue": q.queue,
                "waiting": q.waiting,
                "read": q.read,
                "adopted": q.adopted,
                "adopted_before": q.adopted_before,
                "put_back": dict(sorted(q.put_back.items())),
                "latest_eta": _iso(q.latest_eta_ms),
                "restored": q.restored,
                "unacked": q.unacked,
                "unacked_back_at": _iso(q.unacked_back_ms),
            }
            for q in report.queues
        ],
    }


def _iso(ms: int | None) -> str | None:
    return None if ms is None else utc(ms)
