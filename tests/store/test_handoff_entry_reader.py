"""The handoff pushes only entries that read as entry.py writes them; the rest go to a companion.

Pins the lines of ``store/lua/_expand.lua`` (the entry reader loaded in
front of ``handoff.lua``; see docs/mutation.rst) through
:meth:`Store.handoff` on a private Redis, no worker or companion. A
template record is used only when it hashes to its id and reads as
``entry.py`` writes one: a JSON object first line whose ``c`` (1 to 255)
counts the values, a text starting ``{"body":`` whose markers each name a
value from 1 to ``c``. A message stored whole is pushed only when the
route record its delivery tag names hashes to its id and is one JSON
object line (``"w": 1``) and its newline. A single-part entry is pushed only when its first
line is a JSON object of version 1 whose ``n`` is the length of the rest.
Anything else is not pushed and not an error: it is leased to a companion,
which reads it fully and dead-letters what is damaged. Every template here
is written by hand, as someone with write access to Redis could.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import redis
from celery import Celery

from celery_zdelay.capture import capture
from celery_zdelay.entry import expand_entry
from celery_zdelay.parking import park_requests, store_for
from celery_zdelay.redis_layout import RedisLayout
from celery_zdelay.schedule import Due
from celery_zdelay.store import ClaimResult, ParkRequest
from tests.conftest import AppFactory
from tests.support.clock import redis_ms
from tests.support.keys import SHARD0

pytestmark = pytest.mark.timeout(60)

HOUR = 3_600_000
QUEUE = "celery"


def _real(app: Celery) -> ParkRequest:
    """The park request of a call of tests.record, as apply_delayed builds it."""
    call = app.tasks["tests.record"]
    _, messages = capture(app, lambda p: call.apply_async((1, 2), producer=p, task_id="real"))
    (request,) = park_requests(app, messages, [Due("a", 0)])
    assert request.template is not None
    return request


def _line(meta: object) -> bytes:
    return json.dumps(meta, separators=(",", ":")).encode()


def _entry(record: bytes, values: list[bytes], tid: str | None = None) -> tuple[str, bytes]:
    """The id of *record* and an entry using it with *values*, in entry.py's two-part form."""
    tid = tid or hashlib.sha1(record).hexdigest()[:16]
    blob = b"".join(v + b"\x00" for v in values)
    return tid, b'{"v":1,"t":"%s","n":%d}\n' % (tid.encode(), len(blob)) + blob


def _handoff(app: Celery, client: redis.Redis, payloads: dict[str, bytes]) -> ClaimResult:
    """Park *payloads* (id -> payload) due in their given order, and hand off what is due."""
    now = redis_ms(client)
    requests = [
        ParkRequest(task_id, Due("a", now - 100 + n), payload, QUEUE)
        for n, (task_id, payload) in enumerate(payloads.items())
    ]
    store = store_for(app)
    store.park(requests)
    fingerprint = RedisLayout(app.conf.broker_transport_options or {}).fingerprint
    return store.handoff(
        0,
        dests=(QUEUE,),
        layout=fingerprint,
        limit=100,
        lease_ms=HOUR,
        fresh=False,
        advance_ms=0,
        companion_id="companion-7",
        with_ids=True,
        held_dests=(),
    )


def _pushed_heads(client: redis.Redis) -> list[bytes]:
    """Each pushed message up to its delivery tag, in the order a worker takes them."""
    return [m.rpartition(b'"delivery_tag":')[0] for m in reversed(client.lrange(QUEUE, 0, -1))]


