"""A parked entry reads back as exactly the message parked, and a signed one only as signed.

Pins what ``celery_zdelay/entry.py`` promises, line by line where mutation
testing found the suite silent (see docs/mutation.rst): a signature covers
the message *and* where it goes (destination list, declared queues), by
every way an attacker with write access to Redis could redirect it (the
template, the route of a single-part entry, the entry's own metadata); a
signed entry is bound to its id; every form of entry (two-part, single-part,
an earlier release's) decodes to the same message, field for field, equal
to it and printed as it; the listing helpers (``entry_headers``,
``entry_routing_key``, ``template_ref``) read an entry's headers, routing
key and template id exactly, and a damaged entry only as "damaged" (an
EntryError or None, never another exception that would stop a listing).
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from celery_zdelay.entry import (
    MAX_VARIABLES,
    SCHEMA_VERSION,
    TaskMessage,
    Template,
    decode_entry,
    encode_entry,
    entry_headers,
    entry_routing_key,
    expand_entry,
    parked_ms,
    template_id,
    template_ref,
)
from celery_zdelay.errors import EntryError

pytestmark = pytest.mark.timeout(30)

KEY, OLD_KEY, STRANGER = b"current key", b"old key", b"not ours"


def _message(task_id: str = "t-1", **headers: Any) -> TaskMessage:
    return TaskMessage(
        body=b'[[42, "x"], {"k": 1.5}, {}]',
        content_type="application/json",
        content_encoding="utf-8",
        headers={
            "lang": "py",
            "task": "shop.cancel",
            "id": task_id,
            "retries": 0,
            "argsrepr": "(42, 'x')",
            "kwargsrepr": None,
            "eta": None,
            **headers,
        },
        properties={"correlation_id": task_id, "reply_to": "r-1", "delivery_mode": 2},
        priority=3,
        exchange="orders",
        routing_key="orders.cancel",
        declare=["orders"],
        handoff_dest="orders",
        handoff_layout="L1",
    )


def _park(message: TaskMessage, **options: Any) -> tuple[bytes, dict[str, bytes]]:
    payload, template = encode_entry(
        message, dest=message.handoff_dest, layout=message.handoff_layout, **options
    )
    templates = {template.id: template.record} if template else {}
    return payload, templates


def _same(a: TaskMessage, b: TaskMessage) -> None:
    for name in (
        "body",
        "content_type",
        "content_encoding",
        "headers",
        "properties",
        "priority",
        "exchange",
        "routing_key",
        "declare",
        "handoff_dest",
        "handoff_layout",
    ):
        assert getattr(a, name) == getattr(b, name), name


def _retemplate(templates: dict[str, bytes], payload: bytes, **changes: Any) -> bytes:
    """Rewrite the entry's template with *changes* to its metadata; point the entry at it."""
    meta_line, _, blob = payload.partition(b"\n")
    meta = json.loads(meta_line)
    record = templates[meta["t"]]
    template_line, _, text = record.partition(b"\n")
    forged_line = {**json.loads(template_line), **changes}
    forged = json.dumps(forged_line, separators=(",", ":")).encode() + b"\n" + text
    templates[template_id(forged)] = forged
    meta["t"] = template_id(forged)
    return json.dumps(meta, separators=(",", ":")).encode() + b"\n" + blob


def test_an_entry_reads_back_as_the_message_parked_in_every_form() -> None:
    message = _message()
    payload, templates = _park(message)
    _same(decode_entry(payload, templates=templates.get), message)
    single = expand_entry(payload, templates.get)
    assert single.startswith(b'{"v":1,"n":')
    _same(decode_entry(single), message)
    assert expand_entry(single, templates.get) == single
    # An earlier release only separated the values, with no NUL after the last.
    meta_line, _, blob = payload.partition(b"\n")
    meta = json.loads(meta_line)
    meta["n"] = len(blob) - 1
    older = json.dumps(meta).encode() + b"\n" + blob[:-1]
    _same(decode_entry(older, templates=templates.get), message)
    assert entry_headers(payload, templates.get) == message.headers


def test_a_value_repeated_in_a_message_is_stored_once() -> None:
    payload, templates = _park(_message(task_id="same", root_id="same", parent_id="same"))
    (record,) = templates.values()
    count = json.loads(record.partition(b"\n")[0])["c"]
    blob = payload.partition(b"\n")[2]
    assert blob.split(b"\x00")[:-1].count(b'"same"') == 1
    assert len(blob.split(b"\x00")) - 1 == count
    _same(
        decode_entry(payload, templates=templates.get),
        _message("same", root_id="same", parent_id="same"),
    )


def test_per_call_values_of_every_json_kind_read_back_exactly() -> None:
    message = _message(stamps={"a": [1, 2.5, None, True]}, timelimit=[None, 30], shadow='ü\n"')
    payload, templates = _park(message)
    _same(decode_entry(payload, templates=templates.get), message)


