"""The parked entry: one task message, stored until it is due.

What a release publishes is the message in the envelope kombu's Redis
transport pushes (``{"body": ..., "headers": {...}, "properties": {...}}``),
with the body still serialized (and compressed, if Celery compressed it):
nothing here decodes task arguments.

Most of an envelope repeats from call to call of a task (header names, task
name, routing, content type), so it is stored in two parts:

- a **template**, once per shard: the envelope's JSON text with a NUL byte
  and a variable number where each per-call value goes, cut off at the
  opening quote of the delivery tag; its first line holds what the template
  decides: the variable count ``c`` and, for the Redis handoff, the kombu
  list key ``k``, the transport layout ``l`` and the queues to declare ``q``;
- the **entry**: a metadata line (schema version ``v``, template id ``t``,
  length ``n`` of what follows, optional signature ``s``), a newline, then the
  per-call values (JSON fragments: body, task id, argsrepr, ...) each ending
  in a NUL byte, which JSON text never contains (entries parked by earlier
  releases only separate them; both are read)::

      {"v":1,"t":"9f86d081884c7d65","n":269}
      "W1s0Ml0sIHt9..."\0"f9fe6d14-431f-..."\0"(42,)"\0...\0

With ``zdelay_whole_messages`` an entry is instead the message exactly as
the handoff pushes it, delivery tag included: the tag, chosen when the entry
is built, is ``zdelay.<route id>.<32 hex digits>``, and the route id names a
**route record** in the templates hash (``{"w":1,"k":...,"l":...,"q":[...]}``
and a newline), which holds what a metadata line would. handoff.lua pushes
such an entry as it is, without building a string (the memory/speed trade-off
of that setting). It has no metadata line: no parked-at stamp and no
signature (the setting refuses a signing key)::

    {"body":"W1s0Ml0s...", ..., "delivery_tag":"zdelay.5d41402abc4b2a76.9f86d0..."}}

A call's ``max_late`` (:mod:`celery_zdelay.stale`), in ms, is the first key
of the metadata line as the producer writes it (``{"m":600000,"v":1,...}``;
see :func:`with_max_late`); the release path reads it there, handoff.lua too,
with one anchored match and only for an entry released late. No signature
covers it, as none covers the parked-at stamp: it can only make a release
not happen, which anyone who can write the entry can do anyway.

park.lua adds when the entry was parked, in epoch ms on the Redis clock, as
the first key of the stored metadata line (``{"p":1764547200123,"v":1,...}``;
see :func:`parked_ms`). No signature covers it: the producer cannot know it,
and it decides nothing about what is released. Entries parked by earlier
releases have no ``p``.

Expanding an entry gives the classic single-part form that :func:`decode_entry`
reads: ``{"v":1,"n":812,"k":...,"l":...,"q":[...]}``, a newline, the envelope
head. Messages with more than :data:`MAX_VARIABLES` per-call values are
stored that way directly. handoff.lua expands entries itself (see
``lua/_expand.lua``: the values are cut out by one ``struct.unpack`` call and
joined with the template's pieces and the delivery tag by one
``table.concat``).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from kombu.utils.json import dumps as kombu_dumps
from kombu.utils.json import loads as kombu_loads

from .errors import EntryError

__all__ = [
    "MAX_VARIABLES",
    "SCHEMA_VERSION",
    "TaskMessage",
    "Template",
    "decode_entry",
    "encode_entry",
    "entry_headers",
    "entry_max_late_ms",
    "entry_routing_key",
    "eta_text",
    "expand_entry",
    "parked_ms",
    "template_id",
    "template_ref",
    "with_eta",
    "with_max_late",
]

#: Version written into every new entry; readers accept this one.
SCHEMA_VERSION = 1

#: Most per-call values one template holds (the variable number is one byte).
MAX_VARIABLES = 127

_TAG_TAIL = '"delivery_tag":""}}'
_COMPACT = (",", ":")
_SIGNATURE_CONTEXT = b"celery-zdelay entry v1\0"
_MARKER = re.compile(rb"\x00(.)", re.DOTALL)
#: How an entry stored whole starts (the envelope's first key), and how it
#: ends: its delivery tag, naming its route record.
_WHOLE_START = b'{"body":"'
_WHOLE_TAG = re.compile(rb'"delivery_tag":"zdelay\.([0-9a-f]{16})\.[0-9a-f]{32}"\}\}')
#: The parked-at stamp park.lua writes first in the stored metadata line.
_PARKED = re.compile(rb'\{"p":(\d{1,16}),')
#: The per-call ``max_late`` (ms) that :func:`with_max_late` writes first in
#: the metadata line, after park.lua's parked-at stamp when there is one.
_MAX_LATE = re.compile(rb'\{(?:"p":\d{1,16},)?"m":(\d{1,16}),')
#: The template id of a metadata line (``"t":"9f86d081884c7d65"``).
_TEMPLATE_REF = re.compile(rb'"t":"([0-9a-f]{1,64})"')
#: json's own (C) string encoder, as json.dumps uses it with ensure_ascii.
_encode_string: Callable[[str], str] = json.encoder.encode_basestring_ascii

#: Headers whose values repeat from call to call, from a small set (task
#: name, language, flags): they stay in the template. Every other header is
#: per call, including options a call may set to any value (``shadow=``,
#: ``time_limit``, retries, stamps): kept in the template, each new value
#: made a new template, and templates piled up with the history of calls
#: rather than with what is parked.
TEMPLATE_HEADERS = frozenset(
    {"lang", "task", "eta", "ignore_result", "replaced_task_nesting", "compression"}
)
#: Properties that stay in the template; correlation_id, reply_to, ... are
#: per call, and so is the routing key inside delivery_info (a topic
#: exchange may get a new one on every call).
TEMPLATE_PROPERTIES = frozenset({"delivery_mode", "priority", "body_encoding", "delivery_tag"})

TemplateLookup = Callable[[str], "bytes | None"]

#: The JSON text of each variable's placeholder string, by variable number.
_SENTINELS = [b""] + [
    kombu_dumps("\x00" + chr(number)).encode() for number in range(1, MAX_VARIABLES + 1)
]


@dataclass(frozen=True)
class Template:
    """The constant part of entries that differ only in per-call values."""

    #: Content hash of :attr:`record`: the same template always has the same id.
    id: str
    #: Template metadata line, newline, template text (see the module docstring).
    record: bytes


@dataclass
class TaskMessage:
    """A task message exactly as Celery handed it to the producer."""

    body: bytes
    content_type: str
    content_encoding: str
    headers: dict[str, Any]
    #: AMQP properties except priority (delivery_mode, correlation_id, ...).
    properties: dict[str, Any]
    priority: int
    exchange: str
    routing_key: str
    #: Names of the app's queues to declare before publishing.
    declare: list[Any] = field(default_factory=list)
    #: The Redis broker list the handoff may push to, and the transport
    #: layout fingerprint it was computed under (see redis_layout.py).
    handoff_dest: str | None = None
    handoff_layout: str | None = None
    #: The envelope this message was read from, up to the delivery tag's
    #: opening quote: what push.lua publishes, byte for byte (empty for a
    #: message that was not read from an entry).
    envelope_head: bytes = field(default=b"", repr=False, compare=False)

    @property
    def task_id(self) -> str:
        return str(self.headers["id"])

    @property
    def task_name(self) -> str:
        return str(self.headers.get("task", ""))


def encode_entry(
    message: TaskMessage,
    *,
    dest: str | None = None,
    layout: str | None = None,
    signing_key: bytes | None = None,
    whole: bool = False,
) -> tuple[bytes, Template | None]:
    """Return the payload that parks *message*, and the template it refers to.

    *dest* and *layout* name the Redis broker list the handoff pushes to;
    *signing_key* signs the entry so companions can refuse forged ones;
    *whole* stores the message as it is pushed, referring to a route record
    (``zdelay_whole_messages``; it cannot be signed). The template is
    ``None`` when the message is stored in one part.
    """
    envelope = _envelope(message)
    routing: dict[str, Any] = {}
    if dest is not None:
        routing["k"] = dest
        routing["l"] = layout
    if message.declare:
        routing["q"] = message.declare
    if whole:
        if signing_key:
            raise ValueError("a message stored whole carries no signature")
        record = metadata_line({"w": 1, **routing}) + b"\n"
        route = Template(id=template_id(record), record=record)
        tag = b'zdelay.%s.%s"}}' % (route.id.encode(), uuid.uuid4().hex.encode())
        return _head(envelope) + tag, route

    variables: list[bytes] = []
    numbers: dict[bytes, int] = {}

    def variable(value: Any) -> str:
        fragment = value_fragment(value)
        number = numbers.setdefault(fragment, len(variables) + 1)
        if number > len(variables):
            variables.append(fragment)
        return "\x00" + chr(number)

    templated = {
        "body": variable(envelope["body"]),
        "content-encoding": envelope["content-encoding"],
        "content-type": envelope["content-type"],
        "headers": {
            key: value if key in TEMPLATE_HEADERS else variable(value)
            for key, value in envelope["headers"].items()
        },
        "properties": {
            key: (
                value
                if key in TEMPLATE_PROPERTIES
                else {"exchange": value["exchange"], "routing_key": variable(value["routing_key"])}
                if key == "delivery_info"
                else variable(value)
            )
            for key, value in envelope["properties"].items()
        },
    }
    if len(variables) > MAX_VARIABLES:
        head = _head(envelope)
        meta = {"v": SCHEMA_VERSION, "n": len(head), **routing}
        if signing_key:
            meta["s"] = entry_signature(signing_key, dest, message.declare or None, head)
        return metadata_line(meta) + b"\n" + head, None

    text = _head(templated)
    for number in range(1, len(variables) + 1):
        # Each placeholder became a quoted JSON string: make it NUL + number.
        text = text.replace(_SENTINELS[number], b"\x00" + bytes([number]))
    record = metadata_line({"c": len(variables), **routing}) + b"\n" + text
    template = Template(id=template_id(record), record=record)
    # Each value ends in a NUL, so handoff.lua cuts them out in one C call.
    blob = b"\x00".join(variables) + b"\x00"
    if not signing_key:
        # The common case, spelled out: json.dumps of the dict costs more.
        line = b'{"v":%d,"t":"%s","n":%d}' % (SCHEMA_VERSION, template.id.encode(), len(blob))
        return line + b"\n" + blob, template
    # Signed as the companion will check it: the envelope as released.
    head = _MARKER.sub(lambda match: variables[ord(match.group(1)) - 1], text)
    signature = entry_signature(signing_key, dest, message.declare or None, head)
    meta = {"v": SCHEMA_VERSION, "t": template.id, "n": len(blob), "s": signature}
    return metadata_line(meta) + b"\n" + blob, template


def value_fragment(value: Any) -> bytes:
    """Return *value* as compact JSON, as part of the envelope's JSON."""
    # Most per-call values are strings, ints or null: skip the generic encoder.
    kind = type(value)
    if kind is str:
        return _encode_string(value).encode()
    if value is None:
        return b"null"
    if kind is int:
        return str(value).encode()
    return kombu_dumps(value, separators=_COMPACT).encode()  # type: ignore[no-any-return]


