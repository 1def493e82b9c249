"""Text for people: durations, relative times, timestamps and aligned tables.

The CLI's human output is built from these so every command words time the
same way ("in 29m 58s", "overdue 3s", "12s ago").
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime, timezone

__all__ = [
    "ago",
    "clip",
    "count",
    "counted",
    "duration",
    "relative_due",
    "shard_ranges",
    "table",
    "utc",
]


def duration(ms: int) -> str:
    """Return *ms* as its two largest units: ``450ms``, ``3s``, ``29m 58s``, ``2d 4h``.

    Rounded down, so an entry due in 29 min 58.9 s reads "29m 58s": never
    later than it is.
    """
    ms = abs(int(ms))
    if ms < 1000:
        return f"{ms}ms"
    seconds = ms // 1000
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m {seconds}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h {minutes}m"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours}h"


def relative_due(due_ms: int, now_ms: int) -> str:
    """Return when *due_ms* is, seen at *now_ms*: ``in 29m 58s``, ``overdue 3s``."""
    if due_ms > now_ms:
        return f"in {duration(due_ms - now_ms)}"
    if due_ms == now_ms:
        return "due now"
    return f"overdue {duration(now_ms - due_ms)}"


def ago(then_ms: int, now_ms: int) -> str:
    """Return how long before *now_ms* *then_ms* was: ``12s ago``.

    A time slightly ahead of *now_ms* (clocks of two hosts) reads "just now".
    """
    if then_ms >= now_ms:
        return "just now"
    return f"{duration(now_ms - then_ms)} ago"


def utc(ms: int) -> str:
    """Return epoch *ms* as an ISO 8601 UTC time to the second: ``2025-06-01T12:30:03Z``."""
    moment = datetime.fromtimestamp(ms / 1000, tz=timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def count(n: int) -> str:
    """Return *n* with thousands separators: ``1,204``."""
    return f"{n:,}"


def counted(n: int, singular: str, plural: str) -> str:
    """Return ``1 entry``, ``2 entries``, ``1,204 entries``."""
    return f"{n:,} {singular if n == 1 else plural}"


def clip(text: str, width: int) -> str:
    """Return *text* cut to *width* characters, marking the cut with ``...``."""
    if len(text) <= width:
        return text
    return text[: max(width - 3, 0)] + "..."


def table(
    headers: Sequence[str] | None,
    rows: Sequence[Sequence[str]],
    *,
    right: Collection[int] = (),
) -> str:
    """Return *rows* under *headers* (``None``: no header line) in aligned columns.

    Columns are two spaces apart; those whose index is in *right* (numbers)
    are right-aligned. The last column is not padded, so no line ends in
    spaces.
    """
    shown = [list(headers)] if headers is not None else []
    widths = [0] * max((len(row) for row in [*shown, *rows]), default=0)
    for row in [*shown, *rows]:
        for index, cell in enumerate(row):
            widths[index] = max(widths[index], len(cell))
    last = len(widths) - 1
    lines = []
    for row in [*shown, *rows]:
        cells = []
        for index, cell in enumerate(row):
            if index in right:
                cells.append(cell.rjust(widths[index]))
            elif index == last:
                cells.append(cell)
            else:
                cells.append(cell.ljust(widths[index]))
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def shard_ranges(shards: Collection[int]) -> str:
    """Return shard numbers as people read them: ``0-7``, ``0-1``, ``3``, ``0,2,5``, ``none``."""
    if not shards:
        return "none"
    numbers = sorted(shards)
    if numbers == list(range(numbers[0], numbers[-1] + 1)) and len(numbers) > 1:
        return f"{numbers[0]}-{numbers[-1]}"
    return ",".join(map(str, numbers))
