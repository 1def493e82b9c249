"""``zdelay history ID``: did it fire, when, and who cancelled it?"""

from __future__ import annotations

import click

from ..task_history import describe, event_json, history
from ._base import (
    CONTEXT_SETTINGS,
    EXIT_NOT_FOUND,
    EXIT_OK,
    ZDelayCommand,
    echo_json,
    exit_codes,
    json_option,
    parse_ids,
)
from .companion import zdelay

__all__ = ["history_"]

_HISTORY_EPILOG = """\b
Examples:
  celery -A proj zdelay history 6f1c2a3e-8d4b-4a51-9b7e-2f9d0c1a7e55
  celery -A proj zdelay history 6f1c2a3e-8d4b-4a51-9b7e-2f9d0c1a7e55 --json

\b
Kept zdelay_history_seconds after a task's last event (docs/settings.rst).
Exit codes: 0 a history was found; 3 none (never parked, expired, or
recorded while zdelay_history_seconds was 0).
"""


@zdelay.command(
    "history", cls=ZDelayCommand, epilog=_HISTORY_EPILOG, context_settings=CONTEXT_SETTINGS
)
@click.argument("task_id", metavar="ID", callback=parse_ids)
@json_option("the events")
@click.pass_context
def history_(ctx: click.Context, task_id: str, as_json: bool) -> None:
    """What happened to a task: parked, held, released, cancelled, dead (oldest first)."""
    with exit_codes(ctx):
        events = history(task_id, app=ctx.obj.app)
    if as_json:
        echo_json({"task_id": task_id, "events": [event_json(event) for event in events]})
    elif not events:
        click.echo(f"no history  {task_id} (never parked, expired, or not recorded)")
    for event in [] if as_json else events:
        at = event.at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{event.at.microsecond // 1000:03d}Z"
        click.echo(f"{at}  {event.event:<11}  {describe(event)}".rstrip())
    ctx.exit(EXIT_OK if events else EXIT_NOT_FOUND)
