"""The ``zdelay_*`` settings, read once from ``app.conf`` into a frozen object.

Every setting is documented in ``docs/settings.rst``; :func:`get_config` is
the only place that reads them, validates them and applies the defaults.
"""

from __future__ import annotations

import difflib
import logging
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from kombu.utils.url import maybe_sanitize_url

from . import stale
from .concurrency import parse_concurrency
from .errors import ConfigurationError
from .rates import RateLimit, parse_limits

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "RENAMED_SETTINGS",
    "SETTINGS",
    "RetryPolicy",
    "ZDelayConfig",
    "get_config",
    "setting_name",
    "unknown_settings",
]

#: Prefix of every key celery-zdelay writes (inside the shard hash tag).
DEFAULT_KEY_PREFIX = "zdelay"
#: Number of shards entries are spread over by task id.
DEFAULT_SHARDS = 1
#: Most entries one claim call moves; bounds the Redis time of each call.
DEFAULT_BATCH_SIZE = 200
#: Seconds a companion owns the entries it claimed before others may take them.
DEFAULT_LEASE_SECONDS = 30.0
#: How producers retry an unreachable store before raising (Celery's keys).
DEFAULT_RETRY_POLICY: Mapping[str, float] = {
    "max_retries": 3,
    "interval_start": 0.0,
    "interval_step": 0.2,
    "interval_max": 1.0,
}

#: Most seconds a released task's run is taken to last: its on_key="until_finished"
#: key, its periodic overlap key and its concurrency slots are freed this long
#: after the release when no worker reports the run ended (a worker was lost).
DEFAULT_MAX_RUN_SECONDS = 3600.0

#: Seconds a task id's history is kept after its last event (0: none is
#: recorded). See docs/performance.rst for the figures behind it.
DEFAULT_HISTORY_SECONDS = 86400.0

#: Largest zdelay_release_ahead_seconds: a task released ahead waits on a
#: worker's ETA timer, in its memory, for that long; beyond a second that
#: is the native ETA this package exists to avoid.
MAX_RELEASE_AHEAD_SECONDS = 1.0

#: Largest batch: Lua's unpack() limit keeps one call's arguments below 8000.
MAX_BATCH_SIZE = 2000
#: Largest shard count; keys of each shard are scanned by status.
MAX_SHARDS = 1024

#: Every setting celery-zdelay reads, with a one-line description.
SETTINGS: Mapping[str, str] = {
    "zdelay_redis_url": "Redis URL of the store (redis://, rediss://, unix://, sentinel://)",
    "zdelay_redis_options": "extra keyword arguments for the redis-py client",
    "zdelay_key_prefix": "prefix of every key the store writes",
    "zdelay_shards": "number of shards entries are spread over",
    "zdelay_batch_size": "most entries a companion claims per call",
    "zdelay_lease_seconds": "seconds a companion owns what it claimed",
    "zdelay_threshold": "park every ETA at least this many seconds away",
    "zdelay_signing_key": "HMAC key (or list, newest first) signing entries",
    "zdelay_retry_policy": "how producers retry an unreachable store",
    "zdelay_worker_dedupe": "workers drop a second delivery of a released id",
    "zdelay_shard_leases": "companions own shards instead of all claiming from all",
    "zdelay_beat": "companions serve beat_schedule (periodic tasks) instead of celery beat",
    "zdelay_audit_log": "log one INFO line per released, cancelled, rescheduled or dead task",
    "zdelay_whole_messages": "park messages exactly as pushed: a faster handoff, more Redis memory",
    "zdelay_rate_limits": "release rate limits per queue or task, global across companions",
    "zdelay_max_run_seconds": "most seconds a run's until_finished key and slots stay taken",
    "zdelay_max_late": "most seconds after its due time a task is still released as usual",
    "zdelay_on_stale": 'what a release past max_late does: "dead", "drop" or "run"',
    "zdelay_concurrency": "most tasks released and not finished, per queue, task or limit key",
    "zdelay_history_seconds": "seconds a task's history is kept after its last event (0: off)",
    "zdelay_release_ahead_seconds": "release this many seconds before due, eta set (0: off)",
}

