"""Release control from Python: rate limits, pauses and concurrency, per queue, task or limit key.

A control name is ``"queue:<queue>"``, ``"task:<task name>"`` or
``"limit_key:<glob>"`` (a bucket per distinct ``limit_key=`` the glob
matches). Limits come
from ``app.conf.zdelay_rate_limits`` and from :func:`set_rate_limit` (stored
in Redis, which wins over the setting, so a change needs no restart); pauses
from :func:`pause`/:func:`resume` (stored in Redis: durable). Every companion
reads both every :data:`~celery_zdelay.companion.gate.REFRESH_SECONDS`, and a
change wakes them. Concurrency controls come from ``app.conf.zdelay_concurrency``
(see :mod:`celery_zdelay.concurrency`) and from :func:`set_concurrency` (stored
in Redis, which wins over the setting); :func:`controls` shows how many of each
are running. *app* defaults to ``celery.current_app``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import celery

from . import signals
from ._format import utc
from .app_state import store_for
from .concurrency import effective_concurrency
from .config import get_config
from .errors import ConfigurationError
from .rates import RateLimit, control_name, parse_limit
from .steering import audit_line
from .store.control import ControlStore, is_key_lane, lane_group

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "RUNNING_KEYS_SHOWN",
    "ControlInfo",
    "UnknownControlWarning",
    "concurrency",
    "controls",
    "pause",
    "rate_limits",
    "resume",
    "set_concurrency",
    "set_rate_limit",
]


class UnknownControlWarning(UserWarning):
    """Warned when a limit or pause names a queue or task the app does not know.

    It is applied all the same (a queue may be created on demand, a task
    module not imported here); the message says what to check.
    """


#: Most distinct limit keys :func:`controls` sums the running count of one
#: ``limit_key:`` concurrency control over (a listing must stay cheap).
RUNNING_KEYS_SHOWN = 1000


@dataclass(frozen=True)
class ControlInfo:
    """What limits and pauses one queue or task, and what waits for it."""

    #: ``"queue:<name>"``, ``"task:<name>"`` or ``"limit_key:<glob>"``.
    name: str
    #: The limit in force, or None.
    limit: RateLimit | None
    #: Where the limit comes from: ``"setting"``, ``"runtime"`` or None.
    source: str | None
    #: Ms (Redis clock) since the name is paused, or None when it is not.
    paused_since_ms: int | None
    #: Entries held back by this control, all shards (for a
    #: ``limit_key:<glob>``: by the limits of all the keys it matches).
    waiting: int
    #: ``zdelay_concurrency``: most released and not finished (for a
    #: ``limit_key:`` glob, per distinct key), or None.
    concurrency: int | None = None
    #: Where the concurrency comes from: ``"setting"``, ``"runtime"`` or None.
    concurrency_source: str | None = None
    #: Tasks released and not finished under it (live slots); for a glob,
    #: summed over its keys (at most :data:`RUNNING_KEYS_SHOWN` of them).
    running: int = 0
    #: For a ``limit_key:`` glob: its keys with a task running.
    running_keys: int = 0
    #: Whether the glob had more keys with slots than were summed.
    running_cut: bool = False
    #: For a ``limit_key:<glob>``: how many distinct keys have entries held
    #: (each in a lane of its own); 0 for other controls. Keys are counted,
    #: never listed: a million keys make one row.
    held_keys: int = 0

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "rate": self.limit.text if self.limit else None,
            "burst": self.limit.burst if self.limit else None,
            "source": self.source,
            "paused": self.paused_since_ms is not None,
            "paused_since_ms": self.paused_since_ms,
            "waiting": self.waiting,
            "concurrency": self.concurrency,
            "concurrency_source": self.concurrency_source,
            "running": self.running,
            "running_keys": self.running_keys,
            "running_cut": self.running_cut,
            "held_keys": self.held_keys,
        }


def set_rate_limit(
    name: str,
    rate: Any,
    *,
    burst: int | None = None,
    app: Celery | None = None,
    by: str | None = None,
) -> RateLimit | None:
    """Limit how fast parked tasks of *name* are released, for every companion at once.

    *rate* is Celery's format (``"50/s"``, ``"10/m"``, ``"1000/h"``); *burst*
    the most released at once (default: one second's worth). ``None``
    removes the limit, that of ``zdelay_rate_limits`` too. Takes effect
    without restarting companions (within
    :data:`~celery_zdelay.companion.gate.REFRESH_SECONDS`). Returns the limit.
    With ``zdelay_audit_log``, the change is logged with *by* (who set it).

    Raises:
        ConfigurationError: *name* or *rate* cannot be read; nothing was stored.
    """
    app = _app(app)
    name = control_name(name)
    limit = None if rate is None else parse_limit(rate, burst=burst, name=f"the rate of {name}")
    if limit is not None:
        _warn_unknown(app, name)
    in_settings = name in get_config(app).rate_limits
    ControlStore(store_for(app)).set_limit(name, limit, tombstone=in_settings)
    if limit is None:
        _changed(app, name, by, "Rate limit of %s removed")
    else:
        _changed(app, name, by, "Rate limit of %s set to %s (burst %s)", limit.text, limit.burst)
    return limit


def rate_limits(*, app: Celery | None = None) -> dict[str, RateLimit]:
    """Return the limits in force: the settings, overridden by those set at run time."""
    app = _app(app)
    limits = dict(get_config(app).rate_limits)
    for name, limit in ControlStore(store_for(app)).read().limits.items():
        if limit is None:
            limits.pop(name, None)
        else:
            limits[name] = limit
    return limits


def set_concurrency(
    name: str, most: Any, *, app: Celery | None = None, by: str | None = None
) -> int | None:
    """Release at most *most* tasks of *name* that have not finished, for every companion at once.

    *name* is a control name as in ``zdelay_concurrency``
    (``"task:proj.export"``, ``"queue:reports"``, or ``"limit_key:<glob>"``
    for *most* per distinct limit key); ``None`` removes the control, that
    of ``zdelay_concurrency`` too. Stored in Redis, it wins over the
    setting and needs no restart: a new number, or a removal, applies
    within :data:`~celery_zdelay.companion.gate.REFRESH_SECONDS`; a name
    the setting does not have applies
    :data:`~celery_zdelay.concurrency.CONCURRENCY_SETTLE_MS` later (workers
    learn it first, so that they free its slots). Tasks released before
    the control applied took no slot and are not counted. Returns *most*.
    With ``zdelay_audit_log``, the change is logged with *by* (who set it).

    Raises:
        ConfigurationError: *name* or *most* cannot be read; nothing was stored.
    """
    app = _app(app)
    name = control_name(name)
    if most is not None:
        if isinstance(most, bool) or not isinstance(most, int) or most < 1:
            raise ConfigurationError(
                f"The concurrency of {name} must be a whole number of tasks of at least 1 "
                f"(how many may be released and not finished at once), got {most!r}. To "
                f"lift the control, give None (on the command line: off). Nothing was stored."
            )
        _warn_unknown(app, name)
    ControlStore(store_for(app)).set_concurrency(name, most)
    if most is None:
        _changed(app, name, by, "Concurrency of %s removed")
    else:
        _changed(app, name, by, "Concurrency of %s set to %s", most)
    return most  # type: ignore[no-any-return]  # an int, checked above


def concurrency(*, app: Celery | None = None) -> dict[str, int]:
    """Return the concurrency controls in force: the settings, overridden by those set at run time.

    (A name new to the settings counts from when companions apply it: see
    :func:`set_concurrency`.)
    """
    app = _app(app)
    state = ControlStore(store_for(app)).read()
    return effective_concurrency(
        get_config(app).concurrency, state.concurrency, now_ms=state.now_ms
    )


def pause(name: str, *, app: Celery | None = None, by: str | None = None) -> int:
    """Hold back every release of *name* until :func:`resume`; return since when (ms).

    Durable: stored in Redis, it survives companion restarts. Entries stay
    parked, in due order. Every companion applies it within
    :data:`~celery_zdelay.companion.gate.REFRESH_SECONDS` (plus the batch it
    is releasing). Pausing a paused name keeps its first time. With
    ``zdelay_audit_log``, the pause is logged with *by* (who paused).

    Raises:
        ConfigurationError: *name* is not ``queue:<name>`` or ``task:<name>``.
    """
    app = _app(app)
    name = control_name(name)
    _warn_unknown(app, name)
    since = ControlStore(store_for(app)).pause(name)
    _changed(app, name, by, "Paused %s (since %s)", utc(since))
    return since


def resume(name: str, *, app: Celery | None = None, by: str | None = None) -> bool:
    """Release *name* again, overdue entries first (under its limit); return whether it was paused.

    With ``zdelay_audit_log``, a resume of a paused name is logged with *by*.

    Raises:
        ConfigurationError: *name* is not ``queue:<name>`` or ``task:<name>``.
    """
    app = _app(app)
    name = control_name(name)
    was_paused = ControlStore(store_for(app)).resume(name)
    if was_paused:
        _changed(app, name, by, "Resumed %s")
    return was_paused


def controls(*, app: Celery | None = None) -> list[ControlInfo]:
    """Return every limited, paused or concurrency-controlled name, and every name holding entries.

    Entries held by per-key limits count under their ``limit_key:<glob>``
    (:attr:`ControlInfo.held_keys` says how many keys): one row per glob
    whatever the number of keys. Reading costs one round trip per shard
    plus one count per held set (pipelined per shard), so it grows with the
    keys that have entries held now, not with idle ones. The running count
    of a ``limit_key:`` concurrency control costs a read per distinct key
    with a task running, at most :data:`RUNNING_KEYS_SHOWN`.
    """
    app = _app(app)
    store = store_for(app)
    control = ControlStore(store)
    settings = get_config(app).rate_limits
    state = control.read()
    concurrency = effective_concurrency(
        get_config(app).concurrency, state.concurrency, now_ms=state.now_ms
    )
    running = {name: control.running(name, keys_at_most=RUNNING_KEYS_SHOWN) for name in concurrency}
    limits = rate_limits(app=app)
    known = {*limits, *state.paused, *concurrency}
    waiting: dict[str, int] = {}
    held_keys: dict[str, set[str]] = {}
    for shard, lanes in control.lanes(store.shards).items():
        for lane, count in control.held_counts(shard, sorted(lanes)).items():
            name = lane_group(lane, known)
            waiting[name] = waiting.get(name, 0) + count
            if is_key_lane(lane) and lane != name and count:
                held_keys.setdefault(name, set()).add(lane)
    names = sorted(
        set(limits) | set(state.paused) | set(concurrency) | {n for n, c in waiting.items() if c}
    )
    return [
        ControlInfo(
            name=name,
            limit=limits.get(name),
            source=(
                None
                if name not in limits
                else "runtime"
                if state.limits.get(name) is not None
                else "setting"
            ),
            paused_since_ms=state.paused.get(name),
            waiting=waiting.get(name, 0),
            concurrency=concurrency.get(name),
            concurrency_source=(
                None
                if name not in concurrency
                else "runtime"
                if state.concurrency.get(name, (None, 0))[0] is not None
                else "setting"
            ),
            running=running[name][0] if name in running else 0,
            running_keys=running[name][1] if name in running else 0,
            running_cut=running[name][2] if name in running else False,
            held_keys=len(held_keys.get(name, ())),
        )
        for name in names
        if name in limits
        or name in state.paused
        or name in settings
        or name in concurrency
        or waiting.get(name)
    ]


def _warn_unknown(app: Celery, name: str) -> None:
    kind, _, rest = name.partition(":")
    if is_key_lane(name):
        return  # any key may come: limit keys are not declared anywhere
    if kind == "queue":
        known = set(app.amqp.queues) | {app.conf.task_default_queue}
        if rest not in known:
            warnings.warn(
                f"{name}: the app knows no queue {rest!r} (task_queues, task_routes, "
                f"task_default_queue). Check the spelling; the control applies all the same.",
                UnknownControlWarning,
                stacklevel=3,
            )
    elif rest not in app.tasks:
        warnings.warn(
            f"{name}: the app knows no task {rest!r}. Check the spelling, or import the "
            f"module that defines it (imports, include=); the control applies all the same.",
            UnknownControlWarning,
            stacklevel=3,
        )


def _changed(app: Celery, name: str, by: str | None, message: str, *args: Any) -> None:
    """Tell of a control change: its audit line (``zdelay_audit_log``), as steering
    writes one, and :data:`~celery_zdelay.signals.control_changed`."""
    audit_line(app, message, name, *args, by=by, control=name)
    signals.control_changed.send(sender=app, name=name, change=message % (name, *args), by=by)


def _app(app: Celery | None) -> Celery:
    return app if app is not None else celery.current_app
