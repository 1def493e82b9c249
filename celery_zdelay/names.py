"""What a task id, key, tag or limit key may hold: one rule, checked where a value enters.

The store keeps these values in records that join fields with a newline
(``store/lua/_marks.lua``): an entry's mark ``"<mode><max run ms>\\n<key>\\n<tag>..."``,
a key's owner ``"<task id>\\n<until ms>"``, the tag index ``"<tag>\\n<task id>"``.
A newline inside one of them would shift every field after it: a key owned by
task ``"a\\nb"`` reads as owned by ``"a"`` until ms ``0``, i.e. free. So a value
that names parked work is refused, before anything is written, when it is not
a ``str``, is empty, or holds

- a control character: U+0000 to U+001F (newline, tab, NUL, ...), U+007F to
  U+009F (DEL and the C1 controls, NEL among them), or
- a lone surrogate (U+D800 to U+DFFF), which cannot be written as UTF-8.

Keys, tags and limit keys are at most :data:`MAX_NAME_LENGTH` characters too
(each is stored with every entry using it); a task id's length is Celery's
business. Every other character is allowed, spaces and colons included.
The payload of an entry (``entry.py``) separates values with NUL bytes, but
each value is JSON text there, where a NUL is escaped: no byte of an id
reaches it raw.
"""

from __future__ import annotations

import re
from typing import Any

from .errors import ConfigurationError

__all__ = [
    "MAX_NAME_LENGTH",
    "refused_character",
    "validate_limit_key",
    "validate_name",
    "validate_task_id",
]

#: Longest key, tag or limit key, in characters.
MAX_NAME_LENGTH = 200

#: What no name may hold (see the module docstring).
_REFUSED = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")

_EXAMPLES = {
    "key": "reminder:user:7",
    "tag": "order:42",
    "limit_key": "tenant:42",
    "task_id": "6f1c2a3e-8d4b-4a51-9b7e-2f9d0c1a7e55",
}


def refused_character(text: str) -> str | None:
    """Return the first character of *text* no name may hold, or None."""
    found = _REFUSED.search(text)
    return found.group() if found else None


def validate_name(
    value: Any, *, what: str, max_length: int | None = MAX_NAME_LENGTH, done: str = "written"
) -> str:
    """Return *value* if it may name parked work as *what* (``key``, ``tag``...), else raise.

    *done* ends the message: "Nothing was {done}." (the call that checks
    has changed nothing).

    Raises:
        ConfigurationError: *value* breaks the rule of the module docstring;
            the message says which part and what to use instead.
    """
    example = _EXAMPLES.get(what, "order:42")
    if not isinstance(value, str):
        raise ConfigurationError(
            f"{what}= must be a string such as {example!r}, got {type(value).__name__} "
            f"{_shown(value)}; nothing was {done}."
        )
    if not value:
        raise ConfigurationError(f"{what}= is empty; give a non-empty string. Nothing was {done}.")
    if max_length is not None and len(value) > max_length:
        raise ConfigurationError(
            f"{what}= is {len(value)} characters long, more than {max_length}: use an id "
            f"rather than the data itself. Nothing was {done}."
        )
    bad = refused_character(value)
    if bad is not None:
        raise ConfigurationError(
            f"{what}= {_shown(value)} holds the character U+{ord(bad):04X} at position "
            f"{value.index(bad)}: celery-zdelay refuses control characters (U+0000-U+001F, "
            "U+007F-U+009F: newline, tab, NUL...) and lone surrogates in ids, keys and tags, "
            "as its records separate fields with a newline. Use printable characters only, "
            f"such as {example!r}. Nothing was {done}."
        )
    return value


def validate_task_id(task_id: Any, *, done: str = "parked") -> str:
    """Return *task_id* if a task may be parked (or looked up) under it, else raise.

    Raises:
        ConfigurationError: see :func:`validate_name` (no length bound).
    """
    return validate_name(task_id, what="task_id", max_length=None, done=done)


def validate_limit_key(limit_key: Any) -> str:
    """Return *limit_key* (``apply_delayed(..., limit_key=...)``) if valid, else raise.

    Raises:
        ConfigurationError: see :func:`validate_name`.
    """
    return validate_name(limit_key, what="limit_key")


def _shown(value: Any) -> str:
    """*value*'s repr, cut short: a message must stay readable (and an int of
    4,300+ digits has no repr at all)."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"(an integer of {value.bit_length()} bits)"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