#: Old names of settings -> their names now. An old name still works, with a
#: DeprecationWarning and a logged warning; setting both names is an error.
RENAMED_SETTINGS: Mapping[str, str] = {
    # "hold" means a task held back by a control; a run's key and slots are not held.
    "zdelay_key_hold_seconds": "zdelay_max_run_seconds",
}

_REDIS_SCHEMES = ("redis", "rediss", "unix", "sentinel")
#: Keys whose change (set on ``app.conf``) means the settings must be read again.
_WATCHED = (
    *SETTINGS,
    *RENAMED_SETTINGS,
    "broker_url",
    "broker_write_url",
    "broker_transport_options",
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of store calls, spelled like Celery's ``task_publish_retry_policy``."""

    max_retries: int
    interval_start: float
    interval_step: float
    interval_max: float

    def intervals(self) -> list[float]:
        """Return the pause before each retry, in seconds."""
        return [
            min(self.interval_start + i * self.interval_step, self.interval_max)
            for i in range(self.max_retries)
        ]


@dataclass(frozen=True)
class ZDelayConfig:
    """Validated ``zdelay_*`` settings of one Celery app."""

    #: ``zdelay_redis_url``, else the broker URL when the broker is Redis.
    store_url: str | None
    redis_options: Mapping[str, Any]
    key_prefix: str
    shards: int
    batch_size: int
    lease_ms: int
    threshold_ms: int | None
    signing_keys: tuple[bytes, ...]
    retry_policy: RetryPolicy
    worker_dedupe: bool
    shard_leases: bool
    #: Log each released, cancelled, rescheduled and dead-lettered task (logger
    #: ``celery_zdelay.audit``).
    audit_log: bool = False
    #: Why there is no store URL (the broker is not Redis and none is set).
    missing_store: str | None = None
    beat: bool = False
    #: Park each message exactly as the handoff pushes it instead of as a
    #: template shared by the task's calls and its per-call values: the
    #: handoff then moves it without building a string, faster, at the cost
    #: of more Redis memory per parked task.
    whole_messages: bool = False
    #: Release rate limits: control name (``queue:<q>``/``task:<t>``) -> limit;
    #: a limit set at run time (:func:`celery_zdelay.set_rate_limit`) overrides it.
    rate_limits: Mapping[str, RateLimit] = field(default_factory=dict)
    #: ``zdelay_max_run_seconds`` in ms: how long after the release a run's
    #: ``until_finished`` key (or periodic overlap key) and concurrency slots
    #: stay taken if no worker reports the task finished.
    max_run_ms: int = round(DEFAULT_MAX_RUN_SECONDS * 1000)
    #: ``zdelay_max_late`` in ms (None: no limit), applied by the companions
    #: at release to entries parked without their own ``max_late``.
    max_late_ms: int | None = None
    #: ``zdelay_on_stale``: what a release past the limit does (see stale.py).
    on_stale: str = "dead"
    #: ``zdelay_concurrency``: control name -> most tasks released and not
    #: finished. A slot is taken at most :attr:`max_run_ms` after the release.
    concurrency: Mapping[str, int] = field(default_factory=dict)
    #: ``zdelay_history_seconds`` in ms: how long a task id's history (see
    #: :func:`celery_zdelay.history`) is kept after its last event; 0 records none.
    history_ms: int = round(DEFAULT_HISTORY_SECONDS * 1000)
    #: ``zdelay_release_ahead_seconds`` in ms (0: off): companions release a
    #: task up to this long before it is due, with its ``eta`` set to its due
    #: time, so that the worker's own ETA timer starts it on time.
    release_ahead_ms: int = 0

    @property
    def redis_url(self) -> str:
        """The store's URL.

        Raises:
            ConfigurationError: the broker is not Redis and ``zdelay_redis_url``
                is unset. Parked tasks must not go to whatever Redis happens
                to answer on localhost, so there is no default.
        """
        if self.store_url is None:
            raise ConfigurationError(self.missing_store or "zdelay_redis_url is not set.")
        return self.store_url


def get_config(app: Celery) -> ZDelayConfig:
    """Return the validated settings of *app*, cached until they change.

    Raises:
        ConfigurationError: a ``zdelay_*`` setting is invalid or unknown; the
            message names it.
    """
    # Reading a Celery setting costs microseconds, and this runs on every
    # park: the settings are read again only when the app's configuration
    # object is replaced (config_from_object) or a watched key is set on it.
    # (A dict value changed in place goes unnoticed: assign a new dict.)
    conf = app.conf
    changes = conf.changes
    stamp = (id(conf), *(changes.get(key) for key in _WATCHED))
    cached = getattr(app, "_zdelay_config", None)
    if cached is not None and cached[0] == stamp:
        config: ZDelayConfig = cached[1]
        return config
    unknown = unknown_settings(app)
    if unknown:
        raise ConfigurationError(unknown[0])
    raw = {key: _lookup(app, key) for key in SETTINGS}
    _read_renamed(app, raw)
    config = _build(
        raw, conf.broker_transport_options, _broker_url(app), setting_name(app, "zdelay_redis_url")
    )
    app._zdelay_config = (stamp, config)
    return config


def _lookup(app: Celery, key: str) -> Any:
    # Under a namespace (Django's namespace="CELERY"), Celery's settings view
    # finds CELERY_ZDELAY_THRESHOLD for zdelay_threshold itself.
    return app.conf.get(key)


def _read_renamed(app: Celery, raw: dict[str, Any]) -> None:
    """Put the value of each renamed setting set under its old name into *raw*, with a warning.

    Raises:
        ConfigurationError: both the old and the new name are set.
    """
    for old, new in RENAMED_SETTINGS.items():
        value = _lookup(app, old)
        if value is None:
            continue
        old_name, new_name = setting_name(app, old), setting_name(app, new)
        if raw[new] is not None:
            raise ConfigurationError(
                f"{old_name} and {new_name} are both set: {old_name} is the old name of "
                f"{new_name}. Keep {new_name} only."
            )
        raw[new] = value
        # Once per app and name: the settings are read again when they change.
        warned: set[str] = app.__dict__.setdefault("_zdelay_warned_renamed", set())
        if old not in warned:
            warned.add(old)
            message = (
                f"{old_name} is deprecated: rename it to {new_name} (same meaning, same value)."
            )
            warnings.warn(message, DeprecationWarning, stacklevel=3)
            logger.warning("%s", message)


def _broker_url(app: Celery) -> str | None:
    url = app.conf.broker_write_url or app.conf.broker_url
    if isinstance(url, (list, tuple)):
        url = url[0] if url else None
    if isinstance(url, str) and ";" in url and not url.startswith("sentinel://"):
        url = url.split(";", 1)[0]  # a failover list: the first broker
    return url if isinstance(url, str) else None


def setting_name(app: Celery, key: str) -> str:
    """Return how *app* spells setting *key*: ``CELERY_ZDELAY_…`` under a Django namespace."""
    namespace = getattr(app, "namespace", None)
    return f"{namespace}_{key}".upper() if namespace else key


def unknown_settings(app: Celery) -> list[str]:
    """Return one message per ``zdelay_*`` name in *app*'s configuration that is not a setting.

    A misspelt setting is otherwise silently ignored: a misspelt threshold
    turns transparent mode off. Each message suggests the right spelling, in
    the spelling of the app's namespace (``CELERY_ZDELAY_THRESHOLD`` in a
    Django project).
    """
    messages = []
    for key in list(app.conf.keys()):
        name = str(key).lower()
        if name.startswith("celery_"):
            name = name[len("celery_") :]
        if name.startswith("zdelay_") and name not in SETTINGS and name not in RENAMED_SETTINGS:
            # Spelled as the user spelled the key: CELERY_ZDELAY_... in Django.
            prefix = str(key)[: len(str(key)) - len(name)]
            upper = str(key).isupper()
            names = [(prefix + s).upper() if upper else prefix + s for s in SETTINGS]
            close = difflib.get_close_matches(name, SETTINGS, n=1)
            hint = f" Did you mean {names[list(SETTINGS).index(close[0])]}?" if close else ""
            messages.append(
                f"Unknown setting {key}.{hint} The celery-zdelay settings are: "
                + ", ".join(names)
                + "."
            )
    return messages


def _build(
    raw: dict[str, Any],
    broker_options: Mapping[str, Any] | None,
    broker_url: str | None,
    url_name: str,
) -> ZDelayConfig:
    redis_url = _redis_url(raw["zdelay_redis_url"], broker_url)
    redis_options = dict(_mapping("zdelay_redis_options", raw["zdelay_redis_options"]))
    missing = None
    if redis_url is None:
        missing = (
            f"The broker ({maybe_sanitize_url(broker_url or 'none set')}) is not Redis, so "
            f"celery-zdelay needs a Redis of its own for parked tasks: set {url_name}, "
            f'e.g. {url_name} = "redis://localhost:6379/1".'
        )
    if (
        redis_url is not None
        and redis_url == broker_url
        and redis_url.startswith("sentinel://")
        and broker_options
    ):
        # The store is the broker's Sentinel group: find its master the same way.
        for name in ("master_name", "sentinel_kwargs"):
            if name in broker_options:
                redis_options.setdefault(name, broker_options[name])
    signing_keys = _signing_keys(raw["zdelay_signing_key"])
    whole_messages = _flag("zdelay_whole_messages", raw["zdelay_whole_messages"])
    if whole_messages and signing_keys:
        raise ConfigurationError(
            "zdelay_whole_messages cannot be combined with zdelay_signing_key: a message "
            "parked whole is pushed as it is, with no signature to check. Unset one of them "
            "(signed entries are checked by the companion, which then never takes the "
            "atomic handoff that zdelay_whole_messages speeds up)."
        )
    return ZDelayConfig(
        store_url=redis_url,
        missing_store=missing,
        redis_options=redis_options,
        key_prefix=_key_prefix(raw["zdelay_key_prefix"]),
        shards=_integer("zdelay_shards", raw["zdelay_shards"], DEFAULT_SHARDS, 1, MAX_SHARDS),
        batch_size=_integer(
            "zdelay_batch_size", raw["zdelay_batch_size"], DEFAULT_BATCH_SIZE, 1, MAX_BATCH_SIZE
        ),
        lease_ms=_seconds_ms(
            "zdelay_lease_seconds", raw["zdelay_lease_seconds"], DEFAULT_LEASE_SECONDS, 1.0
        ),
        threshold_ms=(
            None
            if raw["zdelay_threshold"] is None
            else _seconds_ms("zdelay_threshold", raw["zdelay_threshold"], 0.0, 0.0)
        ),
        signing_keys=signing_keys,
        retry_policy=_retry_policy(raw["zdelay_retry_policy"]),
        worker_dedupe=_flag("zdelay_worker_dedupe", raw["zdelay_worker_dedupe"]),
        shard_leases=_flag("zdelay_shard_leases", raw["zdelay_shard_leases"]),
        beat=_flag("zdelay_beat", raw["zdelay_beat"]),
        audit_log=_flag("zdelay_audit_log", raw["zdelay_audit_log"]),
        whole_messages=whole_messages,
        rate_limits=parse_limits(raw["zdelay_rate_limits"]),
        max_run_ms=_seconds_ms(
            "zdelay_max_run_seconds",
            raw["zdelay_max_run_seconds"],
            DEFAULT_MAX_RUN_SECONDS,
            0.001,
        ),
        max_late_ms=stale.max_late_ms(raw["zdelay_max_late"], "zdelay_max_late"),
        on_stale=stale.on_stale(raw["zdelay_on_stale"]),
        concurrency=parse_concurrency(raw["zdelay_concurrency"]),
        history_ms=_seconds_ms(
            "zdelay_history_seconds", raw["zdelay_history_seconds"], DEFAULT_HISTORY_SECONDS, 0.0
        ),
        release_ahead_ms=_release_ahead_ms(raw["zdelay_release_ahead_seconds"]),
    )


def _redis_url(value: Any, broker_url: str | None) -> str | None:
    if value is None:
        if broker_url and urlsplit(broker_url).scheme in _REDIS_SCHEMES:
            return broker_url
        return None
    if not isinstance(value, str) or urlsplit(value).scheme not in _REDIS_SCHEMES:
        raise ConfigurationError(
            "zdelay_redis_url must be a redis://, rediss://, unix:// or sentinel:// URL, "
            f"got {value!r}."
        )
    return value


def _mapping(key: str, value: Any) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigurationError(f"{key} must be a dict of keyword arguments, got {value!r}.")
    return dict(value)


def _key_prefix(value: Any) -> str:
    if value is None:
        return DEFAULT_KEY_PREFIX
    if (
        not isinstance(value, str)
        or not value
        or any(ch in value for ch in "{}")
        or any(ch.isspace() for ch in value)
    ):
        raise ConfigurationError(
            f"zdelay_key_prefix must be a non-empty string without braces or spaces "
            f"(the store adds the hash tag itself), got {value!r}."
        )
    return value


def _integer(key: str, value: Any, default: int, low: int, high: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigurationError(f"{key} must be an integer from {low} to {high}, got {value!r}.")
    return value


def _seconds_ms(key: str, value: Any, default: float, low: float) -> int:
    if value is None:
        value = default
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < low
    ):
        raise ConfigurationError(
            f"{key} must be a number of seconds of at least {low:g}, got {value!r}."
        )
    return math.ceil(value * 1000)


def _release_ahead_ms(value: Any) -> int:
    if value is None:
        return 0
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 <= value <= MAX_RELEASE_AHEAD_SECONDS
    ):
        raise ConfigurationError(
            "zdelay_release_ahead_seconds must be a number of seconds from 0 (off) to "
            f"{MAX_RELEASE_AHEAD_SECONDS:g}, e.g. 0.005 for 5 ms, got {value!r}."
        )
    return math.ceil(value * 1000)


