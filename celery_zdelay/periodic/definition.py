"""A periodic task as the companions serve it: read from ``beat_schedule``, stored as JSON.

A :class:`Definition` is what Redis holds for one schedule entry: the task
name, its arguments and options, and the schedule as a small JSON spec that
rebuilds Celery's own schedule class (``schedule``, ``crontab``, ``solar``).
Everything must survive a JSON round trip, because every companion serves
what is stored, not what its own configuration says.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone, tzinfo
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from celery.schedules import BaseSchedule, crontab, schedule, solar

from ..errors import ConfigurationError
from ..names import refused_character
from ..schedule import jitter_ms
from .clocked import ClockedAt
from .recent import Recent

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "MISSED_POLICIES",
    "OVERLAP_POLICIES",
    "SOURCE_API",
    "SOURCE_CONFIG",
    "SOURCE_DJANGO_BEAT",
    "Definition",
    "config_hash",
    "definitions_from_config",
    "entry_copy",
    "same_entry",
    "schedule_name",
]

#: What happens to occurrences no companion released in time (all were
#: down, or the broker was): ``once`` runs one for the whole gap, the first
#: of them (as celery beat runs one), ``skip`` none, ``all`` every one of them.
MISSED_POLICIES = ("once", "skip", "all")
#: What an occurrence does when the schedule's previous run is still going
#: (a worker reports start and finish, see :mod:`celery_zdelay.periodic.overlap`):
#: ``allow`` runs it anyway (celery beat's behaviour), ``skip`` drops it,
#: ``buffer_one`` waits for the previous run to end (one waits at most; the
#: others are skipped).
OVERLAP_POLICIES = ("allow", "skip", "buffer_one")
#: Largest ``zdelay_overlap_timeout`` (seconds): a week.
MAX_OVERLAP_TIMEOUT_SECONDS = 7 * 86_400
#: Entries read from ``app.conf.beat_schedule``.
SOURCE_CONFIG = "config"
#: django-celery-beat's ``PeriodicTask`` rows (``zdelay --beat -S django``).
SOURCE_DJANGO_BEAT = "django-celery-beat"
#: Entries added at run time (Python API or ``zdelay periodic add``). The
#: only source a configuration does not own: every other one is stored by
#: a companion's configuration, which removes what it no longer names
#: (``define.lua``, config mode), while these stay until removed.
SOURCE_API = "api"

#: Keys of a ``beat_schedule`` entry; ``zdelay_missed`` and ``zdelay_jitter`` are ours.
_ENTRY_KEYS = (
    "task",
    "schedule",
    "args",
    "kwargs",
    "options",
    "relative",
    "zdelay_missed",
    "zdelay_jitter",
    "zdelay_timezone",
    "zdelay_start",
    "zdelay_end",
    "zdelay_max_runs",
    "zdelay_one_off",
    "zdelay_overlap",
    "zdelay_overlap_timeout",
)
_CRONTAB_FIELDS = ("minute", "hour", "day_of_week", "day_of_month", "month_of_year")
#: Schedule specs kept to be shared (:func:`_shared_spec`): specs that differ
#: row by row are each one definition's, shared with none.
SPECS_KEPT = 10_000
_SPECS: Recent[str, tuple[str, Mapping[str, Any]]] = Recent(SPECS_KEPT)


def _spec_text(spec: Mapping[str, Any]) -> str:
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))


def _shared_spec(spec: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """*spec*'s canonical text and one spec object equal to it, shared by every definition of it.

    Each decode makes its own keys and values: a crontab row's definition
    took 1.8 KB, most of it decoded JSON, and the rows' reader and the
    planner each kept one per schedule. Most schedules share a few specs
    (every "daily at 09:00" is one). Specs are read-only (``Mapping``):
    sharing is safe.
    """
    key = _spec_text(spec)
    return _SPECS.keep(key, (key, spec))


@dataclass(frozen=True)
class Definition:
    """One periodic task, as stored in Redis."""

    name: str
    task: str
    #: ``{"every": seconds, "relative": bool}``, ``{"crontab": {...}}``, ``{"solar": {...}}``
    #: or ``{"at": epoch ms}`` (a clocked schedule: once, at that moment).
    schedule: Mapping[str, Any]
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    missed: str = "once"
    source: str = SOURCE_CONFIG
    #: Each occurrence runs this many ms after its time at most: a
    #: deterministic offset in ``[0, jitter_ms)`` (see :meth:`offset_ms`).
    jitter_ms: int = 0
    #: Occurrences before this epoch ms do not run (None: no start).
    start_ms: int | None = None
    #: Occurrences after this epoch ms do not run (None: no end).
    end_ms: int | None = None
    #: At most this many occurrences run, per definition (None: no limit).
    max_runs: int | None = None
    #: One of :data:`OVERLAP_POLICIES`.
    overlap: str = "allow"
    #: How long a run counts as unfinished at most when no worker reports
    #: its end (a SIGKILLed worker); None: the app's ``zdelay_max_run_seconds``.
    overlap_timeout_ms: int | None = None
    #: The name people know it by, when it is not *name*: a django-celery-beat
    #: row's name in the admin, spaces and all (*name*, the key of everything
    #: stored for it and part of its occurrence ids, has none: see
    #: :func:`schedule_name`). None: *name*.
    display_name: str | None = None

    @property
    def label(self) -> str:
        """The name to show people: :attr:`display_name`, else :attr:`name`."""
        return self.display_name or self.name

    def body(self) -> str:
        """Return the canonical JSON stored in Redis (equal definitions, equal text).

        Encoded once per definition (it is frozen): a configuration is
        encoded to be checked, fingerprinted and stored.
        """
        known: str | None = self.__dict__.get("_body")
        if known is not None:
            return known
        text = self._encode()
        object.__setattr__(self, "_body", text)
        return text

    def _encode(self) -> str:
        data: dict[str, Any] = {
            "task": self.task,
            "schedule": self.schedule,
            "args": self.args,
            "kwargs": self.kwargs,
            "options": self.options,
            "missed": self.missed,
            "source": self.source,
        }
        # Each only when set: definitions stored before they existed keep their text.
        if self.jitter_ms:
            data["jitter_ms"] = self.jitter_ms
        if self.start_ms is not None:
            data["start_ms"] = self.start_ms
        if self.end_ms is not None:
            data["end_ms"] = self.end_ms
        if self.max_runs is not None:
            data["max_runs"] = self.max_runs
        if self.overlap != "allow":
            data["overlap"] = self.overlap
        if self.overlap_timeout_ms is not None:
            data["overlap_timeout_ms"] = self.overlap_timeout_ms
        if self.display_name is not None:
            data["display_name"] = self.display_name
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    def offset_ms(self, occurrence_ms: int) -> int:
        """Return how long after its time the occurrence at *occurrence_ms* runs.

        A hash of the schedule's name and the occurrence time, in
        ``[0, jitter_ms)``: the same in every companion and every release
        (so the occurrence keeps one id and runs once), spread evenly over
        the window, and different from one schedule to the next (so entries
        due at the top of the hour do not all run at once).
        """
        if self.jitter_ms <= 0:
            return 0
        digest = hashlib.sha256(f"{self.name}\n{occurrence_ms}".encode()).digest()
        return int.from_bytes(digest[:8], "big") % self.jitter_ms

    def schedule_key(self) -> str:
        """The schedule spec as canonical JSON: equal specs, equal text (:func:`_shared_spec`)."""
        known: str | None = self.__dict__.get("_schedule_key")
        if known is None:
            known = _spec_text(self.schedule)
            object.__setattr__(self, "_schedule_key", known)
        return known

    @classmethod
    def from_body(cls, name: str, body: str | bytes) -> Definition:
        data = json.loads(body)
        key, spec = _shared_spec(data["schedule"])
        definition = cls(
            name=name,
            task=sys.intern(data["task"]),
            schedule=spec,
            args=list(data.get("args") or []),
            kwargs=dict(data.get("kwargs") or {}),
            options=dict(data.get("options") or {}),
            missed=sys.intern(data.get("missed", "once")),
            source=sys.intern(data.get("source", SOURCE_CONFIG)),
            jitter_ms=int(data.get("jitter_ms") or 0),
            start_ms=_optional_int(data.get("start_ms")),
            end_ms=_optional_int(data.get("end_ms")),
            max_runs=_optional_int(data.get("max_runs")),
            overlap=sys.intern(data.get("overlap", "allow")),
            overlap_timeout_ms=_optional_int(data.get("overlap_timeout_ms")),
            display_name=_optional_str(data.get("display_name")),
        )
        object.__setattr__(definition, "_schedule_key", key)
        return definition

    def in_window(self, occurrence_ms: int) -> bool:
        """Whether the occurrence at *occurrence_ms* lies between the start and end dates."""
        if self.start_ms is not None and occurrence_ms < self.start_ms:
            return False
        return self.end_ms is None or occurrence_ms <= self.end_ms

    def celery_schedule(self, app: Celery) -> BaseSchedule:
        """Return Celery's schedule object for this definition, in *app*'s timezone."""
        return build_schedule(self.schedule, app)

    def describe(self) -> str:
        """Return the schedule as a person reads it (``every 10s``, ``crontab 0 3 * * *``)."""
        spec = self.schedule
        jitter = f" (jitter {self.jitter_ms / 1000:g}s)" if self.jitter_ms else ""
        if self.start_ms is not None:
            jitter += f" from {_iso(self.start_ms)}"
        if self.end_ms is not None:
            jitter += f" until {_iso(self.end_ms)}"
        if self.max_runs == 1:
            jitter += " (one-off)"
        elif self.max_runs is not None:
            jitter += f" (at most {self.max_runs} runs)"
        if self.overlap != "allow":
            jitter += f" (overlap {self.overlap})"
        if "every" in spec:
            text = f"every {spec['every']:g}s"
            return (text + " (relative)" if spec.get("relative") else text) + jitter
        if "crontab" in spec:
            cron = spec["crontab"]
            zone = f" {spec['tz']}" if spec.get("tz") else ""
            return "crontab " + " ".join(str(cron[f]) for f in _CRONTAB_FIELDS) + zone + jitter
        if "at" in spec:
            return f"once at {_iso(spec['at'])}" + jitter
        sun = spec["solar"]
        return f"solar {sun['event']} at {sun['lat']},{sun['lon']}" + jitter


def definitions_from_config(
    app: Celery, *, previous: Mapping[str, tuple[Any, Definition]] | None = None
) -> tuple[list[Definition], dict[str, str]]:
    """Read ``app.conf.beat_schedule``; return the valid definitions and the errors.

    Errors map an entry's name to what is wrong with it, so one bad entry is
    reported by name while every other entry is served. *previous* maps
    names to (the entry as it was, its definition) from an earlier read: an
    entry equal to it keeps that definition, not built again (see
    :func:`entry_copy`).
    """
    raw = app.conf.beat_schedule or {}
    if not isinstance(raw, Mapping):
        return [], {"beat_schedule": f"must be a dict of entries, got {type(raw).__name__}"}
    known = set(app.tasks.keys())
    definitions, errors = [], {}
    for name, entry in raw.items():
        seen = previous.get(str(name)) if previous else None
        if seen is not None and same_entry(seen[0], entry):
            definitions.append(seen[1])
            continue
        try:
            definitions.append(from_beat_entry(str(name), entry, known_tasks=known))
        except ConfigurationError as exc:
            errors[str(name)] = str(exc)
    return definitions, errors


def same_entry(seen: Any, entry: Any) -> bool:
    """Whether *entry* is what *seen* (an :func:`entry_copy`) was.

    ``==``, and a schedule object of the same class and ``relative``
    (Celery's ``schedule`` compares its interval only).
    """
    if seen != entry:
        return False
    if not isinstance(seen, dict) or not isinstance(entry, dict):
        return True
    before, after = seen.get("schedule"), entry.get("schedule")
    return type(before) is type(after) and getattr(before, "relative", None) == getattr(
        after, "relative", None
    )


def entry_copy(entry: Any) -> Any:
    """A copy of a ``beat_schedule`` entry to compare with the next one read.

    The entry and its containers (args, kwargs, options) are copied, so an
    entry changed in place compares unequal; schedule objects are compared
    with their own ``==`` (Celery's compare what they run on). An object
    without one compares unequal to itself here, and the entry is then
    built again, as it would be without the copy.
    """
    if not isinstance(entry, dict):
        return entry
    return {
        key: value.copy() if isinstance(value, (dict, list)) else value
        for key, value in entry.items()
    }


def schedule_name(display_name: str) -> str:
    """The schedule name of a name people gave with spaces: runs of spaces as ``_``.

    A django-celery-beat row is named in the admin ("Send daily report");
    a schedule's own name holds no spaces (it is part of its occurrence
    ids, and the key of everything stored for it), so the row's schedule is
    ``Send_daily_report``, shown as the row's name (:attr:`Definition.display_name`).
    Commands given the row's name find the schedule through this rule.
    """
    return re.sub(r"\s+", "_", display_name.strip())


def from_beat_entry(
    name: str,
    entry: Any,
    *,
    known_tasks: set[str] | None = None,
    source: str = SOURCE_CONFIG,
    display_name: str | None = None,
    where: str | None = None,
) -> Definition:
    """Return the definition of one ``beat_schedule`` entry.

    *display_name* is the name people know it by when it is not *name*;
    *where* names it in errors (default: ``beat_schedule entry 'name'``).

    Raises:
        ConfigurationError: the entry cannot be served; the message names it.
    """
    where = where or f"beat_schedule entry {name!r}"
    if not name or any(ch.isspace() for ch in name) or refused_character(name) is not None:
        # Its occurrences' task ids hold it: the rule of celery_zdelay.names applies.
        raise ConfigurationError(
            f"{where}: a name must be non-empty, without spaces or control characters."
        )
    if not isinstance(entry, Mapping):
        raise ConfigurationError(f"{where} must be a dict, got {type(entry).__name__}.")
    unknown = set(entry) - set(_ENTRY_KEYS)
    if unknown:
        raise ConfigurationError(
            f"{where} has unknown keys {sorted(unknown)}; the keys are {', '.join(_ENTRY_KEYS)}."
        )
    task = entry.get("task")
    if not isinstance(task, str) or not task:
        raise ConfigurationError(f"{where} needs 'task': the name of a registered task.")
    if known_tasks is not None and task not in known_tasks:
        raise ConfigurationError(
            f"{where} names the unknown task {task!r}: register it (or import its module "
            "in the app, e.g. with imports= or autodiscover_tasks) or fix the name."
        )
    missed = entry.get("zdelay_missed", "once")
    if missed not in MISSED_POLICIES:
        raise ConfigurationError(
            f"{where}: zdelay_missed must be one of {', '.join(MISSED_POLICIES)}, got {missed!r}."
        )
    spread_ms = jitter_ms(entry.get("zdelay_jitter", 0), f"{where}: zdelay_jitter")
    args = entry.get("args") or ()
    kwargs = entry.get("kwargs") or {}
    options = entry.get("options") or {}
    if not isinstance(args, (list, tuple)):
        raise ConfigurationError(f"{where}: args must be a list or tuple, got {args!r}.")
    if not isinstance(kwargs, Mapping) or not isinstance(options, Mapping):
        raise ConfigurationError(f"{where}: kwargs and options must be dicts.")
    if "max_late" in options:
        raise ConfigurationError(
            f"{where}: options has max_late, which does not apply to a periodic task: an "
            "occurrence released late follows the schedule's zdelay_missed ('once', 'all' or "
            "'skip') instead. Remove max_late from its options."
        )
    spec = schedule_spec(entry.get("schedule"), bool(entry.get("relative")), where)
    zone = entry.get("zdelay_timezone")
    if zone is not None:
        spec = {**spec, "tz": _zone_name(zone, spec, where)}
    start_ms = moment_ms(entry.get("zdelay_start"), "zdelay_start", where)
    end_ms = moment_ms(entry.get("zdelay_end"), "zdelay_end", where)
    if start_ms is not None and end_ms is not None and end_ms < start_ms:
        raise ConfigurationError(f"{where}: zdelay_end is before zdelay_start; swap them.")
    max_runs = entry.get("zdelay_max_runs")
    if max_runs is not None and (
        isinstance(max_runs, bool) or not isinstance(max_runs, int) or max_runs < 1
    ):
        raise ConfigurationError(
            f"{where}: zdelay_max_runs must be a whole number of runs, at least 1, "
            f"got {max_runs!r}."
        )
    one_off = entry.get("zdelay_one_off", False)
    if not isinstance(one_off, bool):
        raise ConfigurationError(f"{where}: zdelay_one_off must be True or False, got {one_off!r}.")
    if one_off:
        if max_runs not in (None, 1):
            raise ConfigurationError(
                f"{where}: zdelay_one_off runs once, zdelay_max_runs says {max_runs}: "
                "keep one of them."
            )
        max_runs = 1
    overlap, overlap_timeout_ms = _overlap(entry, where)
    definition = Definition(
        name=name,
        task=task,
        schedule=spec,
        args=list(args),
        kwargs=dict(kwargs),
        options=dict(options),
        missed=missed,
        source=source,
        jitter_ms=spread_ms,
        start_ms=start_ms,
        end_ms=end_ms,
        max_runs=max_runs,
        overlap=overlap,
        overlap_timeout_ms=overlap_timeout_ms,
        display_name=display_name if display_name != name else None,
    )
    try:
        body = definition.body()
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"{where}: args, kwargs and options must be JSON-serializable, because every "
            f"companion serves the definition stored in Redis ({exc})."
        ) from None
    # Stored and read back: what every companion will serve.
    return Definition.from_body(name, body)


def schedule_spec(value: Any, relative: bool, where: str) -> dict[str, Any]:
    """Return the JSON spec of a ``schedule`` value (number, timedelta, crontab, solar)."""
    if isinstance(value, schedule) and type(value) is schedule:
        relative = relative or value.relative
        value = value.run_every
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool):
        value = repr(value)  # True is a number to Python, not a schedule
    if isinstance(value, numbers.Real):
        seconds = float(value)
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ConfigurationError(
                f"{where}: schedule must be more than 0 seconds, got {value!r}."
            )
        return {"every": seconds, "relative": relative}
    if isinstance(value, crontab) and type(value) is crontab:
        return {"crontab": {f: _cron_text(getattr(value, f"_orig_{f}")) for f in _CRONTAB_FIELDS}}
    if isinstance(value, solar) and type(value) is solar:
        return {"solar": {"event": value.event, "lat": value.lat, "lon": value.lon}}
    if isinstance(value, ClockedAt):
        return {"at": value.at_ms}
    raise ConfigurationError(
        f"{where}: schedule must be a number of seconds, a timedelta, a crontab or a solar "
        f"(the schedule is stored in Redis as JSON), got {value!r}."
    )


class ZonedCrontab(crontab):  # type: ignore[misc]
    """A ``crontab`` in a time zone of its own rather than the app's (``zdelay_timezone``).

    Celery's crontab reads its zone from ``self.tz`` (the app's timezone)
    wherever it matches fields and steps over DST, so answering with another
    zone there gives exactly Celery's behaviour in that zone, as for an app
    whose ``timezone`` it is.
    """

    def __init__(self, *args: Any, zone: tzinfo, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._zone = zone

    @property
    def tz(self) -> tzinfo:
        return self._zone

    def __copy__(self) -> ZonedCrontab:
        # crontab's own __reduce__ would rebuild it without its zone.
        twin: ZonedCrontab = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        return twin


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _optional_str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat(timespec="seconds")


def moment_ms(value: Any, key: str, where: str) -> int | None:
    """Check a ``zdelay_start``/``zdelay_end`` value; return it in epoch ms.

    A datetime (naive: UTC, as Celery's worker reads an ``eta``) or an ISO
    8601 string.
    """
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            value = None
    if not isinstance(value, datetime):
        raise ConfigurationError(
            f"{where}: {key} must be a datetime or an ISO 8601 time such as "
            f"'2026-07-01T00:00:00+00:00'."
        )
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return int(value.timestamp() * 1000)


def _overlap(entry: Mapping[str, Any], where: str) -> tuple[str, int | None]:
    """Check ``zdelay_overlap`` and ``zdelay_overlap_timeout``; return the policy and ms."""
    overlap = entry.get("zdelay_overlap", "allow")
    if overlap not in OVERLAP_POLICIES:
        raise ConfigurationError(
            f"{where}: zdelay_overlap must be one of {', '.join(OVERLAP_POLICIES)}, "
            f"got {overlap!r}."
        )
    timeout = entry.get("zdelay_overlap_timeout")
    if timeout is None:
        return overlap, None
    if overlap == "allow":
        raise ConfigurationError(
            f"{where}: zdelay_overlap_timeout bounds how long a run blocks the next one, "
            "and zdelay_overlap is 'allow' (nothing is blocked): set zdelay_overlap to "
            "'skip' or 'buffer_one', or remove zdelay_overlap_timeout."
        )
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, numbers.Real)
        or not 0 < float(timeout) <= MAX_OVERLAP_TIMEOUT_SECONDS
    ):
        raise ConfigurationError(
            f"{where}: zdelay_overlap_timeout must be a number of seconds above 0 and at most "
            f"{MAX_OVERLAP_TIMEOUT_SECONDS} (or a timedelta): the longest a run may take, "
            f"after which a run no worker reported finished stops blocking; got {timeout!r}."
        )
    return overlap, max(1, round(float(timeout) * 1000))


def _zone_name(value: Any, spec: Mapping[str, Any], where: str) -> str:
    """Check a ``zdelay_timezone`` value; return its IANA name."""
    name = getattr(value, "key", value)  # a ZoneInfo gives its name
    if "crontab" not in spec:
        raise ConfigurationError(
            f"{where}: zdelay_timezone applies to crontab schedules only (an interval "
            "does not depend on the zone); remove it or use a crontab."
        )
    if not isinstance(name, str) or not name:
        raise ConfigurationError(
            f"{where}: zdelay_timezone must be an IANA time zone name such as "
            f"'Europe/Paris', got {value!r}."
        )
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ConfigurationError(
            f"{where}: the time zone {name!r} does not exist: use an IANA name such as "
            "'Europe/Paris' or 'America/New_York'."
        ) from None
    return name


def build_schedule(spec: Mapping[str, Any], app: Celery) -> BaseSchedule:
    """Return Celery's schedule object for a stored *spec*."""
    if "every" in spec:
        return schedule(timedelta(seconds=spec["every"]), relative=bool(spec["relative"]), app=app)
    if "crontab" in spec:
        if spec.get("tz"):
            return ZonedCrontab(**spec["crontab"], app=app, zone=ZoneInfo(spec["tz"]))
        return crontab(**spec["crontab"], app=app)
    if "solar" in spec:
        sun = spec["solar"]
        return solar(sun["event"], sun["lat"], sun["lon"], app=app)
    if "at" in spec:
        return ClockedAt(spec["at"], app=app)
    raise ConfigurationError(f"Unknown stored schedule {spec!r}.")


def validate_spec(spec: Mapping[str, Any], app: Celery, where: str) -> None:
    """Raise a :class:`ConfigurationError` naming *where* if *spec* cannot be built."""
    try:
        build_schedule(spec, app)
    except ConfigurationError:
        raise
    except Exception as exc:
        raise ConfigurationError(f"{where}: invalid schedule {spec!r}: {exc}") from None


def config_hash(definitions: list[Definition], unservable: Mapping[str, str] | None = None) -> str:
    """Return the fingerprint of a configuration: its entries' names and bodies.

    Entries this process cannot serve count by name and reason (stored
    with the configuration, so a new reason is a new configuration).
    """
    digest = hashlib.sha256()
    for definition in sorted(definitions, key=lambda d: d.name):
        digest.update(definition.name.encode() + b"\0" + definition.body().encode() + b"\0")
    for name, reason in sorted((unservable or {}).items()):
        digest.update(b"!" + name.encode() + b"\0" + reason.encode() + b"\0")
    return digest.hexdigest()[:16]


def _cron_text(value: Any) -> str:
    if isinstance(value, (list, tuple, set, frozenset, range)):
        return ",".join(str(v) for v in sorted(value))
    return str(value)
