"""Keys and tags of parked tasks: what a producer asks for, checked before anything is parked.

A *key* (``key="reminder:user:7"``) makes at most one task parked per key,
with ``on_key`` saying what a second call does:

- ``"keep"``: the parked task stays, nothing is parked, the call returns the
  parked task's result;
- ``"replace"``: the parked task is cancelled and this one parked;
- ``"debounce"``: as replace, for a *countdown* that restarts with every
  call: the task runs once, after the calls have been quiet for it;
- ``"until_finished"``: as keep, and the key stays held after the release
  while the task runs, until its run ends however it ends (see
  :func:`celery_zdelay.worker.release_key`) or ``zdelay_key_hold_seconds``
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

import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from .errors import ConfigurationError
from .names import MAX_NAME_LENGTH, validate_name, validate_task_id
from .store.headers import KEY_HEADER, ON_KEY_HEADER, TAGS_HEADER
from .store.marks import ON_KEY_MODES, Mark
from .store.redis_keys import shard_of

__all__ = [
    "MAX_KEY_LENGTH",
    "MAX_TAGS",
    "ON_KEY_MODES",
    "Mark",
    "mark_from_headers",
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


def set_headers(options: dict[str, Any], key: Any, on_key: Any, tags: Any) -> None:
    """Check *key*, *on_key* and *tags* and put them in the headers of *options*.

    The message headers are what is parked (and signed), so the key and
    tags travel with the task to the store and to the worker.
    """
    if key is None and on_key is not None:
        raise ConfigurationError("on_key= needs key=; nothing was written.")
    headers = dict(options.get("headers") or {})
    if key is not None:
        headers[KEY_HEADER] = validate_key(key)
        headers[ON_KEY_HEADER] = _validate_on_key(DEFAULT_ON_KEY if on_key is None else on_key)
    if tags is not None:
        headers[TAGS_HEADER] = list(_validate_tags(tags))
    options["headers"] = headers


def mark_from_headers(headers: Mapping[str, Any], *, hold_ms: int) -> Mark | None:
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
        return None
    return Mark(
        key=None if key is None else validate_key(key),
        on_key=(
            _validate_on_key(DEFAULT_ON_KEY if on_key is None else on_key)
            if key is not None
            else DEFAULT_ON_KEY
        ),
        tags=_validate_tags(tags or ()),
        hold_ms=hold_ms,
    )


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
