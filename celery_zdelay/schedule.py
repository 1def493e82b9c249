"""When a parked entry is due: ``countdown=`` and ``eta=`` as Celery reads them.

Due times are integer milliseconds. A countdown is counted on the Redis
server's clock (the store adds it to Redis ``TIME`` when parking), so every
due decision uses one clock; an ``eta`` is an absolute instant, read the way
Celery's worker reads it (a naive datetime is UTC).
"""

from __future__ import annotations

import math
import numbers
import random
import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, Literal, NoReturn

from celery.utils.time import maybe_iso8601, maybe_make_aware

from .due_score import MAX_DUE_MS
from .errors import ConfigurationError

__all__ = [
    "MAX_COUNTDOWN_S",
    "MAX_DUE_MS",
    "MAX_JITTER_SECONDS",
    "Due",
    "due_from",
    "jitter_ms",
    "parse_delay",
    "parse_when",
]

#: Longest countdown accepted, in seconds (about 100 years), either way.
MAX_COUNTDOWN_S = 100 * 365.25 * 86400
#: :data:`MAX_COUNTDOWN_S` in ms: the bound of every delay, typed or passed.
MAX_COUNTDOWN_MS = int(MAX_COUNTDOWN_S * 1000)

#: Largest jitter (seconds), of a one-off call (``jitter=``) and of a
#: periodic task (``zdelay_jitter``): a day.
MAX_JITTER_SECONDS = 86_400

#: Units of a duration typed by a person, in ms.
_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
#: One part of a duration: a decimal number and its unit (``1.5h``).
_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h|d)", re.ASCII)
#: A number of seconds (``600``, ``-1.5``), as ``zdelay reschedule --countdown`` takes it.
_SECONDS = re.compile(r"[+-]?[0-9]+(?:\.[0-9]+)?", re.ASCII)


@dataclass(frozen=True)
class Due:
    """A due time: *ms* after the Redis clock (``"r"``) or at epoch *ms* (``"a"``)."""

    mode: Literal["r", "a"]
    ms: int

    def jittered(self, spread_ms: int) -> Due:
        """Return this due time moved by a random amount in ``[0, spread_ms]``: never earlier.

        Raises:
            ConfigurationError: the moved time is after the last one the
                store holds (an eta close to 2248).
        """
        if spread_ms <= 0:
            return self
        moved = Due(self.mode, self.ms + random.randint(0, spread_ms))
        if moved.mode == "a" and moved.ms > MAX_DUE_MS:
            raise ConfigurationError(
                "eta plus jitter is too far in the future (after 2248): give an earlier eta "
                "or a smaller jitter. Nothing was parked."
            )
        return moved


def due_from(countdown: Any = None, eta: Any = None) -> Due:
    """Return the due time given by *countdown* seconds or an *eta*.

    Raises:
        ConfigurationError: neither or both are given, or one is not a time,
            or it is further than the store's due times reach (a countdown
            of :data:`MAX_COUNTDOWN_S` either way; an eta in 1691-2248).
    """
    if countdown is not None and eta is not None:
        raise ConfigurationError("Pass countdown= or eta=, not both.")
    if countdown is not None:
        if isinstance(countdown, bool) or not isinstance(countdown, (int, float)):
            _refuse_countdown(countdown)
        if isinstance(countdown, float) and not math.isfinite(countdown):
            _refuse_countdown(countdown)
        # Compared as it is: an int beyond a float's range must not be
        # turned into one (10**400 raises OverflowError there).
        if abs(countdown) > MAX_COUNTDOWN_S:
            _refuse_countdown(countdown)
        # Rounded up: an entry is never released before its countdown is over.
        return Due("r", math.ceil(countdown * 1000))
    if eta is not None:
        when = _datetime(eta)
        try:
            ms = math.ceil(maybe_make_aware(when).timestamp() * 1000)
        except (OverflowError, ValueError) as exc:
            raise ConfigurationError(
                f"eta {_shown(eta)} is not a time the store can hold."
            ) from exc
        if ms > MAX_DUE_MS:
            raise ConfigurationError(f"eta {_shown(eta)} is too far in the future (after 2248).")
        if ms < -MAX_DUE_MS:
            # Scores of due times before it would be rounded (due_score.py).
            raise ConfigurationError(
                f"eta {_shown(eta)} is too far in the past (before 1691): give a recent time, "
                "or countdown=0 to make the task due at once."
            )
        return Due("a", ms)
    raise ConfigurationError(
        "A delayed task needs countdown= (seconds) or eta= (datetime); "
        "use apply_async() to send it now."
    )