def _flag(key: str, value: Any) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConfigurationError(f"{key} must be True or False, got {value!r}.")
    return value


def _signing_keys(value: Any) -> tuple[bytes, ...]:
    if value is None:
        return ()
    keys = value if isinstance(value, (list, tuple)) else [value]
    result = []
    for key in keys:
        secret = key.encode() if isinstance(key, str) else key
        if not isinstance(secret, bytes) or len(secret) < 16:
            raise ConfigurationError(
                "zdelay_signing_key must be a key of at least 16 bytes (str or bytes), "
                "or a list of them with the current key first."
            )
        result.append(secret)
    return tuple(result)


def _retry_policy(value: Any) -> RetryPolicy:
    merged = dict(DEFAULT_RETRY_POLICY)
    if value is not None:
        if not isinstance(value, Mapping) or set(value) - set(DEFAULT_RETRY_POLICY):
            raise ConfigurationError(
                "zdelay_retry_policy must be a dict with keys among "
                f"{', '.join(DEFAULT_RETRY_POLICY)}, got {value!r}."
            )
        merged.update(value)
    for key, number in merged.items():
        if isinstance(number, bool) or not isinstance(number, (int, float)) or number < 0:
            raise ConfigurationError(
                f"zdelay_retry_policy[{key!r}] must be a number of at least 0, got {number!r}."
            )
    return RetryPolicy(
        max_retries=int(merged["max_retries"]),
        interval_start=float(merged["interval_start"]),
        interval_step=float(merged["interval_step"]),
        interval_max=float(merged["interval_max"]),
    )
