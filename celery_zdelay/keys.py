"""Keys and tags of parked tasks: what a producer asks for, checked before anything is parked.

A *key* (``key="reminder:user:7"``) makes at most one task parked per key,
with ``on_key`` saying what a second call does:

- ``"keep"``: the parked task stays, nothing is parked, the call returns the
  parked task's result;
- ``"replace"``: the parked task is cancelled and this one parked;
- ``"debounce"``: as replace, for a *countdown* that restarts with every
  call: the task runs once, after the calls have been quiet for it; with
  ``max_wait=`` (seconds), at most that long after the first call of the
  burst, however steady the calls (:func:`max_wait_ms`);
- ``"until_finished"``: as keep, and the key stays taken after the release
  while the task runs, until its run ends however it ends (see
  :func:`celery_zdelay.worker.release_key`) or ``zdelay_max_run_seconds``
  passed.

*Tags* (``tags=["order:42"]``) find and steer parked tasks:
``cancel_matching(tag=...)``, ``reschedule_matching(tag=...)``,
``zdelay list --tag``.

Both travel in the parked message's headers (``zdelay_key``,
``zdelay_on_key``, ``zdelay_tags``: :mod:`celery_zdelay.store.headers`), so
a signed entry's key and tags are covered by its signature, the worker
knows the key to free, and transparent mode takes them from
``apply_async(headers={...})``. The store keeps an
index of both beside the entries (:mod:`celery_zdelay.store.marks`).
"""

from __future__ import annotations

import math
import numbers
import uuid
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any, cast

from .errors import ConfigurationError
from .names import MAX_NAME_LENGTH, validate_name, validate_task_id
from .schedule import MAX_COUNTDOWN_MS, MAX_COUNTDOWN_S
from .store.headers import KEY_HEADER, MAX_WAIT_HEADER, ON_KEY_HEADER, TAGS_HEADER
from .store.marks import ON_KEY_MODES, Mark
from .store.redis_keys import shard_of

__all__ = [
    "MAX_KEY_LENGTH",
    "MAX_TAGS",
    "ON_KEY_MODES",
    "Mark",
    "check_max_wait",
    "mark_from_headers",
    "max_wait_ms",
    "task_id_for",
    "validate_key",
    "validate_tag",
]

#: Default ``on_key``: a second call with the same key parks nothing.
DEFAULT_ON_KEY = "keep"
#: Longest key or tag, in characters: each is stored with every entry using it.
MAX_KEY_LENGTH = MAX_NAME_LENGTH
#: Most tags on one task.
MAX_TAGS = 32


def validate_key(key: Any, *, what: str = "key") -> str:
    """Return *key* if it can name parked tasks, else raise ``ConfigurationError``.

    The rule is :func:`celery_zdelay.names.validate_name`, the same for ids,
    keys, tags and limit keys.
    """
    return validate_name(key, what=what)


def validate_tag(tag: Any) -> str:
    """Return *tag* if it can tag parked tasks, else raise ``ConfigurationError``."""
    return validate_key(tag, what="tag")


def _validate_tags(tags: Any) -> tuple[str, ...]:
    if isinstance(tags, (str, bytes)) or not isinstance(tags, Iterable):
        raise ConfigurationError(
            f"tags= must be a list of strings such as ['order:42'], got {tags!r}; "
            "nothing was written."
        )
    checked = tuple(dict.fromkeys(validate_tag(tag) for tag in tags))
    if len(checked) > MAX_TAGS:
        raise ConfigurationError(
            f"tags= has {len(checked)} tags, more than {MAX_TAGS}. Nothing was written."
        )
    return checked


def _validate_on_key(on_key: Any) -> str:
    if not isinstance(on_key, str) or on_key not in ON_KEY_MODES:
        raise ConfigurationError(
            f"on_key={on_key!r} is not a mode; use one of "
            + ", ".join(repr(mode) for mode in ON_KEY_MODES)
            + ". Nothing was written."
        )
    return str(on_key)


def max_wait_ms(max_wait: Any) -> int:
    """Return ``max_wait=`` (seconds, or a ``timedelta``) in whole ms, checked.

    Rounded down: the cap is a promise of "at most", never a millisecond later.

    Raises:
        ConfigurationError: it is not a number of seconds from 0.001 to
            :data:`~celery_zdelay.schedule.MAX_COUNTDOWN_S` (a bool, NaN,
            infinite, zero, negative, too large).
    """
    seconds = max_wait.total_seconds() if isinstance(max_wait, timedelta) else max_wait
    # Compared as given (NaN fails it): an int beyond a float's range must
    # not be turned into one first.
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, numbers.Real)
        or not 0.001 <= cast("float", seconds) <= MAX_COUNTDOWN_S
    ):
        shown = _shown(max_wait)
        raise ConfigurationError(
            f"max_wait= must be a number of seconds from 0.001 to {MAX_COUNTDOWN_S:.0f} "
            f"(or a timedelta), got {shown}: the longest a burst of debounce calls may "
            "postpone its run, counted from its first call. Nothing was written."
        )
    return min(math.floor(float(seconds) * 1000), MAX_COUNTDOWN_MS)


