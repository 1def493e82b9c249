"""celery-redis-plus's waiting messages, read and taken out of the broker's Redis (zdelay adopt).

celery-redis-plus (a kombu transport for Redis, read at its release 0.4.1)
keeps every message in the broker's Redis, under the transport option
``global_keyprefix``:

``message:<delivery tag>``, a hash
    ``payload`` (kombu's message as JSON: its body base64, its ``headers``,
    and ``properties`` with ``delivery_info``, ``priority`` and ``eta``),
    ``routing_key`` (its queue), ``native_delayed``, ``eta`` (epoch
    seconds, a float) and ``delivery_count``.
``messages_index:<queue>``, a sorted set
    every message of the queue not yet acknowledged, scored by the epoch
    *seconds* (a float) when the transport looks at it next: a delayed
    message's eta, a delivered one's visibility deadline.
``queue:<queue>``, a sorted set
    what a consumer pops next (one script: pop, then a visibility deadline
    in the index), scored by priority and epoch milliseconds.

A message published with an eta more than :data:`HANDOVER_S` ahead waits in
the index alone, ``native_delayed`` 1: celery-redis-plus's "native delayed
delivery". A worker's sweep moves it into the queue set that long before its
eta (clearing ``native_delayed``), and the consumer that pops it holds it in
memory until due, as Celery holds any ETA task. One published with a
shorter delay goes into the queue set at once, its eta in its headers.

Every message still waiting (delayed, or in the queue set, popped by no
consumer) is read here as kombu reads it; :func:`take` removes one only if
it is still waiting, in one script, so a consumer that popped it meanwhile
keeps it.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis
from kombu.message import Message

from .errors import ConfigurationError
from .store.client import close_client, sanitize_url
from .store.scripts import LuaFile, Scripts, ScriptSpec, register

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "HANDOVER_S",
    "INDEX_PREFIX",
    "RedisPlusBroker",
    "Waiting",
]

#: How long before its eta celery-redis-plus hands a delayed message to a
#: worker (its DEFAULT_REQUEUE_CHECK_INTERVAL): shorter delays never wait
#: in its index.
HANDOVER_S = 60
#: The key prefixes of celery-redis-plus (its constants.py).
INDEX_PREFIX = "messages_index:"
_QUEUE_PREFIX = "queue:"
_MESSAGE_PREFIX = "message:"
#: Its consumers block in BZMPOP while a queue is empty; no other client of
#: a Celery broker uses the command.
_CONSUMER_COMMAND = "bzmpop"
#: The broker URLs of a Redis server (celery-redis-plus takes valkey:// too).
_SCHEMES = ("redis://", "rediss://", "unix://", "valkey://", "valkeys://")
#: Index entries read per round trip.
_PAGE = 1000

#: Takes one message out, if no consumer holds it (``redis_plus_take.lua``, run bare).
_TAKE = register(
    ScriptSpec(
        "redis_plus_take",
        LuaFile(__package__ or "celery_zdelay", "redis_plus_take.lua"),
        guarded=False,
    )
)[0]


@dataclass(frozen=True)
class Waiting:
    """One message of a celery-redis-plus queue, as an index entry names it."""

    tag: str
    #: The message, when no consumer holds it (else None: delivered and not
    #: yet acknowledged, or gone since the index was read).
    message: Message | None
    #: When celery-redis-plus looks at the entry next (epoch ms): for a
    #: delivered message, when it gives it back to its queue.
    next_ms: int


class RedisPlusBroker:
    """celery-redis-plus's keys in the broker's Redis: its queues, their messages, taking them.

    *channel* becomes the channel of each message read: acknowledging one
    only marks it done (:meth:`take` removed it from Redis already).
    """

    def __init__(self, url: str, *, prefix: str = "", channel: Any = None) -> None:
        self.url = url
        self.prefix = prefix
        self.channel = channel
        self.client = redis.Redis.from_url(_redis_scheme(url))
        self._scripts = Scripts(self.client, [_TAKE])

    @classmethod
    def of(cls, app: Celery, *, channel: Any = None) -> RedisPlusBroker:
        """celery-redis-plus's keys in the broker of *app* (its URL, its ``global_keyprefix``).

        Raises:
            ConfigurationError: the broker is not a Redis server.
        """
        options = app.conf.broker_transport_options or {}
        url = str(app.conf.broker_write_url or app.conf.broker_url or "").split(";")[0]
        if not url.startswith(_SCHEMES):
            raise ConfigurationError(
                f"The broker {sanitize_url(url)} is not a Redis server: celery-redis-plus keeps "
                "its messages in the broker's Redis. Run zdelay adopt --redis-plus with the "
                "broker_url (and broker_transport_options) the project had with "
                "celery-redis-plus. Nothing was taken."
            )
        return cls(url, prefix=str(options.get("global_keyprefix") or ""), channel=channel)

    def close(self) -> None:
        close_client(self.client)

    def queues(self) -> list[str]:
        """Return the names of the queues that have an index (a message not yet acknowledged)."""
        pattern = f"{_escape(self.prefix + INDEX_PREFIX)}*"
        start = len(self.prefix + INDEX_PREFIX)
        found = {key.decode()[start:] for key in self.client.scan_iter(match=pattern, count=1000)}
        return sorted(found)

    def consumers(self) -> int:
        """Return how many clients of the broker's database wait in celery-redis-plus's BZMPOP.

        A worker of celery-redis-plus whose queues are empty waits so; a
        busy one runs scripts instead, and is not seen here. 0 when the
        broker refuses CLIENT LIST.
        """
        db = str(self.client.connection_pool.connection_kwargs.get("db", 0))
        try:
            clients = self.client.client_list()
        except redis.ResponseError:
            return 0
        return sum(1 for c in clients if c.get("cmd") == _CONSUMER_COMMAND and c.get("db") == db)

    def tags(self, queue: str) -> list[str]:
        """Return the delivery tags in *queue*'s index, in their order (due time first)."""
        key = self.prefix + INDEX_PREFIX + queue
        return [_text(tag) for tag in self.client.zrange(key, 0, -1)]

    def read(self, queue: str, tags: Sequence[str]) -> Iterator[Waiting]:
        """Yield each of *tags* of *queue* still in its index, its message when none holds it."""
        for start in range(0, len(tags), _PAGE):
            page = tags[start : start + _PAGE]
            with self.client.pipeline(transaction=False) as pipe:
                for tag in page:
                    pipe.hmget(self._message(tag), "payload", "native_delayed")
                    pipe.zscore(self.prefix + _QUEUE_PREFIX + queue, tag)
                    pipe.zscore(self.prefix + INDEX_PREFIX + queue, tag)
                found = pipe.execute()
            for index, tag in enumerate(page):
                (payload, delayed), queued, next_s = found[3 * index : 3 * index + 3]
                if payload is None or next_s is None:
                    continue  # acknowledged since the index was read
                waiting = queued is not None or delayed == b"1"
                message = self._message_of(tag, payload) if waiting else None
                yield Waiting(tag, message, round(float(next_s) * 1000))

    def take(self, queue: str, tags: Sequence[str]) -> list[bool]:
        """Remove each of *tags* from celery-redis-plus if still waiting; return which were.

        One script per message, in one round trip: a message a consumer
        popped meanwhile is left to it (False).
        """
        if not tags:
            return []
        keys = (self.prefix + INDEX_PREFIX + queue, self.prefix + _QUEUE_PREFIX + queue)
        with self.client.pipeline(transaction=False) as pipe:
            for tag in tags:
                self._scripts["redis_plus_take"](
                    keys=[*keys, self._message(tag)], args=[tag], client=pipe
                )
            return [int(reply) == 1 for reply in pipe.execute()]

    def _message(self, tag: str) -> str:
        return f"{self.prefix}{_MESSAGE_PREFIX}{tag}"

    def _message_of(self, tag: str, payload: bytes) -> Message:
        """The message as kombu's virtual transport hands it to a consumer."""
        try:
            document = json.loads(payload)
            properties = dict(document.get("properties") or {})
            body = document.get("body", "")
            if properties.get("body_encoding") == "base64":
                body = base64.b64decode(body, validate=True)
            headers = document.get("headers") or {}
        except (ValueError, TypeError, AttributeError, binascii.Error):
            # Not kombu's format: classified as no Celery task message.
            return Message(body=payload, delivery_tag=tag, channel=self.channel)
        return Message(
            body=body.encode("utf-8") if isinstance(body, str) else body,
            delivery_tag=tag,
            content_type=document.get("content-type"),
            content_encoding=document.get("content-encoding"),
            delivery_info=properties.get("delivery_info") or {},
            properties=properties,
            headers=headers if isinstance(headers, dict) else {},
            channel=self.channel,
        )


def _redis_scheme(url: str) -> str:
    """celery-redis-plus also takes valkey:// URLs (the same protocol)."""
    for scheme in ("valkey", "valkeys"):
        if url.startswith(f"{scheme}://"):
            return "redis" + url[len("valkey") :]
    return url


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _escape(text: str) -> str:
    """*text* as a literal inside a SCAN MATCH pattern."""
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)
