"""Rate limits and control names, parsed: what ``zdelay_rate_limits`` and the CLI accept.

A rate is Celery's own format (``"100/s"``, ``"10/m"``, ``"1000/h"``, a bare
number meaning per second), read by :func:`celery.utils.time.rate`'s rules.
A limit is a rate and a burst: the most tasks released at once after a quiet
spell. The burst defaults to one second's worth of the rate (at least 1);
give it explicitly as ``{"rate": "100/s", "burst": 500}``.

A control name says what a limit or pause applies to: ``"queue:<name>"``
(the Celery queue a task is routed to), ``"task:<name>"`` (a task name) or
``"limit_key:<glob>"`` (the limit keys of tasks, each distinct key on its own).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from celery.utils.time import rate as celery_rate

from .errors import ConfigurationError

__all__ = [
    "CONTROL_KINDS",
    "RateLimit",
    "control_name",
    "parse_limit",
    "parse_limits",
]

#: The prefixes a control name may have.
CONTROL_KINDS = ("queue", "task", "limit_key")

_PERIODS_MS = {"s": 1_000, "m": 60_000, "h": 3_600_000}


@dataclass(frozen=True)
class RateLimit:
    """A release rate limit: *count* tasks every *period_ms*, at most *burst* at once."""

    #: The rate as written (``"100/s"``).
    text: str
    count: float
    period_ms: int
    burst: int

    @property
    def per_second(self) -> float:
        return self.count * 1000 / self.period_ms

    def as_json(self) -> dict[str, Any]:
        return {"rate": self.text, "burst": self.burst}


def control_name(name: Any) -> str:
    """Return *name* checked: ``"queue:<name>"``, ``"task:<name>"`` or ``"limit_key:<glob>"``.

    Raises:
        ConfigurationError: the prefix is missing or unknown, or the rest is empty.
    """
    kind, sep, rest = name.partition(":") if isinstance(name, str) else ("", "", "")
    if (
        not sep
        or kind not in CONTROL_KINDS
        or not rest
        or any(ch in rest for ch in "{}")
        or any(ch.isspace() for ch in rest)
    ):
        raise ConfigurationError(
            f"{name!r} is not a control name: write 'queue:<queue name>' (e.g. "
            f"'queue:emails'), 'task:<task name>' (e.g. 'task:proj.tasks.send_sms') or "
            f"'limit_key:<glob>' (e.g. 'limit_key:tenant:*'), "
            f"without braces or spaces."
        )
    return str(name)


def parse_limit(value: Any, *, burst: Any = None, name: str = "rate") -> RateLimit:
    """Return the limit *value* spells: a rate string, or ``{"rate": ..., "burst": ...}``.

    Raises:
        ConfigurationError: the rate or burst cannot be read, or is not positive.
    """
    if isinstance(value, Mapping):
        unknown = set(value) - {"rate", "burst"}
        if unknown or "rate" not in value:
            raise ConfigurationError(
                f"{name} must be a rate such as '100/s' or a dict "
                f"{{'rate': '100/s', 'burst': 500}}, got {dict(value)!r}."
            )
        if burst is None:
            burst = value.get("burst")
        value = value["rate"]
    text = str(value).strip() if isinstance(value, (str, int, float)) else ""
    ops, _, unit = text.partition("/")
    count: float | None
    try:
        count = float(ops) if unit in ("", *_PERIODS_MS) and not isinstance(value, bool) else None
        # The same rules as Celery's own rate limits (celery.utils.time.rate).
        if count is not None and celery_rate(text) <= 0:
            count = None
    except (ValueError, KeyError):
        count = None
    if count is None or not math.isfinite(count) or count <= 0:
        raise ConfigurationError(
            f"{name} {value!r} is not a rate: write Celery's format, a number of tasks per "
            f"second, minute or hour such as '100/s', '10/m' or '1000/h'."
        )
    period_ms = _PERIODS_MS[unit or "s"]
    if burst is None:
        # One second's worth: a quiet spell lets at most that go out at once.
        burst_n = max(1, math.ceil(count * 1000 / period_ms))
    elif isinstance(burst, int) and not isinstance(burst, bool) and burst >= 1:
        burst_n = burst
    else:
        raise ConfigurationError(
            f"the burst of {name} must be a whole number of tasks of at least 1, got {burst!r}."
        )
    return RateLimit(text=text, count=count, period_ms=period_ms, burst=burst_n)


def parse_limits(value: Any, *, setting: str = "zdelay_rate_limits") -> dict[str, RateLimit]:
    """Return ``zdelay_rate_limits`` parsed: control name -> limit.

    Raises:
        ConfigurationError: not a dict, or a name or rate in it is invalid.
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigurationError(
            f"{setting} must be a dict of control name -> rate, e.g. "
            f"{{'queue:emails': '100/s', 'task:proj.sms': '10/m'}}, got {value!r}."
        )
    return {
        control_name(key): parse_limit(rate, name=f"{setting}[{key!r}]")
        for key, rate in value.items()
    }