def template_id(record: bytes) -> str:
    """Return the id of a template record: a hash of its content."""
    return hashlib.sha1(record).hexdigest()[:16]


def expand_entry(payload: bytes, lookup: TemplateLookup) -> bytes:
    """Return *payload* in the single-part form, its template filled in.

    *lookup* maps a template id to its record (``None`` when unknown).
    Single-part payloads are returned as they are.

    Raises:
        EntryError: the template is unknown, or the values do not fit it.
    """
    if payload.startswith(_WHOLE_START):
        meta, head = _whole(payload, lookup)
        return metadata_line(meta) + b"\n" + head
    meta_line, sep, blob = payload.partition(b"\n")
    if not sep or b'"t":' not in meta_line:
        return payload
    meta, head = _expanded(_meta(meta_line, blob), blob, lookup)
    return metadata_line({**meta, "n": len(head)}) + b"\n" + head


def _whole(payload: bytes, lookup: TemplateLookup | None) -> tuple[dict[str, Any], bytes]:
    """Return the single-part metadata and envelope head of an entry stored whole."""
    found = _WHOLE_TAG.fullmatch(payload, len(payload) - 75)  # the tag's 75 bytes end it
    if found is None:
        raise EntryError(
            "damaged payload: a message stored whole must end with its celery-zdelay delivery tag"
        )
    route_id = found.group(1).decode()
    record = lookup(route_id) if lookup is not None else None
    if record is None:
        raise EntryError(
            f"template missing: the entry refers to route record {route_id!r}, "
            "which the store does not hold"
        )
    route, _ = _parsed_template(record)
    if route.get("w") != 1:
        raise EntryError(f"damaged payload: {route_id!r} is not a route record")
    head = payload[: found.start() + len(b'"delivery_tag":"')]
    meta = {"v": SCHEMA_VERSION, "n": len(head)}
    meta.update({key: route[key] for key in ("k", "l", "q") if key in route})
    return meta, head


