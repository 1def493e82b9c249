"""Running the ``celery zdelay`` commands in the test's own process."""

from __future__ import annotations

from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from celery_zdelay.cli import zdelay

__all__ = ["run"]


def run(app: Celery, *args: str, input: str | None = None) -> Result:
    """Run ``celery -A <app> zdelay <args>`` in this process."""
    return CliRunner().invoke(
        zdelay,
        list(args),
        obj=CLIContext(app=app, no_color=True, workdir=None),
        input=input,
        prog_name="celery zdelay",
        catch_exceptions=False,
    )
