"""The due set's score: the due time in ms, times 1024, plus a sequence number.

Every due set (``{zdelay:N}:due``, and the held sets of rate-limited lanes)
orders its entries by this score, so that entries due in the same
millisecond keep the order they were parked in (park.lua numbers them
0 to 1023; the last slot is shared once full). The score stays below
2**53, so Redis, which keeps scores as doubles, holds it exactly: the
latest due time it can encode is :data:`MAX_DUE_MS` (year 2248).

This module is the one place Python reads or writes the encoding. The Lua
scripts (``store/lua/*.lua``, ``testing/shift.lua``) run inside Redis and
cannot import it: they write ``due_ms * 1024 + seq`` and read
``math.floor(score / 1024)`` themselves, and each due-set key in their
headers says so.
"""

from __future__ import annotations

__all__ = [
    "MAX_DUE_MS",
    "SEQUENCE_BITS",
    "SEQUENCE_SLOTS",
    "due_ms_of",
    "last_score_of",
    "score_of",
    "score_range",
]

#: Bits of the score below the due time, for the sequence number.
SEQUENCE_BITS = 10
#: Sequence numbers per millisecond: entries due in one ms keep their order.
SEQUENCE_SLOTS = 1 << SEQUENCE_BITS
#: Latest due time the encoding holds exactly (score < 2**53): in 2248.
MAX_DUE_MS = 2**53 // SEQUENCE_SLOTS - 1


def score_of(due_ms: int, sequence: int = 0) -> int:
    """Return the score of an entry due at *due_ms*, numbered *sequence* in its ms."""
    return due_ms * SEQUENCE_SLOTS + sequence


def last_score_of(due_ms: int) -> int:
    """Return the highest score of *due_ms*: every entry due then scores at most this."""
    return score_of(due_ms, SEQUENCE_SLOTS - 1)


def due_ms_of(score: float) -> int:
    """Return the due time, in ms, of an entry that scores *score*.

    Redis replies with scores as floats (or their text: pass ``float(text)``);
    below 2**53 the conversion is exact.
    """
    return int(score) // SEQUENCE_SLOTS


def score_range(due_after_ms: int | None, due_before_ms: int | None) -> tuple[str, str]:
    """Return the ``ZRANGEBYSCORE`` bounds of due times in ``[due_after_ms, due_before_ms)``.

    None leaves that side open.
    """
    low = "-inf" if due_after_ms is None else str(score_of(due_after_ms))
    high = "+inf" if due_before_ms is None else f"({score_of(due_before_ms)}"
    return low, high