def _expanded(
    meta: dict[str, Any], blob: bytes, lookup: TemplateLookup
) -> tuple[dict[str, Any], bytes]:
    """Return the single-part metadata and envelope head of a two-part entry."""
    template_ref = meta.get("t")
    record = lookup(template_ref) if isinstance(template_ref, str) else None
    if record is None:
        raise EntryError(
            f"template missing: the entry refers to template {template_ref!r}, "
            "which the store does not hold"
        )
    template_meta, _ = _parsed_template(record)
    # Values end in a NUL; entries parked by earlier releases only separate them.
    values = (blob[:-1] if blob.endswith(b"\x00") else blob).split(b"\x00")
    if len(values) != template_meta.get("c"):
        raise EntryError(
            f"damaged payload: {len(values)} values for a template of {template_meta.get('c')}"
        )
    pieces, numbers = template_pieces(record)
    parts = [pieces[0]]
    for number, piece in zip(numbers, pieces[1:], strict=True):
        parts.append(values[number - 1])
        parts.append(piece)
    head = b"".join(parts)
    expanded = {"v": meta["v"], "n": len(head)}
    expanded.update({k: template_meta[k] for k in ("k", "l", "q") if k in template_meta})
    if "s" in meta:
        expanded["s"] = meta["s"]
    return expanded, head