def _values(message: TaskMessage) -> int:
    _, template = encode_entry(message)
    assert template is not None
    return int(json.loads(template.record.partition(b"\n")[0])["c"])


@pytest.mark.parametrize("beyond", [0, 1])
def test_up_to_the_most_values_a_template_holds_it_is_a_template_then_single_part(
    beyond: int,
) -> None:
    base = _values(_message())
    message = _message(**{f"h{i}": f"v{i}" for i in range(MAX_VARIABLES - base + beyond)})
    payload, template = encode_entry(message, dest="orders", layout="L1", signing_key=KEY)
    if beyond:
        assert template is None
        assert payload.startswith(b'{"v":1,"n":')
    else:
        assert template is not None
        assert json.loads(template.record.partition(b"\n")[0])["c"] == MAX_VARIABLES
    templates = {template.id: template.record} if template else {}
    _same(decode_entry(payload, (KEY,), templates.get, entry_id="t-1"), message)


def test_a_signed_entry_verifies_under_each_current_key_and_no_other() -> None:
    payload, templates = _park(_message(), signing_key=OLD_KEY)
    decode_entry(payload, (KEY, OLD_KEY), templates.get, entry_id="t-1")
    with pytest.raises(EntryError, match="bad signature"):
        decode_entry(payload, (KEY, STRANGER), templates.get, entry_id="t-1")
    unsigned, plain = _park(_message())
    with pytest.raises(EntryError, match="unsigned entry"):
        decode_entry(unsigned, (KEY,), plain.get)
    # Without keys nothing is checked: a signed entry reads like any other.
    decode_entry(payload, (), templates.get)


@pytest.mark.parametrize(
    "change", [{"k": "payments"}, {"q": ["payments"]}, {"k": None}, {"q": None}]
)
def test_a_signed_entry_redirected_through_its_template_is_refused(change: dict[str, Any]) -> None:
    payload, templates = _park(_message(), signing_key=KEY)
    forged = _retemplate(templates, payload, **change)
    with pytest.raises(EntryError, match="bad signature"):
        decode_entry(forged, (KEY,), templates.get, entry_id="t-1")
    # The unchanged metadata still verifies: the refusal is the redirect's.
    decode_entry(_retemplate(templates, payload), (KEY,), templates.get, entry_id="t-1")


@pytest.mark.parametrize("change", [{"k": "payments"}, {"q": ["payments"]}, {"s": "0" * 64}])
def test_a_signed_single_part_entry_redirected_in_its_metadata_is_refused(
    change: dict[str, Any],
) -> None:
    message = _message(**{f"h{i}": f"v{i}" for i in range(MAX_VARIABLES)})
    payload, template = encode_entry(message, dest="orders", layout="L1", signing_key=KEY)
    assert template is None
    decode_entry(payload, (KEY,), entry_id="t-1")
    meta_line, _, head = payload.partition(b"\n")
    meta = {**json.loads(meta_line), **change}
    forged = json.dumps(meta).encode() + b"\n" + head
    with pytest.raises(EntryError, match="bad signature"):
        decode_entry(forged, (KEY,), entry_id="t-1")


def test_a_signed_entry_with_a_changed_value_is_refused() -> None:
    payload, templates = _park(_message(), signing_key=KEY)
    forged = payload.replace(b"(42, 'x')", b"(43, 'x')")
    assert forged != payload
    with pytest.raises(EntryError, match="bad signature"):
        decode_entry(forged, (KEY,), templates.get, entry_id="t-1")


def test_a_signed_entry_is_accepted_under_its_own_id_only() -> None:
    payload, templates = _park(_message(), signing_key=KEY)
    decode_entry(payload, (KEY,), templates.get, entry_id="t-1")
    decode_entry(payload, (KEY,), templates.get)
    with pytest.raises(EntryError, match="replayed entry"):
        decode_entry(payload, (KEY,), templates.get, entry_id="t-2")
    # Unsigned reading (no keys) does not bind ids: nothing vouches for them.
    decode_entry(payload, (), templates.get, entry_id="t-2")


