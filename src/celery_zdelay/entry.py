"""The parked entry: one task message, stored until it is due.

A payload is two parts separated by the first newline::

    {"v":1,"n":812,"k":"celery","l":"3f2a9c1e","q":["celery"]}
    {"body":"W1s0Ml0s...","content-encoding":"utf-8",...,"delivery_tag":"

The first line is metadata: schema version ``v``, length ``n`` of the second
part, and optionally the kombu list key ``k`` and transport layout ``l`` for
the Redis handoff, the queues ``q`` to declare before publishing, and the
signature ``s``. The second part is the message in the envelope kombu's Redis
transport pushes, cut off at the opening quote of the delivery tag, so
handoff.lua only appends a tag and ``"}}``. The body stays serialized (and
compressed, if Celery compressed it): nothing here decodes task arguments.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from dataclasses import dataclass, field
from typing import Any

from kombu.utils.json import dumps as kombu_dumps
from kombu.utils.json import loads as kombu_loads

from .errors import EntryError

__all__ = ["SCHEMA_VERSION", "TaskMessage", "decode_entry", "encode_entry", "entry_headers"]

#: Version written into every new entry; readers accept this one.
SCHEMA_VERSION = 1

_TAG_TAIL = '"delivery_tag":""}}'
_COMPACT = (",", ":")
_SIGNATURE_CONTEXT = b"celery-zdelay entry v1\0"


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
) -> bytes:
    """Return the payload that parks *message*.

    *dest* and *layout* name the Redis broker list the handoff pushes to;
    *signing_key* signs the entry so companions can refuse forged ones.
    """
    properties = dict(message.properties)
    properties["delivery_info"] = {
        "exchange": message.exchange,
        "routing_key": message.routing_key,
    }
    properties["priority"] = message.priority
    properties["body_encoding"] = "base64"
    properties["delivery_tag"] = ""
    envelope = {
        "body": base64.b64encode(message.body).decode("ascii"),
        "content-encoding": message.content_encoding,
        "content-type": message.content_type,
        "headers": message.headers,
        "properties": properties,
    }
    text: str = kombu_dumps(envelope, separators=_COMPACT)
    if not text.endswith(_TAG_TAIL):  # pragma: no cover - guards the format
        raise AssertionError("envelope must end with the delivery tag")
    head = text[:-3].encode()  # drop '"}}', keep the tag's opening quote
    meta: dict[str, Any] = {"v": SCHEMA_VERSION, "n": len(head)}
    if dest is not None:
        meta["k"] = dest
        meta["l"] = layout
    if message.declare:
        meta["q"] = message.declare
    if signing_key is not None:
        meta["s"] = _signature(signing_key, meta.get("k"), meta.get("q"), head)
    return json.dumps(meta, separators=_COMPACT).encode() + b"\n" + head


def decode_entry(payload: bytes | None, signing_keys: tuple[bytes, ...] = ()) -> TaskMessage:
    """Return the message parked in *payload*.

    Raises:
        EntryError: the payload is missing, damaged, of an unknown schema
            version, or (when *signing_keys* are given) unsigned or forged.
    """
    if payload is None:
        raise EntryError("payload missing: the id was parked without a message")
    meta, head = _split(payload)
    if signing_keys:
        signature = meta.get("s")
        if not isinstance(signature, str):
            raise EntryError("unsigned entry: zdelay_signing_key is set, so entries must be signed")
        if not any(
            hmac.compare_digest(signature, _signature(key, meta.get("k"), meta.get("q"), head))
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
        )
    except EntryError:
        raise
    except Exception as exc:
        raise EntryError(f"damaged payload: {type(exc).__name__}: {exc}") from exc


def entry_headers(payload: bytes) -> dict[str, Any]:
    """Return the Celery headers of *payload* (task name, argsrepr, ...).

    Used to list entries; it never decodes the message body.
    """
    _, head = _split(payload)
    try:
        headers = kombu_loads(head + b'zdelay"}}')["headers"]
    except Exception as exc:
        raise EntryError(f"damaged payload: {type(exc).__name__}: {exc}") from exc
    if not isinstance(headers, dict):
        raise EntryError("damaged payload: headers are not a mapping")
    return headers


def _split(payload: bytes) -> tuple[dict[str, Any], bytes]:
    meta_line, sep, head = payload.partition(b"\n")
    try:
        meta = json.loads(meta_line) if sep else None
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
    if meta.get("n") != len(head):
        raise EntryError("damaged payload: the message is truncated or was changed")
    return meta, head


def _signature(key: bytes, dest: Any, declare: Any, head: bytes) -> str:
    # The signature covers what decides where and what is published: the
    # message, its destination list and the queues declared for it.
    routing = json.dumps([dest, declare], separators=_COMPACT, sort_keys=True).encode()
    digest = hmac.new(key, _SIGNATURE_CONTEXT + routing + b"\0" + head, hashlib.sha256)
    return digest.hexdigest()
