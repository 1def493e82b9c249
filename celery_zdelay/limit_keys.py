"""``limit_key=`` on the producer side: checked, carried in a header, warned about once.

``task.apply_delayed(..., limit_key="tenant:42")`` names the business key
(a customer, a tenant, a partner account) whose own limits the task is
released under: a ``"limit_key:<glob>"`` limit matching it gives every
distinct key a token bucket of its own (see :mod:`celery_zdelay.rates` and
:mod:`celery_zdelay.companion.gate`). The key travels in the parked
message's ``zdelay_limit_key`` header, so the companion reads it with the
message and the store needs no index of it.
"""

from __future__ import annotations

import threading
import warnings
from typing import TYPE_CHECKING, Any

from .config import get_config
from .names import validate_limit_key
from .rates import LIMIT_KEY, key_control
from .store.headers import LIMIT_KEY_HEADER

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["MAX_WARNED_PATTERNS", "UnmatchedLimitKeyWarning", "take_limit_key"]

#: Most key patterns warned about per process (see :func:`take_limit_key`):
#: past that many, no more warnings, so a stream of distinct keys without a
#: limit does not grow this memory without bound.
MAX_WARNED_PATTERNS = 1_000

_warned: set[str] = set()
_warned_lock = threading.Lock()


class UnmatchedLimitKeyWarning(UserWarning):
    """Warned when a task is parked with a ``limit_key`` that no per-key limit matches.

    The task is parked and released all the same, under no per-key limit;
    the message says what to configure.
    """


def take_limit_key(app: Celery, options: dict[str, Any]) -> None:
    """Pop ``limit_key=`` from *options* into its headers, checked.

    Warns (:class:`UnmatchedLimitKeyWarning`) when no ``limit_key:<glob>``
    of ``zdelay_rate_limits`` or ``zdelay_concurrency`` matches the key, and
    the settings limit no queue or task (under which keys take turns):
    once per process per key pattern, the key with its last ``:``-part
    replaced by ``*`` (``tenant:42`` -> ``tenant:*``). Limits set at run
    time (:func:`celery_zdelay.set_rate_limit`) are not read here: parking
    costs no round trip for a warning.

    Raises:
        ConfigurationError: the key breaks the rule of :mod:`celery_zdelay.names`;
            nothing was parked.
    """
    limit_key = options.pop("limit_key", None)
    if limit_key is None:
        return
    validate_limit_key(limit_key)
    headers = dict(options.get("headers") or {})
    headers[LIMIT_KEY_HEADER] = limit_key
    options["headers"] = headers
    _warn_unmatched(app, limit_key)


def _warn_unmatched(app: Celery, limit_key: str) -> None:
    names = set(get_config(app).rate_limits)
    if any(name.startswith(("queue:", "task:")) for name in names):
        # The key has a use without a limit of its own: the tenants take
        # turns under a queue's or task's limit (store.control.fair_lane).
        return
    concurrency = app.conf.get("zdelay_concurrency")
    if isinstance(concurrency, dict):
        names.update(name for name in concurrency if isinstance(name, str))
    if key_control(limit_key, names) is not None:
        return
    head, sep, _ = limit_key.rpartition(":")
    pattern = f"{head}:*" if sep else limit_key
    with _warned_lock:
        if pattern in _warned or len(_warned) >= MAX_WARNED_PATTERNS:
            return
        _warned.add(pattern)
    warnings.warn(
        f"limit_key={limit_key!r} matches no {LIMIT_KEY}:<glob> limit, so it limits "
        f"nothing: the task is parked and released as if it had none (but for taking "
        f"turns with other keys when a pause holds it). Add one to "
        f"zdelay_rate_limits (e.g. {{'{LIMIT_KEY}:{pattern}': '5/s'}}, a bucket per key) "
        f"or zdelay_concurrency, or set it at run time with celery_zdelay.set_rate_limit.",
        UnmatchedLimitKeyWarning,
        stacklevel=4,
    )