def test_only_template_records_that_read_as_entry_py_writes_them_are_used(
    app: Celery, redis_client: redis.Redis
) -> None:
    real = _real(app)
    assert real.template is not None
    meta_line, _, text = real.template.record.partition(b"\n")
    meta = json.loads(meta_line)
    values = real.payload.partition(b"\n")[2][:-1].split(b"\x00")
    count = meta["c"]
    assert count == len(values) > 1
    # The same message from one value: the others written into the text
    one_text = text
    for number in range(2, count + 1):
        one_text = one_text.replace(b"\x00" + bytes([number]), values[number - 1])

    def record(text_: bytes = text, **changes: object) -> bytes:
        return _line({**meta, **changes}) + b"\n" + text_

    extra = [b"unused"] * 300
    good = {
        "as-written": (record(), values),
        "one-value": (record(one_text, c=1), values[:1]),
        "255-values": (record(c=255), (values + extra)[:255]),
    }
    damaged = {
        "256-values": (record(c=256), (values + extra)[:256]),
        "no-values": (record(one_text.replace(b"\x00\x01", values[0]), c=0), []),
        "count-not-a-number": (record(c=str(count)), values),
        "line-not-an-object": (b"5\n" + text, values),
        "line-not-json": (b"not json\n" + text, values),
        "newline-first": (b"\n" + record(), values),
        "not-a-body": (record(b" " + text), values),
        "one-value-too-many": (record(), [*values, b"extra"]),
        "marker-0": (record(text + b"\x00\x00"), values),
        "marker-past-c": (record(text + b"\x00" + bytes([count + 1])), values),
    }
    payloads: dict[str, bytes] = {}
    for name, (rec, vals) in {**good, **damaged}.items():
        tid, payloads[name] = _entry(rec, vals)
        redis_client.hset(SHARD0.templates, tid, rec)
    # A record gone, and one rewritten under the id of another
    payloads["record-gone"] = _entry(record(c=count + 1), [*values, b"x"])[1]
    rewritten, payloads["rewritten"] = _entry(record(c=count + 2), [*values, b"x", b"y"])
    redis_client.hset(SHARD0.templates, rewritten, record(c=count + 2) + b" ")

    result = _handoff(app, redis_client, payloads)

    assert result.handed_ids == list(good)
    lookup = {real.template.id: real.template.record}.get
    head = expand_entry(real.payload, lookup).partition(b"\n")[2]
    assert _pushed_heads(redis_client) == [head.rpartition(b'"delivery_tag":')[0]] * len(good)
    assert [e.task_id for e in result.entries] == [*damaged, "record-gone", "rewritten"]


def test_only_single_part_entries_that_read_as_entry_py_writes_them_are_pushed(
    app: Celery, redis_client: redis.Redis
) -> None:
    real = _real(app)
    assert real.template is not None
    whole = expand_entry(real.payload, {real.template.id: real.template.record}.get)
    line, _, head = whole.partition(b"\n")
    meta = json.loads(line)
    assert (meta["v"], meta["n"]) == (1, len(head))

    payloads = {
        "as-written": whole,
        "version-2": _line({**meta, "v": 2}) + b"\n" + head,
        "length-off": _line({**meta, "n": len(head) + 1}) + b"\n" + head,
        "line-not-an-object": b"5\n" + head,
        "line-not-json": b"not json\n" + head,
        "newline-first": b"\n" + whole,
        "not-a-body": line + b"\n" + b'{"Body":"' + head[9:],
    }

    result = _handoff(app, redis_client, payloads)

    assert result.handed_ids == ["as-written"]
    assert _pushed_heads(redis_client) == [head.rpartition(b'"delivery_tag":')[0]]
    assert [e.task_id for e in result.entries] == list(payloads)[1:]


def test_only_route_records_that_read_as_entry_py_writes_them_route_a_message_stored_whole(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = make_test_app(conf={"zdelay_whole_messages": True})
    real = _real(app)
    assert real.template is not None
    assert real.payload.startswith(b'{"b')
    record = real.template.record
    assert record.endswith(b"\n")
    meta = json.loads(record)
    # The record's id opens the delivery tag's last 52 bytes: id.uuid"}}
    start = len(real.payload) - 52

    def naming(rid: str) -> bytes:
        return real.payload[:start] + rid.encode() + real.payload[start + 16 :]

    forged = {
        "as-written": record,
        "not-an-object": b"5\n",
        "another-form": _line({**meta, "w": 2}) + b"\n",
        "more-after-it": record + b"more",
    }
    payloads = {}
    for name, rec in forged.items():
        rid = hashlib.sha1(rec).hexdigest()[:16]
        redis_client.hset(SHARD0.templates, rid, rec)
        payloads[name] = naming(rid)
    # A delivery tag not in the form entry.py writes names the record: not ours
    tag_end = len(real.payload) - 36
    assert real.payload[tag_end : tag_end + 1] == b"."
    payloads["tag-without-its-dot"] = real.payload[:tag_end] + b"-" + real.payload[tag_end + 1 :]
    opening = real.payload.rindex(b'"delivery_tag":"zdelay.') + len(b'"delivery_tag":"zdelay')
    payloads["tag-opening-without-its-dot"] = (
        real.payload[:opening] + b"-" + real.payload[opening + 1 :]
    )
    # A record rewritten under its id: it no longer hashes to it
    rewritten = hashlib.sha1(b"the record first written").hexdigest()[:16]
    redis_client.hset(SHARD0.templates, rewritten, record)
    payloads["rewritten"] = naming(rewritten)
    assert payloads["as-written"] == real.payload

    result = _handoff(app, redis_client, payloads)

    assert result.handed_ids == ["as-written"]
    assert redis_client.lrange(QUEUE, 0, -1) == [real.payload]
    assert [e.task_id for e in result.entries] == list(payloads)[1:]