def test_a_damaged_or_foreign_entry_is_refused_with_its_reason() -> None:
    payload, templates = _park(_message())
    meta_line, _, blob = payload.partition(b"\n")
    meta = json.loads(meta_line)
    cases = {
        b"": "foreign entry",
        b"not json\n" + blob: "foreign entry",
        b"[1]\n" + blob: "foreign entry",
        payload + b"x": "truncated or was changed",
        payload[:-1]: "truncated or was changed",
        json.dumps({**meta, "v": SCHEMA_VERSION + 1}).encode() + b"\n" + blob: "unknown schema",
        json.dumps({**meta, "t": "0" * 16}).encode() + b"\n" + blob: "template missing",
        json.dumps({**meta, "t": 7}).encode() + b"\n" + blob: "template missing",
    }
    for bad, reason in cases.items():
        with pytest.raises(EntryError, match=reason):
            decode_entry(bad, templates=templates.get)
    with pytest.raises(EntryError, match="payload missing"):
        decode_entry(None)
    with pytest.raises(EntryError, match="no template lookup"):
        decode_entry(payload)
    extra = blob + b'"extra"\x00'
    with pytest.raises(EntryError, match="values for a template of"):
        decode_entry(
            json.dumps({**meta, "n": len(extra)}).encode() + b"\n" + extra, templates=templates.get
        )


def test_a_template_whose_markers_name_missing_values_is_refused() -> None:
    payload, templates = _park(_message())
    meta = json.loads(payload.partition(b"\n")[0])
    record = templates[meta["t"]]
    line, _, text = record.partition(b"\n")
    count = json.loads(line)["c"]
    for wrong in (0, count + 1):
        bad = line + b"\n" + text.replace(b"\x00\x01", b"\x00" + bytes([wrong]), 1)
        with pytest.raises(EntryError, match="damaged template"):
            expand_entry(
                _retemplate({**templates, meta["t"]: bad}, payload),
                {template_id(bad): bad, meta["t"]: bad}.get,
            )
    not_a_mapping = b"[1]\n" + text
    with pytest.raises(EntryError, match="first line is not a mapping"):
        decode_entry(payload, templates={meta["t"]: not_a_mapping}.get)


def test_a_message_stored_whole_reads_back_through_its_route_record() -> None:
    message = _message()
    payload, route = encode_entry(message, dest="orders", layout="L1", whole=True)
    assert route is not None
    assert payload.startswith(b'{"body":"')
    _same(decode_entry(payload, templates={route.id: route.record}.get), message)
    assert parked_ms(payload) is None
    with pytest.raises(EntryError, match="route record"):
        decode_entry(payload, templates={}.get)
    with pytest.raises(EntryError, match="not a route record"):
        decode_entry(payload, templates={route.id: b'{"w":2}\n'}.get)
    with pytest.raises(EntryError, match="must end with its celery-zdelay delivery tag"):
        decode_entry(payload[:-5] + b'x"}}', templates={route.id: route.record}.get)
    with pytest.raises(ValueError, match="carries no signature"):
        encode_entry(message, whole=True, signing_key=KEY)


def test_parked_at_is_read_only_from_the_stamp_park_lua_writes_first() -> None:
    payload, _ = _park(_message())
    assert parked_ms(payload) is None
    assert parked_ms(b'{"p":1764547200123,' + payload[1:]) == 1764547200123
    assert parked_ms(b'{"v":1,"p":5}\n') is None
    assert parked_ms(None) is None
    assert parked_ms(b"") is None


def test_the_body_is_carried_as_base64_of_the_exact_bytes() -> None:
    message = _message()
    message.body = bytes(range(256))
    payload, templates = _park(message)
    single = expand_entry(payload, templates.get)
    envelope = json.loads(single.partition(b"\n")[2] + b'zdelay"}}')
    assert base64.b64decode(envelope["body"]) == bytes(range(256))
    assert envelope["properties"]["body_encoding"] == "base64"
    assert envelope["properties"]["priority"] == 3
    assert envelope["properties"]["delivery_info"] == {
        "exchange": "orders",
        "routing_key": "orders.cancel",
    }
    assert decode_entry(payload, templates=templates.get).body == bytes(range(256))


def test_template_ids_are_content_hashes() -> None:
    _, templates = _park(_message())
    for tid, record in templates.items():
        assert tid == template_id(record)
        assert len(tid) == 16
    _, again = _park(_message(task_id="t-2"))
    assert again.keys() == templates.keys()
    assert isinstance(Template(id="x", record=b""), Template)


def test_a_message_without_a_task_id_is_refused_as_damaged() -> None:
    message = _message()
    del message.headers["id"]
    payload, templates = _park(message)
    with pytest.raises(EntryError, match="no task id header"):
        decode_entry(payload, templates=templates.get)


def test_a_template_holds_up_to_127_values_each_marked_by_one_byte() -> None:
    # A marker is NUL and the value's number as one byte: numbers stay below
    # 128 so that the marker is one byte in UTF-8 too. Fewer would only make
    # more messages single-part; the bound is pinned as documented.
    assert MAX_VARIABLES == 127
    base = _values(_message())
    message = _message(**{f"h{i}": f"v{i}" for i in range(127 - base)})
    payload, templates = _park(message)
    (record,) = templates.values()
    assert b"\x00\x7f" in record
    _same(decode_entry(payload, templates=templates.get), message)