def jitter_ms(jitter: Any, where: str = "jitter") -> int:
    """Return *jitter* (seconds, or a ``timedelta``) in whole ms, checked by one rule.

    One-off calls (``apply_delayed(..., jitter=30)``) and periodic tasks
    (``zdelay_jitter``) read it here. ``None`` is no jitter.

    Raises:
        ConfigurationError: it is not a number of seconds from 0 to
            :data:`MAX_JITTER_SECONDS` (a bool, NaN, infinite, negative, too large).
    """
    if jitter is None:
        return 0
    seconds = jitter.total_seconds() if isinstance(jitter, timedelta) else jitter
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, numbers.Real)
        or not 0 <= float(seconds) <= MAX_JITTER_SECONDS
    ):
        raise ConfigurationError(
            f"{where} must be a number of seconds from 0 to {MAX_JITTER_SECONDS} "
            f"(or a timedelta), got {_shown(jitter)}."
        )
    return round(float(seconds) * 1000)


def parse_delay(text: str, *, seconds: bool = False) -> Due | None:
    """Return the delay from now a person typed, or None if *text* is not one.

    A delay is a duration: parts of a decimal number and a unit (``ms``,
    ``s``, ``m``, ``h``, ``d``) with an optional sign, as in ``30s``,
    ``1h30m``, ``-10m``, ``1.5h``; with *seconds*, a plain number of seconds
    (``600``) too. The CLI (``--due-before``, ``--countdown``) and the
    dashboard (filters, the reschedule form) read delays here only.

    Raises:
        ConfigurationError: *text* is a delay longer than
            :data:`MAX_COUNTDOWN_S` (either way), as ``countdown=`` is refused.
    """
    body = text.strip()
    if seconds and _SECONDS.fullmatch(body):
        return _bounded(Decimal(body) * 1000, text)
    sign = 1
    if body.startswith(("+", "-")):
        sign = -1 if body[0] == "-" else 1
        body = body[1:]
    if not body:
        return None
    # Decimal, not float: 400 nines make a float infinite, and its ms an OverflowError.
    total = Decimal(0)
    position = 0
    for match in _PART.finditer(body):
        if match.start() != position:
            return None
        total += Decimal(match.group(1)) * _UNITS_MS[match.group(2)]
        position = match.end()
    if position != len(body):
        return None
    return _bounded(sign * total, text)


def parse_when(text: str) -> Due:
    """Return the due time a person typed: ``now``, a delay (:func:`parse_delay`) or ISO 8601.

    Raises:
        ConfigurationError: *text* is none of these, or lies beyond what
            :func:`due_from` accepts.
    """
    body = text.strip()
    if body.lower() == "now":
        return Due("r", 0)
    delay = parse_delay(body)
    if delay is not None:
        return delay
    return due_from(eta=body)


def _bounded(ms: Decimal, text: str) -> Due:
    if abs(ms) > MAX_COUNTDOWN_MS:
        raise ConfigurationError(
            f"{_shown(text.strip())} is longer than the longest delay: at most "
            f"{MAX_COUNTDOWN_S:.0f} seconds (about 100 years) either way."
        )
    # Rounded up, as a countdown is: never due before the delay is over.
    return Due("r", math.ceil(ms))


def _refuse_countdown(countdown: Any) -> NoReturn:
    raise ConfigurationError(
        f"countdown must be a number of seconds (at most {MAX_COUNTDOWN_S:.0f} either way), "
        f"got {_shown(countdown)}."
    )


def _shown(value: Any) -> str:
    """*value*'s repr, cut short (an int of 4,300+ digits has no repr at all)."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"(an integer of {value.bit_length()} bits)"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _datetime(eta: Any) -> datetime:
    if isinstance(eta, str) and eta[-1:] in ("Z", "z"):
        # Python 3.10's fromisoformat, which Celery 5.3 reads with, refuses
        # the "Z" that 3.11 and later Celery accept: the same UTC either way.
        eta = eta[:-1] + "+00:00"
    try:
        when = maybe_iso8601(eta)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"eta must be a datetime or an ISO 8601 string, got {_shown(eta)}."
        ) from exc
    if not isinstance(when, datetime):
        raise ConfigurationError(
            f"eta must be a datetime or an ISO 8601 string, got {_shown(eta)}."
        )
    return when
