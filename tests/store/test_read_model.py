"""One read model: every reader says the same state for the same id.

Given one id in each state (parked, held behind a pause, in flight, dead),
:func:`celery_zdelay.lookup`, the Python listing (by due order and by tag),
the dead-letter listing, ``zdelay list --json`` and ``dead list --json``,
and the dashboard's listing and entry page all read it as one
:class:`~celery_zdelay.store.read_model.ParkedTask` and agree on its
:class:`~celery_zdelay.store.read_model.EntryState` and due time. Real
Redis, the real scripts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import FrozenInstanceError, dataclass, replace
from datetime import datetime, timedelta, timezone

import pytest
from celery import Celery
from werkzeug.test import Client

import celery_zdelay
from celery_zdelay import testing
from celery_zdelay.companion import Companion
from celery_zdelay.config import get_config
from celery_zdelay.store import Store, admin
from celery_zdelay.store.control import pause_lane
from celery_zdelay.store.read_model import EntryState, ParkedTask, dead_task, task_from_row
from celery_zdelay.store.reading import scan_parked
from celery_zdelay.web import create_app, queries
from tests.conftest import AppFactory
from tests.support.cli import run
from tests.support.store import put_raw

pytestmark = pytest.mark.timeout(60)

TAG = "four"


@dataclass(frozen=True)
class Four:
    """An app, its store, and one id in each state."""

    app: Celery
    store: Store
    ids: dict[EntryState, str]


@pytest.fixture
def four(make_test_app: AppFactory) -> Iterator[Four]:
    app = make_test_app(queues=[{"name": "celery"}, {"name": "emails"}])
    store = Store(get_config(app))
    record = app.tasks["tests.record"]
    # A message the companion cannot read: dead-lettered by a real pass.
    dead = put_raw(store, "damaged-1", b"not a celery-zdelay payload", due_in_ms=-20_000)
    with Companion(app, store=store) as companion:
        assert companion.release_due().dead_lettered == 1
    # An email due now behind a pause: a pass moves it to the held set.
    celery_zdelay.pause("queue:emails", app=app)
    held = record.apply_delayed((1,), countdown=0, queue="emails", tags=[TAG])
    with Companion(app, store=store) as companion:
        companion.release_due()
    # An overdue task claimed and not acknowledged: in flight.
    now = datetime.now(timezone.utc)
    flying = record.apply_delayed(("taken",), eta=now - timedelta(seconds=10), tags=[TAG])
    claimed = store.claim(store.shard_of(flying.id), limit=1, lease_ms=600_000)
    assert [e.task_id for e in claimed.entries] == [flying.id]
    parked = record.apply_delayed((2,), {"x": 1}, countdown=3600, tags=[TAG])
    yield Four(
        app,
        store,
        {
            EntryState.PARKED: parked.id,
            EntryState.HELD: held.id,
            EntryState.IN_FLIGHT: flying.id,
            EntryState.DEAD: dead,
        },
    )
    store.close()


def _by_id(entries: list[ParkedTask]) -> dict[str, ParkedTask]:
    return {entry.task_id: entry for entry in entries}


def test_lookup_listings_dead_letters_cli_and_dashboard_agree_on_each_state(four: Four) -> None:
    # Given one id in each state
    app, store = four.app, four.store
    # When each reader reads them
    listed = _by_id(admin.list_parked(store).entries)
    tagged = _by_id(admin.list_parked(store, tag=TAG).entries)
    dead = _by_id(admin.list_dead(store).entries)
    page = queries.parked_page(store, queries.Filters())
    dashboard = _by_id([*page.entries, *queries.in_flight(store, queries.Filters())])
    tag_page = _by_id(queries.parked_page(store, queries.Filters(tag=TAG)).entries)
    listed_json = {
        e["id"]: e["state"] for e in json.loads(run(app, "list", "--json").output)["entries"]
    }
    dead_json = {e["id"] for e in json.loads(run(app, "dead", "list", "--json").output)["entries"]}
    client = Client(create_app(app))

    # Then each says the same state for the same id, and the same due time
    for state, task_id in four.ids.items():
        found = celery_zdelay.lookup(task_id, app=app)
        assert found is not None
        assert found.state is state, (task_id, found.state)
        detail = queries.entry_detail(store, task_id)
        assert detail == found
        html = client.get(f"/entry?id={task_id}").get_data(as_text=True)
        assert f'data-state="{state.value}" id="entry-state">{state.label}<' in html
        if state is EntryState.DEAD:
            assert dead[task_id].state is state
            assert dead[task_id].due_ms == found.due_ms
            assert dead[task_id].reason == found.reason
            assert task_id in dead_json
            assert task_id not in listed
            continue
        assert task_id not in dead
        assert listed[task_id].state is state
        assert listed[task_id].due_ms == found.due_ms
        assert listed_json[task_id] == state.value
        assert tagged[task_id].state is state
        assert dashboard[task_id].state is state
        if state is not EntryState.IN_FLIGHT:  # in flight is listed above the tag page
            assert tag_page[task_id].state is state


def test_the_shapes_that_were_folded_in_are_the_one_read_model(four: Four) -> None:
    # Given one id in each state, the fields each old shape had are on ParkedTask
    app, store = four.app, four.store
    parked = celery_zdelay.lookup(four.ids[EntryState.PARKED], app=app)
    assert parked is not None
    assert (parked.argsrepr, parked.kwargsrepr, parked.tags) == ("(2,)", "{'x': 1}", (TAG,))
    assert parked.headers["task"] == "tests.record"
    assert not parked.in_flight
    flying = celery_zdelay.lookup(four.ids[EntryState.IN_FLIGHT], app=app)
    assert flying is not None
    assert flying.in_flight
    assert flying.lease_until_ms is not None
    held = celery_zdelay.lookup(four.ids[EntryState.HELD], app=app)
    assert held is not None
    assert (held.held_by, held.held_reason) == ("queue:emails", "pause")
    (dead,) = admin.list_dead(store).entries
    assert dead.state == "dead"
    assert dead.died_ms is not None
    assert dead.companion
    assert dead.reason
    assert dead.error is not None
    # The names listings and dead letters had are the same class, kept for old imports.
    assert admin.ParkedEntry is admin.DeadEntry is celery_zdelay.ParkedTask is ParkedTask
    # The testing plugin's record is built from the read model, its fields unchanged.
    from celery_zdelay.testing.fastforward import _parked

    listing = admin.list_parked(store)
    made = _parked(_by_id(listing.entries)[parked.task_id], listing.now_ms)
    assert isinstance(made, testing.ParkedTask)
    assert (made.id, made.name, made.argsrepr, made.kwargsrepr) == (
        parked.task_id,
        "tests.record",
        "(2,)",
        "{'x': 1}",
    )
    assert made.due == parked.due


def test_the_state_is_a_str_enum_with_one_spelling_and_a_label_for_people() -> None:
    assert [s.value for s in EntryState] == ["parked", "held", "in_flight", "dead"]
    assert EntryState.IN_FLIGHT == "in_flight"
    assert str(EntryState.IN_FLIGHT) == f"{EntryState.IN_FLIGHT}" == "in_flight"
    assert json.dumps({"state": EntryState.IN_FLIGHT}) == '{"state": "in_flight"}'
    assert EntryState("held") is EntryState.HELD
    assert [s.label for s in EntryState] == ["parked", "held", "in flight", "dead"]


def test_a_dead_letter_reads_its_task_reason_and_companion_from_its_record(
    make_test_app: AppFactory,
) -> None:
    # Breaks if: the dead letter's stored message is dropped (`payload or None`
    # inverted), its reason loses to the message's error, or a reason line
    # that is not JSON (an older record) fails the read.
    app = make_test_app()
    store = Store(get_config(app))
    try:
        store.client.set("poison", "not a list")
        task = app.tasks["tests.record"].apply_delayed((7,), countdown=0, queue="poison")
        with Companion(app, store=store) as companion:
            assert companion.release_due().dead_lettered == 1
        found = celery_zdelay.lookup(task.id, app=app)
        assert found is not None
        (listed,) = admin.list_dead(store).entries
        for dead in (found, listed):
            assert dead.state is EntryState.DEAD
            assert (dead.task, dead.argsrepr, dead.queue) == ("tests.record", "(7,)", "poison")
            assert dead.reason is not None
            assert "poison is a string key" in dead.reason
            assert dead.error is None
            assert dead.companion
            assert dead.died_ms is not None
        # A reason line written as plain text (not JSON) is still its reason.
        stored = store.client.hget(store.keys(store.shard_of(task.id)).dead_msg, task.id)
        assert stored is not None
        _, _, entry = stored.partition(b"\n")
        plain = dead_task(store, task.id, 0, 1, b"an older reason\n" + entry)
        assert (plain.reason, plain.task, plain.companion) == (
            "an older reason",
            "tests.record",
            None,
        )
    finally:
        store.close()


def test_a_parked_task_is_a_value_its_headers_left_out_of_equality_and_repr(four: Four) -> None:
    # Breaks if: ParkedTask is not frozen, its headers take part in == or in
    # repr (the listing's rows compare by what they show), or parked_at is
    # not a property.
    parked = celery_zdelay.lookup(four.ids[EntryState.PARKED], app=four.app)
    assert parked is not None
    with pytest.raises(FrozenInstanceError):
        parked.state = EntryState.DEAD  # type: ignore[misc]
    assert replace(parked, headers={}) == parked
    assert "headers" not in repr(parked)
    assert isinstance(parked.parked_at, datetime)
    assert parked.parked_at <= datetime.now(timezone.utc)


def test_a_held_row_read_without_the_listings_pause_reasons_reads_them_itself(
    four: Four,
) -> None:
    # Breaks if: a row's hold reason is only read when the caller passes the
    # pauses it read once per listing (`reasons or HoldReasons(store)`).
    held_id = four.ids[EntryState.HELD]
    (row,) = [r for r in scan_parked(four.store, held=True) if r.task_id == held_id]
    assert row.held == pause_lane("queue:emails")
    made = task_from_row(four.store, row)
    assert (made.state, made.held_by, made.held_reason) == (
        EntryState.HELD,
        "queue:emails",
        "pause",
    )