@functools.lru_cache(maxsize=1024)
def template_pieces(record: bytes) -> tuple[list[bytes], list[int]]:
    """Return the text of a template cut at its markers, and each marker's value number."""
    template_meta, text = _parsed_template(record)
    segments = _MARKER.split(text)
    numbers = [ord(number) for number in segments[1::2]]
    count = template_meta.get("c")
    if not isinstance(count, int) or any(n < 1 or n > count for n in numbers):
        raise EntryError("damaged template: a marker names a value it does not have")
    return segments[0::2], numbers


@functools.lru_cache(maxsize=1024)
def _parsed_template(record: bytes) -> tuple[dict[str, Any], bytes]:
    # Records never change (their id is their hash): parse each once.
    template_line, _, text = record.partition(b"\n")
    template_meta = json.loads(template_line)
    if not isinstance(template_meta, dict):
        raise EntryError("damaged template: its first line is not a mapping")
    return template_meta, text


def _envelope(message: TaskMessage) -> dict[str, Any]:
    properties = dict(message.properties)
    properties["delivery_info"] = {
        "exchange": message.exchange,
        "routing_key": message.routing_key,
    }
    properties["priority"] = message.priority
    properties["body_encoding"] = "base64"
    properties["delivery_tag"] = ""
    return {
        "body": base64.b64encode(message.body).decode("ascii"),
        "content-encoding": message.content_encoding,
        "content-type": message.content_type,
        "headers": message.headers,
        "properties": properties,
    }


def _head(envelope: dict[str, Any]) -> bytes:
    """Return the envelope's JSON up to the opening quote of the delivery tag."""
    text: str = kombu_dumps(envelope, separators=_COMPACT)
    if not text.endswith(_TAG_TAIL):  # pragma: no cover - guards the format
        raise AssertionError("envelope must end with the delivery tag")
    return text[:-3].encode()  # drop '"}}', keep the tag's opening quote


def metadata_line(meta: dict[str, Any]) -> bytes:
    return json.dumps(meta, separators=_COMPACT).encode()


