"""Running the ``celery zdelay`` commands in the test's own process."""

from __future__ import annotations

from collections.abc import Callable

from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from celery_zdelay.cli import zdelay
from celery_zdelay.schedule import parse_delay
from celery_zdelay.store import Store

__all__ = ["assert_shows", "lines", "run", "timed"]


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


def lines(result: Result) -> list[str]:
    return result.stdout.splitlines()


def timed(store: Store, command: Callable[[], Result]) -> tuple[Result, int, int]:
    """Run *command*; return its result and the Redis time just before and after it."""
    before = store.time_ms()
    result = command()
    return result, before, store.time_ms()


def assert_shows(text: str, *, at_least_ms: int, at_most_ms: int) -> None:
    """Assert *text* ("59s", "1m 0s") is a duration that lay between the bounds.

    The CLI rounds durations of a second or more down to the second, and the
    bounds come from the Redis clock read around the command: however slow
    the machine, a right answer stays inside them and a wrong one does not.
    """
    delay = parse_delay(text.replace(" ", ""))
    assert delay is not None, f"{text!r} is not a duration"
    shown = delay.ms
    assert at_least_ms >= 1000, "durations under a second are shown to the millisecond"
    assert at_least_ms // 1000 * 1000 <= shown <= at_most_ms // 1000 * 1000, (
        f"{text!r} is not between {at_least_ms} and {at_most_ms} ms"
    )
