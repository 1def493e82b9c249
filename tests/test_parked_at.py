"""When an entry was parked: park.lua stamps it on the Redis clock, outside
what is signed, and every reader (lookup, ``list --json``, the dashboard's
entry page, the handoff, decode_entry) reads stamped and older entries alike."""

from __future__ import annotations

import re
from typing import Any

import pytest
import redis
from celery import Celery
from werkzeug.test import Client

import celery_zdelay
from celery_zdelay.cli.views import listing_json
from celery_zdelay.companion import Companion
from celery_zdelay.entry import decode_entry, parked_ms
from celery_zdelay.parking import store_for
from celery_zdelay.schedule import Due
from celery_zdelay.store import ParkRequest, admin
from celery_zdelay.store.scripts import EXPAND, GUARD
from celery_zdelay.web import create_app
from tests.conftest import AppFactory
from tests.support.clock import redis_ms
from tests.support.deadletters import make_dead_letter
from tests.support.keys import SHARD0

pytestmark = pytest.mark.timeout(90)

MSG = SHARD0.msg
TEMPLATES = SHARD0.templates
KEY = "k" * 32


def _unstamped(payload: bytes) -> bytes:
    """Return *payload* as releases before the parked-at stamp stored it."""
    stripped = re.sub(rb'^\{"p":\d+,', b"{", payload)
    assert stripped != payload
    return stripped


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_every_park_records_the_redis_time_it_was_parked_at(
    make_test_app: AppFactory, redis_client: redis.Redis, signed: bool
) -> None:
    app = make_test_app(conf={"zdelay_signing_key": KEY} if signed else {})
    record = app.tasks["tests.record"]
    before = redis_ms(redis_client)
    one = record.apply_delayed(("one",), countdown=600)
    many = record.apply_delayed_many([(i,) for i in range(50)], countdown=600)
    with celery_zdelay.batch(app):
        batched = record.apply_delayed(("batched",), countdown=600)
    after = redis_ms(redis_client)

    ids = [one.id, batched.id, *(r.id for r in many)]
    for task_id in ids:
        found = celery_zdelay.lookup(task_id, app=app)
        assert found is not None
        assert found.parked_ms is not None
        assert before <= found.parked_ms <= after
        assert found.parked_at is not None
        assert found.parked_at.timestamp() * 1000 == pytest.approx(found.parked_ms, abs=1)
        payload = redis_client.hget(MSG, task_id)
        assert payload is not None
        assert payload.split(b"\n")[0].count(b'"p":') == 1
        assert (b'"s":"' in payload.split(b"\n")[0]) is signed

    # The stamp is outside the signature: the companion verifies the
    # entries and releases every one through the atomic handoff.
    with Companion(app) as companion:
        report = companion.release_due(advance_ms=700_000)
    assert report.handed_off == len(ids)
    assert report.dead_lettered == 0


def test_a_payload_parked_again_is_stamped_anew_not_twice(
    app: Celery, redis_client: redis.Redis
) -> None:
    # A payload read back from the store (it carries a stamp) and parked
    # again under its id gets the new park's time, once.
    app.tasks["tests.record"].apply_delayed(("a",), countdown=600, task_id="parked-twice")
    store = store_for(app)
    first = redis_client.hget(MSG, "parked-twice")
    assert first is not None
    first_ms = parked_ms(first)
    assert first_ms is not None
    while redis_ms(redis_client) <= first_ms:
        pass
    store.park([ParkRequest("parked-twice", Due("r", 600_000), first)])

    again = redis_client.hget(MSG, "parked-twice")
    assert again is not None
    again_ms = parked_ms(again)
    assert again_ms is not None
    assert again_ms > first_ms
    assert again.split(b"\n")[0].count(b'"p":') == 1
    assert again.replace(str(again_ms).encode(), b"", 1) == first.replace(
        str(first_ms).encode(), b"", 1
    )
    assert decode_entry(again, templates=store.templates(0)).task_id == "parked-twice"