def decode_entry(
    payload: bytes | None,
    signing_keys: tuple[bytes, ...] = (),
    templates: TemplateLookup | None = None,
    *,
    entry_id: str | None = None,
) -> TaskMessage:
    """Return the message parked in *payload*.

    *templates* looks up template records (see :meth:`Store.templates
    <celery_zdelay.store.Store.templates>`). *entry_id* is the id the entry
    is parked under: with *signing_keys*, a signed message is accepted only
    under its own task id, so a captured entry copied to another id is
    refused as a replay.

    Raises:
        EntryError: the payload is missing, damaged, of an unknown schema
            version, refers to a template it cannot have, or (when
            *signing_keys* are given) is unsigned, forged or replayed under
            another id.
    """
    if payload is None:
        raise EntryError("payload missing: the id was parked without a message")
    meta, head = _split(payload, templates)
    if signing_keys:
        signature = meta.get("s")
        if not isinstance(signature, str):
            raise EntryError("unsigned entry: zdelay_signing_key is set, so entries must be signed")
        if not any(
            hmac.compare_digest(signature, entry_signature(key, meta.get("k"), meta.get("q"), head))
            for key in signing_keys
        ):
            raise EntryError("bad signature: the entry was not signed with a current key")
    try:
        envelope = kombu_loads(head + b'zdelay"}}')
        properties = dict(envelope["properties"])
        delivery_info = properties.pop("delivery_info")
        priority = properties.pop("priority", 0)
        properties.pop("body_encoding", None)
        properties.pop("delivery_tag", None)
        headers = envelope["headers"]
        if not isinstance(headers, dict) or "id" not in headers:
            raise EntryError("damaged payload: the message has no task id header")
        if signing_keys and entry_id is not None and str(headers["id"]) != entry_id:
            # The signature covers the task id header: binding it to the
            # entry id stops a signed message from being released again
            # under another id.
            raise EntryError(
                f"replayed entry: the signed message is task {headers['id']}, "
                f"parked under id {entry_id}"
            )
        return TaskMessage(
            body=base64.b64decode(envelope["body"], validate=True),
            content_type=envelope["content-type"],
            content_encoding=envelope["content-encoding"],
            headers=headers,
            properties=properties,
            priority=int(priority or 0),
            exchange=delivery_info["exchange"],
            routing_key=delivery_info["routing_key"],
            declare=list(meta.get("q") or []),
            handoff_dest=meta.get("k"),
            handoff_layout=meta.get("l"),
            envelope_head=head,
        )
    except EntryError:
        raise
    except Exception as exc:
        raise EntryError(f"damaged payload: {type(exc).__name__}: {exc}") from exc


def parked_ms(payload: bytes | None) -> int | None:
    """Return when *payload* was parked, in epoch ms on the Redis clock.

    None when it was not recorded: stored whole (``zdelay_whole_messages``),
    parked by a release before park.lua stamped entries, or not read from
    the store.
    """
    match = _PARKED.match(payload) if payload else None
    return int(match.group(1)) if match else None


def with_max_late(payload: bytes, max_late_ms: int) -> bytes:
    """Return *payload* with *max_late_ms* first in its metadata line.

    Raises:
        ValueError: *payload* is a message stored whole, which has no metadata line.
    """
    if payload.startswith(_WHOLE_START) or not payload.startswith(b"{"):
        raise ValueError("a message stored whole has no metadata line to hold max_late")
    return b'{"m":%d,' % max_late_ms + payload[1:]


def entry_max_late_ms(payload: bytes | None) -> int | None:
    """Return the ``max_late`` (ms) *payload* was parked with; None when it has none."""
    match = _MAX_LATE.match(payload) if payload else None
    return int(match.group(1)) if match else None


def entry_headers(payload: bytes, templates: TemplateLookup | None = None) -> dict[str, Any]:
    """Return the Celery headers of *payload* (task name, argsrepr, ...).

    Used to list entries; it never decodes the message body. *templates* is
    as for :func:`decode_entry`.
    """
    _, head = _split(payload, templates)
    try:
        headers = kombu_loads(head + b'zdelay"}}')["headers"]
    except Exception as exc:
        raise EntryError(f"damaged payload: {type(exc).__name__}: {exc}") from exc
    if not isinstance(headers, dict):
        raise EntryError("damaged payload: headers are not a mapping")
    return headers


def entry_routing_key(expanded: bytes) -> str | None:
    """Return the routing key in the envelope's ``properties.delivery_info``.

    *expanded* is an entry as :func:`expand_entry` returns it; None when it
    names no routing key.
    """
    _, _, head = expanded.partition(b"\n")
    try:
        # The stored envelope stops inside the delivery tag string: close it.
        envelope = json.loads(head + b'"}}')
        key = envelope["properties"]["delivery_info"]["routing_key"]
    except (ValueError, KeyError, TypeError):
        return None
    return key if isinstance(key, str) else None