def test_priority_zero_reads_back_as_zero_not_as_a_default() -> None:
    message = _message()
    message.priority = 0
    payload, templates = _park(message)
    assert decode_entry(payload, templates=templates.get).priority == 0


def test_an_envelope_without_a_priority_reads_as_priority_zero() -> None:
    payload, templates = _park(_message())
    single = expand_entry(payload, templates.get)
    meta_line, _, head = single.partition(b"\n")
    assert b'"priority":3,' in head
    head = head.replace(b'"priority":3,', b"")
    meta = {**json.loads(meta_line), "n": len(head)}
    assert decode_entry(json.dumps(meta).encode() + b"\n" + head).priority == 0


def test_encoding_options_are_keyword_only_and_templates_are_frozen() -> None:
    with pytest.raises(TypeError):
        encode_entry(_message(), "orders")  # type: ignore[misc]
    _, template = encode_entry(_message())
    assert template is not None
    with pytest.raises(AttributeError):
        template.record = b"forged"  # type: ignore[misc]


def test_a_whole_message_expands_to_the_single_part_form() -> None:
    message = _message()
    payload, route = encode_entry(message, dest="orders", layout="L1", whole=True)
    assert route is not None
    single = expand_entry(payload, {route.id: route.record}.get)
    assert single.startswith(b'{"v":1,"n":')
    _same(decode_entry(single), message)


def test_a_value_repeated_right_after_itself_is_stored_once() -> None:
    message = _message(x1="dup-value", x2="dup-value")
    payload, templates = _park(message)
    assert payload.count(b'"dup-value"') == 1
    _same(decode_entry(payload, templates=templates.get), message)


def test_a_body_that_is_not_strict_base64_is_refused_as_damaged() -> None:
    payload, templates = _park(_message())
    single = expand_entry(payload, templates.get)
    meta_line, _, head = single.partition(b"\n")
    body = json.loads(head + b'x"}}')["body"]
    broken = head.replace(body.encode(), body[:4].encode() + b"*" + body[4:].encode())
    meta = {**json.loads(meta_line), "n": len(broken)}
    with pytest.raises(EntryError, match="damaged payload"):
        decode_entry(json.dumps(meta).encode() + b"\n" + broken)


def _single_part(head: bytes) -> bytes:
    """A single-part entry whose envelope head is *head*, its length right."""
    return json.dumps({"v": SCHEMA_VERSION, "n": len(head)}).encode() + b"\n" + head


def test_a_decoded_message_equals_and_prints_as_the_message_parked() -> None:
    # The envelope a message was read from is carried along (push.lua
    # publishes it), but it is not part of what the message is: a message
    # read back compares equal to, and prints as, the one parked.
    message = _message()
    payload, templates = _park(message)
    decoded = decode_entry(payload, templates=templates.get)
    assert decoded.envelope_head
    assert decoded == message
    assert repr(decoded) == repr(message)
    assert decoded.task_id == "t-1"
    assert decoded.task_name == "shop.cancel"
    del message.headers["task"]
    assert message.task_name == ""


def test_headers_of_a_damaged_envelope_are_refused_as_damaged() -> None:
    # The dashboard lists entries through entry_headers and shows an
    # EntryError as the entry's error: any other exception would stop the page.
    for head in (b"not json", b'{"headers":["'):
        with pytest.raises(EntryError, match="damaged payload"):
            entry_headers(_single_part(head))


def test_the_routing_key_is_read_from_the_envelope_and_none_when_it_has_none() -> None:
    payload, templates = _park(_message())
    assert entry_routing_key(expand_entry(payload, templates.get)) == "orders.cancel"
    damaged = {
        b"not json": "ValueError",
        b'{"properties":{"x":"': "KeyError: no delivery_info",
        b'{"properties":{"delivery_info":"orders","x":{"y":"': "TypeError: not a mapping",
        b'{"properties":{"delivery_info":{"routing_key":7},"delivery_tag":"': "not a string",
    }
    for head, why in damaged.items():
        assert entry_routing_key(_single_part(head)) is None, why


def test_the_template_id_is_read_from_the_metadata_line_only() -> None:
    # A header named "t" puts '"t":"<hex>"' in the envelope itself.
    lookalike = {"t": "abcdef0123456789"}
    payload, templates = _park(_message(**lookalike))
    (tid,) = templates
    assert tid != lookalike["t"]
    assert template_ref(payload) == tid
    # Neither a message stored whole (no metadata line) nor a single-part
    # entry names a template, whatever their headers hold.
    whole, route = encode_entry(_message(**lookalike), dest="orders", whole=True)
    assert route is not None
    assert b'"t":"abcdef0123456789"' in whole
    assert template_ref(whole) is None
    single = expand_entry(payload, templates.get)
    assert b'"t":"abcdef0123456789"' in single
    assert template_ref(single) is None
