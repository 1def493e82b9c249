"""What celery-zdelay keeps on each Celery app, beside its configuration.

Everything the library remembers per app is an attribute ``app._zdelay_<name>``,
and every one of them is named here, and set only through this module:

- ``_zdelay_config``: the checked configuration, cached by
  :func:`celery_zdelay.config.get_config` itself (this module builds on it,
  so it cannot be set from here without an import circle);
- ``_zdelay_parking``: what producers need (:class:`Producing`), with the
  :class:`~celery_zdelay.store.Store` every caller reaches Redis through
  (:func:`store_for`); built again when the configuration changes;
- the values of :data:`STATE`, each cached by the module that builds it
  through :func:`cached`, :func:`value` and :func:`set_value`;
- the two flags of a test binding (:mod:`celery_zdelay.testing`):
  :data:`RELEASED_BY_TEST` and :data:`PARK_WHEN_EAGER`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from .config import ZDelayConfig, get_config
from .entry_many import EntryEncoder
from .redis_layout import RedisLayout
from .store import Store

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "PARK_WHEN_EAGER",
    "RELEASED_BY_TEST",
    "STATE",
    "Producing",
    "cached",
    "producing",
    "set_value",
    "store_for",
    "value",
]

T = TypeVar("T")

#: Set on an app whose parked tasks a test releases itself (celery_zdelay.testing):
#: no companion is expected, so the first park does not warn there is none.
RELEASED_BY_TEST = "_zdelay_released_by_test"
#: Set on an app a test bound under ``task_always_eager``: park delayed calls
#: anyway, so the test can fast-forward them.
PARK_WHEN_EAGER = "_zdelay_park_when_eager"
_PRODUCING = "_zdelay_parking"

StateName = Literal["periodic", "event_sender", "capture_connection", "routes_producers", "since"]
#: The other per-app values: name -> attribute. Each is built by one module.
STATE: dict[StateName, str] = {
    # celery_zdelay.periodic.api: the PeriodicStore of the app's store.
    "periodic": "_zdelay_periodic",
    # celery_zdelay.events: the thread sending task events, per process.
    "event_sender": "_zdelay_event_sender",
    # celery_zdelay.capture: the one kombu Connection capturing producers use.
    "capture_connection": "_zdelay_capture_connection",
    # celery_zdelay.capture: app.producer_or_acquire is wrapped (once).
    "routes_producers": "_zdelay_routes_producers",
    # celery_zdelay.periodic.takeover: the --since time of `zdelay --beat`.
    "since": "_zdelay_beat_since",
}


@dataclass
class Producing:
    """What producers of one app configuration need to turn messages into entries."""

    config: ZDelayConfig
    store: Store
    #: Naming of the broker's queue lists when the broker is Redis.
    layout: RedisLayout | None
    #: Whether this process already looked for a live companion (first park).
    companion_checked: bool = False
    #: Kept for every park of this configuration: a call made the same way
    #: again has its template worked out once, not once per call.
    encoder: EntryEncoder = field(init=False)

    def __post_init__(self) -> None:
        signing_keys = self.config.signing_keys
        self.encoder = EntryEncoder(
            signing_keys[0] if signing_keys else None, whole=self.config.whole_messages
        )


def store_for(app: Celery) -> Store:
    """Return the store of *app*, built once per configuration."""
    return producing(app).store


def producing(app: Celery) -> Producing:
    """Return what producers of *app* need, built once per configuration (every park asks)."""
    config = get_config(app)
    cached_state: Producing | None = getattr(app, _PRODUCING, None)
    if cached_state is None or cached_state.config is not config:
        cached_state = Producing(config=config, store=Store(config), layout=_broker_layout(app))
        setattr(app, _PRODUCING, cached_state)
    return cached_state


def _broker_layout(app: Celery) -> RedisLayout | None:
    connection = app.connection_for_write()
    try:
        if connection.transport.driver_type != "redis":
            return None
        return RedisLayout(connection.transport_options)
    finally:
        connection.release()


def value(app: Celery, name: StateName) -> Any:
    """Return the value *name* of *app*, or None when it was never set."""
    return getattr(app, STATE[name], None)


def set_value(app: Celery, name: StateName, new: Any) -> None:
    """Set the value *name* of *app*."""
    setattr(app, STATE[name], new)


def cached(
    app: Celery,
    name: StateName,
    build: Callable[[], T],
    *,
    valid: Callable[[T], bool] | None = None,
) -> T:
    """Return the value *name* of *app*, built by *build* when missing or not *valid*."""
    current: T | None = getattr(app, STATE[name], None)
    if current is None or (valid is not None and not valid(current)):
        current = build()
        setattr(app, STATE[name], current)
    return current