def _shown(value: Any) -> str:
    """*value*'s repr, cut short (an int of 4,300+ digits has no repr at all)."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"(an integer of {value.bit_length()} bits)"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_max_wait(key: Any, on_key: Any, max_wait: Any) -> int | None:
    """``max_wait=`` in ms (None for none), refused unless the call debounces a *key*.

    Raises:
        ConfigurationError: *max_wait* is given without *key* or with an
            *on_key* other than ``"debounce"``, or is not a duration
            (:func:`max_wait_ms`).
    """
    if max_wait is None:
        return None
    on_key = DEFAULT_ON_KEY if on_key is None else on_key
    if key is None or on_key != "debounce":
        raise ConfigurationError(
            "max_wait= caps how long a debounced key's calls postpone its run: pass it "
            'with key= and on_key="debounce" (got '
            + ("no key=" if key is None else f"on_key={on_key!r}")
            + "), or leave it out. Nothing was written."
        )
    return max_wait_ms(max_wait)


def set_headers(
    options: dict[str, Any], key: Any, on_key: Any, tags: Any, max_wait: Any = None
) -> None:
    """Check *key*, *on_key*, *tags* and *max_wait* and put them in the headers of *options*.

    The message headers are what is parked (and signed), so the key and
    tags travel with the task to the store and to the worker.
    """
    if key is None and on_key is not None:
        raise ConfigurationError("on_key= needs key=; nothing was written.")
    wait_ms = check_max_wait(key, on_key, max_wait)
    headers = dict(options.get("headers") or {})
    if key is not None:
        headers[KEY_HEADER] = validate_key(key)
        headers[ON_KEY_HEADER] = _validate_on_key(DEFAULT_ON_KEY if on_key is None else on_key)
    if wait_ms is not None:
        headers[MAX_WAIT_HEADER] = wait_ms
    if tags is not None:
        headers[TAGS_HEADER] = list(_validate_tags(tags))
    options["headers"] = headers


def mark_from_headers(headers: Mapping[str, Any], *, max_run_ms: int) -> Mark | None:
    """Return the mark a message's *headers* ask for (checked), or None for none."""
    key = headers.get(KEY_HEADER)
    tags = headers.get(TAGS_HEADER)
    on_key = headers.get(ON_KEY_HEADER)
    if key is None and on_key is not None:
        # As on_key= without key=: a mode the caller believes applies would not.
        raise ConfigurationError(
            f"The {ON_KEY_HEADER} header needs a {KEY_HEADER} header; nothing was written."
        )
    if key is None and not tags:
        if headers.get(MAX_WAIT_HEADER) is not None:
            check_max_wait(None, on_key, 1)  # raises: a cap the caller believes applies
        return None
    mode = (
        _validate_on_key(DEFAULT_ON_KEY if on_key is None else on_key)
        if key is not None
        else DEFAULT_ON_KEY
    )
    return Mark(
        key=None if key is None else validate_key(key),
        on_key=mode,
        tags=_validate_tags(tags or ()),
        max_run_ms=max_run_ms,
        max_wait_ms=_max_wait_header(headers.get(MAX_WAIT_HEADER), key, mode),
    )


def _max_wait_header(value: Any, key: Any, on_key: str) -> int | None:
    """The checked ms of a :data:`MAX_WAIT_HEADER` (set by hand in transparent mode too)."""
    if value is None:
        return None
    check_max_wait(key, on_key, 1)  # the call must debounce a key
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNTDOWN_MS:
        raise ConfigurationError(
            f"The {MAX_WAIT_HEADER} header must be a whole number of ms from 1 to "
            f"{MAX_COUNTDOWN_MS}, got {value!r}; pass max_wait= (seconds) to apply_delayed "
            "instead. Nothing was written."
        )
    return value


def task_id_for(key: str, shards: int) -> str:
    """Return a new random task id that lives on the shard of *key*.

    A keyed entry lives on its key's shard (one script sees every entry of
    a key), and lookups by id look in the id's shard: an id drawn until
    both agree is found by both, with no index between shards.
    """
    target = shard_of(key, shards)
    while True:
        task_id = str(uuid.uuid4())
        if shard_of(task_id, shards) == target:
            return task_id


def check_task_id(task_id: str, key: str, shards: int) -> None:
    """Raise when a caller's own *task_id* is not an id (see :mod:`celery_zdelay.names`)
    or cannot live on the shard of *key*."""
    validate_task_id(task_id)
    if shard_of(task_id, shards) != shard_of(key, shards):
        raise ConfigurationError(
            f"task_id={task_id!r} and key={key!r} fall on different shards "
            f"(zdelay_shards = {shards}), and a keyed task must live on its key's shard. "
            "Leave task_id out (celery-zdelay then picks one on the right shard), or take "
            "one from celery_zdelay.keys.task_id_for(key, shards). Nothing was written."
        )
