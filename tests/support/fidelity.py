"""Comparing a released message with the one Celery sends natively.

What "the same message" means, exactly: the body (the serialized, maybe
compressed task payload) byte for byte, and the envelope as the same JSON
document: the same keys in the same order with the same values, apart from
the delivery tag (each publish has its own), the AMQP ``expiration``
(a TTL counted from each publish; present in both and within 5 s), and the
``zdelay_eta`` header the parked one adds (the ETA Celery would have sent,
which the worker puts back into ``request.eta``: tests/test_request_eta.py;
it must be there, as text). The
handoff writes the envelope's JSON without the spaces kombu puts after
``,`` and ``:``; no JSON reader sees that, so whitespace is not compared.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from kombu import Connection, Queue

from tests.helpers import wait_for

__all__ = ["PRIORITY_SEP", "assert_same_message", "canonical", "raw_amqp"]

#: kombu's Redis transport: the list of priority N is "<queue>\x06\x16<N>".
PRIORITY_SEP = "\x06\x16"

Message = bytes | str | dict[str, Any]


def canonical(message: Message) -> bytes:
    """Return *message*'s JSON without insignificant whitespace, keys in their order."""
    parsed = json.loads(message) if isinstance(message, (bytes, str)) else message
    return json.dumps(parsed, separators=(",", ":")).encode()


def assert_same_message(parked: Message, native: Message) -> None:
    """Assert two Redis-transport messages are the same (see the module docstring).

    Pass raw bytes where you have them; a parsed message keeps its key order.
    """
    parked_doc = json.loads(canonical(parked))
    native_doc = json.loads(canonical(native))
    assert isinstance(parked_doc["headers"].pop("zdelay_eta"), str)
    assert base64.b64decode(parked_doc["body"]) == base64.b64decode(native_doc["body"])
    assert parked_doc["properties"].pop("delivery_tag")
    assert native_doc["properties"].pop("delivery_tag")
    parked_ttl = parked_doc["properties"].pop("expiration", None)
    native_ttl = native_doc["properties"].pop("expiration", None)
    assert (parked_ttl is None) == (native_ttl is None)
    if parked_ttl is not None:
        assert abs(int(parked_ttl) - int(native_ttl)) <= 5_000
    # Byte for byte, keys in their order: dict equality would not see an order.
    assert canonical(parked_doc) == canonical(native_doc), (parked_doc, native_doc)


def raw_amqp(url: str, queue: str) -> dict[str, Any]:
    """Get one message from RabbitMQ *queue*: body bytes and the fields a worker reads."""
    with Connection(url) as connection:
        bound = Queue(queue).bind(connection.default_channel)
        message = wait_for(lambda: bound.get(no_ack=True), message=f"a message on {queue}")
        return {
            "body": message.body,
            "headers": message.headers,
            "content_type": message.content_type,
            "content_encoding": message.content_encoding,
            "properties": {
                k: v
                for k, v in message.properties.items()
                if k in ("priority", "correlation_id", "reply_to", "delivery_mode")
            },
            "routing_key": message.delivery_info["routing_key"],
        }
