"""Encoding many entries at once: each template worked out once, not per message.

:func:`~celery_zdelay.entry.encode_entry` builds a message's whole envelope,
serializes it and cuts the per-call values out of it again to find its
template. Messages of one task sent with one set of options (a bulk call, a
batch) share that template: only their per-call values differ. So
:class:`EntryEncoder` groups messages by everything that decides the
template (content type, header names and the template's header values,
property names, routing, which values are equal to which) and encodes only
the first message of each group with ``encode_entry``. For the others it
serializes the per-call values alone and joins them, as ``encode_entry``
would.

Every group's first message is also encoded the fast way and compared byte
for byte with ``encode_entry``'s payload; a group where they differ (a
format this module does not know) keeps ``encode_entry`` for every message.
"""

from __future__ import annotations

import base64
from typing import Any

from .entry import (
    SCHEMA_VERSION,
    TEMPLATE_HEADERS,
    TEMPLATE_PROPERTIES,
    TaskMessage,
    Template,
    encode_entry,
    entry_signature,
    metadata_line,
    template_pieces,
    value_fragment,
)

__all__ = ["EntryEncoder"]

#: Properties encode_entry's envelope adds after the message's own.
_ADDED_PROPERTIES = ("delivery_info", "priority", "body_encoding", "delivery_tag")


#: Groups one encoder remembers; past that it starts again (a process that
#: parks more kinds of calls than this pays encode_entry's price more often).
MAX_GROUPS = 1024

_UNKNOWN = object()


class EntryEncoder:
    """Encode entries as :func:`~celery_zdelay.entry.encode_entry` does, faster for repeats.

    One encoder may serve one park or every park of a configuration (the
    producer keeps one per app configuration: a task called the same way
    again is encoded the fast way, one call after another). Its groups never
    go stale: a group's key holds everything its template is made of. Safe
    to share between threads: two that meet a new group both work it out.
    """

    def __init__(
        self,
        signing_key: bytes | None = None,
        *,
        repeats: bool = True,
        whole: bool = False,
        max_groups: int = MAX_GROUPS,
    ) -> None:
        self._signing_key = signing_key
        #: False: every message goes straight to encode_entry (grouping pays
        #: only for messages encoded again the same way).
        self._repeats = repeats
        #: Messages stored whole have no template to share.
        self._whole = whole
        self._max_groups = max_groups
        #: Group key -> the group's template, or None where encode_entry is used.
        self._templates: dict[Any, Template | None] = {}

    def encode(
        self, message: TaskMessage, *, dest: str | None = None, layout: str | None = None
    ) -> tuple[bytes, Template | None]:
        """Return what ``encode_entry(message, dest=, layout=, signing_key=, whole=)`` returns."""
        if self._whole:
            return encode_entry(
                message, dest=dest, layout=layout, signing_key=self._signing_key, whole=True
            )
        if not self._repeats:
            return encode_entry(message, dest=dest, layout=layout, signing_key=self._signing_key)
        try:
            key, variables = _group(message, dest, layout)
            known = self._templates.get(key, _UNKNOWN)
        except TypeError:  # an unhashable value where a template value goes
            return encode_entry(message, dest=dest, layout=layout, signing_key=self._signing_key)
        if known is _UNKNOWN:
            payload, template = encode_entry(
                message, dest=dest, layout=layout, signing_key=self._signing_key
            )
            fast = template and self._payload(template, variables, dest, message)
            if fast != payload:
                template = None  # pragma: no cover - guards against a format change
            if len(self._templates) >= self._max_groups:
                self._templates = {}
            self._templates[key] = template
            return payload, template
        template = known  # type: ignore[assignment]
        if template is None:
            return encode_entry(message, dest=dest, layout=layout, signing_key=self._signing_key)
        return self._payload(template, variables, dest, message), template

    def _payload(
        self, template: Template, variables: list[bytes], dest: str | None, message: TaskMessage
    ) -> bytes:
        # Each value ends in a NUL, as encode_entry writes them.
        blob = b"\x00".join(variables) + b"\x00"
        if not self._signing_key:
            line = b'{"v":%d,"t":"%s","n":%d}' % (SCHEMA_VERSION, template.id.encode(), len(blob))
            return line + b"\n" + blob
        # Signed over the envelope as released: the template's pieces joined
        # with the values, as the companion expands it.
        pieces, numbers = template_pieces(template.record)
        parts = [pieces[0]]
        for number, piece in zip(numbers, pieces[1:], strict=True):
            parts.append(variables[number - 1])
            parts.append(piece)
        head = b"".join(parts)
        signature = entry_signature(self._signing_key, dest, message.declare or None, head)
        meta = {"v": SCHEMA_VERSION, "t": template.id, "n": len(blob), "s": signature}
        return metadata_line(meta) + b"\n" + blob


def _group(
    message: TaskMessage, dest: str | None, layout: str | None
) -> tuple[tuple[Any, ...], list[bytes]]:
    """Return what decides *message*'s template, and its per-call values in order.

    The values are taken in encode_entry's order (body, headers, properties);
    equal values share one variable, so which slots are equal is part of the key.
    """
    # Base64 text never needs escaping in JSON.
    slots = [b'"' + base64.b64encode(message.body) + b'"']
    fixed_headers: list[tuple[Any, ...]] = []
    for name, value in message.headers.items():
        if name in TEMPLATE_HEADERS:
            fixed_headers.append((name, type(value), value))
        else:
            fixed_headers.append((name,))
            slots.append(value_fragment(value))
    properties = message.properties
    names = [*properties, *(name for name in _ADDED_PROPERTIES if name not in properties)]
    for name in names:
        if name == "delivery_info":
            slots.append(value_fragment(message.routing_key))
        elif name not in TEMPLATE_PROPERTIES:
            slots.append(value_fragment(properties[name]))
    numbers: dict[bytes, int] = {}
    pattern = tuple(numbers.setdefault(slot, len(numbers) + 1) for slot in slots)
    key = (
        message.content_type,
        message.content_encoding,
        tuple(fixed_headers),
        tuple(names),
        properties.get("delivery_mode"),
        message.priority,
        message.exchange,
        dest,
        layout,
        tuple(message.declare),
        pattern,
    )
    hash(key)  # raises TypeError here, not in the caller's dict lookup
    return key, list(numbers)