def template_ref(payload: bytes) -> str | None:
    """Return the id of the template a stored entry refers to, from its metadata line alone.

    None for an entry without one (stored whole, or with too many per-call
    values): reading only the first line, this never mistakes a value of
    the message's own headers for a template id.
    """
    end = payload.find(b"\n")
    if end < 0:
        # No metadata line (a message stored whole): the message's own
        # headers may hold anything, '"t":"..."' included.
        return None
    found = _TEMPLATE_REF.search(payload, 0, end)
    return found.group(1).decode() if found else None


def _split(payload: bytes, templates: TemplateLookup | None) -> tuple[dict[str, Any], bytes]:
    if payload.startswith(_WHOLE_START):
        return _whole(payload, templates)
    meta_line, sep, rest = payload.partition(b"\n")
    meta = _meta(meta_line if sep else b"", rest)
    if "t" in meta:
        if templates is None:
            raise EntryError("template missing: no template lookup was given to read the entry")
        return _expanded(meta, rest, templates)
    return meta, rest


def _meta(line: bytes, rest: bytes) -> dict[str, Any]:
    """Return the checked metadata line of a payload whose remainder is *rest*."""
    try:
        meta = json.loads(line) if line else None
    except ValueError:
        meta = None
    if not isinstance(meta, dict):
        raise EntryError("foreign entry: the payload does not start with celery-zdelay metadata")
    version = meta.get("v")
    if version != SCHEMA_VERSION:
        raise EntryError(
            f"unknown schema version {version!r}: this companion reads version "
            f"{SCHEMA_VERSION}; run a celery-zdelay release that knows the newer one"
        )
    if meta.get("n") != len(rest):
        raise EntryError("damaged payload: the message is truncated or was changed")
    return meta


def entry_signature(key: bytes, dest: Any, declare: Any, head: bytes) -> str:
    # The signature covers what decides where and what is published: the
    # message, its destination list and the queues declared for it.
    routing = _routing(json.dumps([dest, declare], separators=_COMPACT, sort_keys=True))
    return hmac.digest(key, routing + head, "sha256").hex()


@functools.lru_cache(maxsize=256)
def _routing(dumped: str) -> bytes:
    """Return the signed prefix for one (destination, declared queues) JSON."""
    return _SIGNATURE_CONTEXT + dumped.encode() + b"\0"


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_HEADERS_OPEN = b'"headers":{'
_NULL_ETA = b'"eta":null'
_NESTED = re.compile(rb"[\[{]")


def eta_text(due_ms: int) -> str:
    """Return the ``eta`` header of a message released ahead of *due_ms* (epoch ms, UTC).

    ISO 8601 with microseconds and the UTC offset, as handoff.lua writes it
    (``lua/_expand.lua``, ``zdelay_iso``): from whole ms, so nothing rounds it earlier.
    """
    return (_EPOCH + timedelta(milliseconds=due_ms)).isoformat(timespec="microseconds")


def with_eta(envelope: bytes, due_ms: int) -> bytes | None:
    """Return *envelope* (a kombu envelope, whole or up to its delivery tag) with ``eta`` *due_ms*.

    For a release ahead of the due time (``zdelay_release_ahead_seconds``):
    the worker's ETA timer then holds the task until due. The message's
    ``"eta":null`` is found without parsing the JSON, by the rule
    handoff.lua follows too (``zdelay_with_eta``): the first one after the
    envelope's ``"headers":{`` (the body before it is base64, the keys before
    it plain strings), preceded by ``{`` or ``,`` and with no ``{`` or ``[``
    between, so it is the top-level ``eta`` header Celery writes fifth
    (after lang, task, id, shadow), not a key nested in another header.
    None when the headers do not start that way: then the envelope cannot
    be released ahead as it is.
    """
    start = envelope.find(_HEADERS_OPEN)
    if start < 0:
        return None
    start += len(_HEADERS_OPEN)
    at = envelope.find(_NULL_ETA, start)
    if at < 0 or envelope[at - 1 : at] not in (b"{", b",") or _NESTED.search(envelope, start, at):
        return None
    value = b'"eta":"%s"' % eta_text(due_ms).encode()
    return envelope[:at] + value + envelope[at + len(_NULL_ETA) :]