def test_lookup_and_list_json_show_when_it_was_parked(
    app: Celery, redis_client: redis.Redis
) -> None:
    record = app.tasks["tests.record"]
    before = redis_ms(redis_client)
    waiting = record.apply_delayed(("w",), countdown=600)
    doomed = record.apply_delayed(("d",), countdown=600)
    after = redis_ms(redis_client)
    store = store_for(app)
    make_dead_letter(store, doomed.id, "a test reason")

    document = listing_json(admin.list_parked(store))
    (entry,) = document["entries"]
    assert entry["id"] == waiting.id
    assert before <= entry["parked_ms"] <= after
    dead = celery_zdelay.lookup(doomed.id, app=app)
    assert dead is not None
    assert dead.state == "dead"
    assert dead.parked_ms is not None
    assert before <= dead.parked_ms <= after
    # A requeued dead letter keeps the time it was first parked.
    assert admin.requeue_dead(store, [doomed.id]) == [True]
    requeued = celery_zdelay.lookup(doomed.id, app=app)
    assert requeued is not None
    assert (requeued.state, requeued.parked_ms) == ("parked", dead.parked_ms)


def test_the_entry_page_shows_parked_at_in_utc_and_the_browsers_zone(
    app: Celery, redis_client: redis.Redis
) -> None:
    parked = app.tasks["tests.record"].apply_delayed(("x",), countdown=600)
    found = celery_zdelay.lookup(parked.id, app=app)
    assert found is not None
    assert found.parked_at is not None
    html = Client(create_app(app)).get(f"/entry?id={parked.id}").get_data(as_text=True)

    utc = found.parked_at.strftime("%Y-%m-%dT%H:%M:%SZ")
    cell = re.search(r'<td id="entry-parked">(.*?)</td>', html)
    assert cell, html
    assert f'data-ms="{found.parked_ms}">{utc}</time>' in cell.group(1)
    assert "ago" in cell.group(1) or "just now" in cell.group(1)
    # The browser's zone: the page's script fills <time class="local">.
    assert f'<time class="local" data-ms="{found.parked_ms}">' in html
    assert "not recorded" not in html


@pytest.mark.parametrize("path", ["handoff", "generic"])
def test_entries_parked_before_the_stamp_are_still_read_and_released(
    make_test_app: AppFactory, redis_client: redis.Redis, redis_server: Any, path: str
) -> None:
    broker = f"{redis_server.url}/3" if path == "generic" else None
    app = make_test_app(broker=broker)
    old = app.tasks["tests.record"].apply_delayed(("old",), countdown=0)
    payload = redis_client.hget(MSG, old.id)
    assert payload is not None
    redis_client.hset(MSG, old.id, _unstamped(payload))

    found = celery_zdelay.lookup(old.id, app=app)
    assert found is not None
    assert (found.state, found.task, found.parked_ms, found.parked_at) == (
        "parked",
        "tests.record",
        None,
        None,
    )
    assert listing_json(admin.list_parked(store_for(app)))["entries"][0]["parked_ms"] is None
    html = Client(create_app(app)).get(f"/entry?id={old.id}").get_data(as_text=True)
    assert re.search(r'<td id="entry-parked">not recorded', html), html

    with Companion(app) as companion:
        report = companion.release_due()
    assert report.released == 1
    assert report.dead_lettered == 0


def test_the_handoffs_fast_reader_takes_stamped_and_older_entries(
    app: Celery, redis_client: redis.Redis
) -> None:
    # zdelay_fast_entry is handoff.lua's quick path (one pattern match, one
    # struct.unpack); an entry it misses still goes out, read slowly by
    # zdelay_read, so only this check shows the stamp kept the fast path.
    app.tasks["tests.record"].apply_delayed(("fast",), countdown=600, task_id="fast")
    stamped = redis_client.hget(MSG, "fast")
    assert stamped is not None
    assert parked_ms(stamped) is not None
    probe = (
        GUARD.read()
        + EXPAND.read()
        + "\nlocal found = {}\nfor i = 1, #ARGV do\n"
        + "  found[i] = zdelay_fast_entry(KEYS[1], ARGV[i]) and 1 or 0\nend\nreturn found\n"
    )
    reply = redis_client.eval(probe, 1, TEMPLATES, stamped, _unstamped(stamped))
    assert reply == [1, 1]


def test_parked_ms_reads_only_the_stamp_park_lua_writes() -> None:
    assert parked_ms(b'{"p":1764547200123,"v":1,"t":"ab","n":1}\n\x00') == 1764547200123
    assert parked_ms(b'{"v":1,"t":"ab","n":1}\n\x00') is None
    assert parked_ms(b'{"v":1,"n":1,"p":5}\n\x00') is None
    assert parked_ms(b"") is None
    assert parked_ms(None) is None
