"""The largest value a Redis server takes in one command (``proto-max-bulk-len``).

Redis answers a longer value with a protocol error and closes the
connection, which looks like an unreachable server. So the value is checked
before it is sent: parking refuses it with an error that says so, and the
companion dead-letters a message too large for its broker instead of failing
its batch on every pass (which would hold back everything due after it).
"""

from __future__ import annotations

import logging
from typing import Any

from kombu.utils.json import dumps as kombu_dumps
from kombu.utils.json import loads as kombu_loads
from redis.exceptions import ResponseError

logger = logging.getLogger(__name__)

#: Redis's default, kept by servers that hide CONFIG (most managed services).
DEFAULT_BULK_LIMIT = 512 * 1024 * 1024

#: Stands in for the delivery tag kombu adds after a parked head (a uuid4)
#: and the closing '"}}'.
_TAG_AND_CLOSE = b"0" * 36 + b'"}}'


class MessageTooLarge(ValueError):
    """A message over the broker's ``proto-max-bulk-len``: the message's fault, not the broker's."""


def bulk_limit(client: Any) -> int:
    """Return the ``proto-max-bulk-len`` of *client*'s server, in bytes.

    A server that refuses CONFIG (renamed, or denied by an ACL) is assumed
    to keep Redis's default. Connection errors propagate.
    """
    try:
        reply = client.config_get("proto-max-bulk-len")
        return int(reply["proto-max-bulk-len"])
    except (ResponseError, KeyError, TypeError, ValueError):
        logger.debug("proto-max-bulk-len unknown, assuming %d", DEFAULT_BULK_LIMIT, exc_info=True)
        return DEFAULT_BULK_LIMIT


def envelope_size(head: bytes, body: bytes, limit: int) -> int:
    """The bytes kombu's Redis envelope of a message takes, exactly when near *limit*.

    *head* is the envelope the message was parked as, up to its delivery tag
    (empty for a message not read from an entry: then its body alone, as
    base64, a lower bound). kombu writes the same JSON with a space after
    each separator, which adds less than half: only an envelope that could
    be over *limit* is serialized again, the way kombu does.
    """
    if not head:
        return (len(body) + 2) // 3 * 4
    least = len(head) + len(_TAG_AND_CLOSE)
    if least > limit or least * 3 // 2 <= limit:
        return least
    return len(kombu_dumps(kombu_loads(head + _TAG_AND_CLOSE)).encode())


def too_large(size: int, limit: int) -> str | None:
    """The dead-letter reason of a message of *size* bytes, or None when it fits."""
    if size <= limit:
        return None
    return (
        f"the message is {size} bytes, over the Redis broker's proto-max-bulk-len "
        f"({limit} bytes): Redis would close the connection on it. Raise proto-max-bulk-len "
        "on that Redis, then requeue this entry (celery -A proj zdelay dead requeue ID)"
    )
