"""Tags and keys on the dashboard, over WSGI against a real Redis with 4 shards.

Given tasks tagged ``order:42`` among many others, spread over 4 shards,
when an operator filters the parked listing by that tag (alone or with a
task name and a due window), then every tagged entry is listed exactly once,
in due order, page after page, and nothing else. The bulk actions on that
filter cancel or reschedule exactly those entries (through the filter-action
path and its cap), and an entry's page shows its key, ``on_key`` mode and
tags. A malformed tag says what to write, and an action on it changes nothing.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote_plus

import pytest
from celery import Celery
from werkzeug.test import Client

import celery_zdelay
from celery_zdelay.store import Store
from celery_zdelay.testing import RedisServer
from celery_zdelay.web import app as web_app
from celery_zdelay.web import create_app, queries
from tests.conftest import AppFactory
from tests.servers import LocalCluster
from tests.support.keys import forged_tag
from tests.support.store import due_ms
from tests.web_support import token_in

pytestmark = pytest.mark.timeout(120)

MINUTE_MS = 60_000


@pytest.fixture
def app(make_test_app: AppFactory) -> Celery:
    return make_test_app(conf={"zdelay_shards": 4})


@pytest.fixture
def stocked(app: Celery) -> dict[str, list[str]]:
    """60 tasks of order 42 (40 record, 20 add), 140 of other orders, due over 200 minutes."""
    record, add = app.tasks["tests.record"], app.tasks["tests.add"]
    ids: dict[str, list[str]] = {"42": [], "42-add": [], "other": []}
    for i in range(200):
        countdown = 600 + 60 * i
        if i % 10 < 3:
            task, group, args = (add, "42-add", (i, i)) if i % 2 else (record, "42", (i,))
            tags = ["order:42", f"customer:{i % 4}"]
        else:
            task, group, args, tags = record, "other", (i,), [f"order:{i}"]
        ids[group].append(task.apply_delayed(args, countdown=countdown, tags=tags).id)
    return ids


def _walk(store: Store, filters: queries.Filters, limit: int) -> list[tuple[int, str]]:
    seen: list[tuple[int, str]] = []
    cursor = None
    while True:
        page = queries.parked_page(store, filters, after=cursor, limit=limit)
        seen += [(e.due_ms, e.task_id) for e in page.entries]
        if page.next is None:
            return seen
        cursor = page.next


def _listed(html: str) -> list[str]:
    return re.findall(r'<tr data-id="([^"]+)">', html.split('id="parked"', 1)[1])


def _act(client: Client, **fields: Any) -> str:
    token = token_in(client.get("/parked").get_data(as_text=True))
    reply = client.post("/actions/parked", data={"csrf_token": token, **fields})
    assert reply.status_code == 303, reply.get_data(as_text=True)[-1500:]
    return unquote_plus(reply.headers["Location"].split("msg=", 1)[1])


def test_a_tag_filter_lists_every_tagged_entry_once_in_due_order_across_shards(
    store: Store, stocked: dict[str, list[str]]
) -> None:
    tagged = set(stocked["42"] + stocked["42-add"])
    assert {store.shard_of(task_id) for task_id in tagged} == {0, 1, 2, 3}
    # Pages of 7 over 60 entries: cursors cross shards and pages
    seen = _walk(store, queries.Filters(tag="order:42"), limit=7)
    assert [task_id for _, task_id in seen] == [task_id for _, task_id in sorted(seen)]  # due order
    assert len(seen) == len(tagged) == 60
    assert {task_id for _, task_id in seen} == tagged
    # Combined with a task name and a due window: both must match too
    now_ms = store.time_ms()
    window = queries.Filters(
        tag="order:42",
        task="tests.add",
        due_after_ms=now_ms + 60 * MINUTE_MS,
        due_before_ms=now_ms + 120 * MINUTE_MS,
    )
    expected = {
        task_id
        for task_id in stocked["42-add"]
        if now_ms + 60 * MINUTE_MS <= due_ms(store, task_id) < now_ms + 120 * MINUTE_MS
    }
    assert 0 < len(expected) < len(stocked["42-add"])
    assert {task_id for _, task_id in _walk(store, window, limit=5)} == expected
    # A tag no entry has lists nothing
    assert _walk(store, queries.Filters(tag="order:9999"), limit=50) == []


def test_the_parked_page_filters_by_tag_and_shows_each_entrys_tags(
    app: Celery, stocked: dict[str, list[str]]
) -> None:
    client = Client(create_app(app))
    html = client.get("/parked?tag=order:42&task=tests.record").get_data(as_text=True)
    assert _listed(html) == stocked["42"]  # in due order, one page of 40
    assert 'name="tag" value="order:42"' in html
    # The tag's count on every shard, from its index
    count = re.search(r'<p class="note" id="tag-count">(.*?)</p>', html, re.DOTALL)
    assert count is not None
    assert count.group(1).startswith("60 entries tagged <code>order:42</code>")
    assert 'id="next-page"' not in html
    # Each row links its tags to their filter
    assert 'href="/parked?tag=customer%3A0"' in html
    # The unfiltered listing shows tags too, and no count
    html = client.get("/parked").get_data(as_text=True)
    assert 'id="tag-count"' not in html
    first = re.search(r'<tr data-id="([^"]+)">(.*?)</tr>', html, re.DOTALL)
    assert first is not None
    assert first.group(1) == stocked["42"][0]
    assert '<a class="tag" href="/parked?tag=order%3A42">order:42</a>' in first.group(2)


def test_bulk_cancel_and_reschedule_on_a_tag_filter_change_exactly_its_entries(
    app: Celery, store: Store, stocked: dict[str, list[str]]
) -> None:
    client = Client(create_app(app, actions=True))
    # Reschedule every record of order 42 to 15 minutes from now
    message = _act(
        client, op="reschedule", scope="filter", tag="order:42", task="tests.record", delay="15m"
    )
    assert message == "rescheduled 40 of 40"
    now_ms = store.time_ms()
    assert all(
        now_ms + 10 * MINUTE_MS < due_ms(store, task_id) <= now_ms + 15 * MINUTE_MS
        for task_id in stocked["42"]
    )
    # Cancel every entry of order 42: the 60, and none of the others
    message = _act(client, op="cancel", scope="filter", tag="order:42")
    assert message == "cancelled 60 of 60"
    left = {task_id for _, task_id in _walk(store, queries.Filters(), limit=100)}
    assert left == set(stocked["other"])
    assert celery_zdelay.lookup(stocked["42"][0], app=app) is None


def test_a_tag_filter_matching_more_than_one_action_takes_changes_nothing(
    app: Celery, store: Store, stocked: dict[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(web_app, "MAX_BULK", 59)
    client = Client(create_app(app, actions=True))
    message = _act(client, op="cancel", scope="filter", tag="order:42")
    assert message.startswith("Nothing cancelled: more than 59 entries match")
    assert len(_walk(store, queries.Filters(tag="order:42"), limit=50)) == 60


def test_an_entry_page_shows_its_key_mode_and_tags(app: Celery) -> None:
    record = app.tasks["tests.record"]
    keyed = record.apply_delayed(
        (1,), countdown=600, key="pay:42", on_key="debounce", tags=["order:42", "shop:7"]
    )
    plain = record.apply_delayed((2,), countdown=600)
    client = Client(create_app(app))
    html = client.get(f"/entry?id={keyed.id}").get_data(as_text=True)
    key = re.search(r'<td id="entry-key">(.*?)</td>', html, re.DOTALL)
    assert key is not None
    assert re.sub(r"<[^>]+>", "", key.group(1)) == "pay:42 (on_key=debounce)"
    tags = re.search(r'<td id="entry-tags">(.*?)</td>', html, re.DOTALL)
    assert tags is not None
    assert re.findall(r'<a class="tag" [^>]*>([^<]*)</a>', tags.group(1)) == ["order:42", "shop:7"]
    html = client.get(f"/entry?id={plain.id}").get_data(as_text=True)
    assert '<td id="entry-key">none</td>' in html
    assert '<td id="entry-tags">none</td>' in html


def test_a_malformed_tag_says_what_to_write_and_an_action_on_it_changes_nothing(
    app: Celery, store: Store, stocked: dict[str, list[str]]
) -> None:
    client = Client(create_app(app, actions=True))
    html = client.get("/parked?tag=" + "x" * 300).get_data(as_text=True)
    assert "tag: tag= is 300 characters long" in html
    token = token_in(html)
    reply = client.post(
        "/actions/parked",
        data={"csrf_token": token, "op": "cancel", "scope": "filter", "tag": "a\tb"},
    )
    assert reply.status_code == 400
    assert "control character" in reply.get_data(as_text=True)
    assert len(_walk(store, queries.Filters(), limit=100)) == 200


def test_a_forged_index_entry_cannot_put_a_signed_entry_under_a_tags_bulk_action(
    make_test_app: AppFactory, redis_client: Any
) -> None:
    # Given signed entries, and someone with write access to Redis pointing
    # the tag order:9 at an entry parked with order:1
    app, signed, honest = forged_tag(make_test_app, redis_client)
    client = Client(create_app(app, actions=True))

    # Then the tag's listing shows the honest entry only
    html = client.get("/parked?tag=order:9").get_data(as_text=True)
    assert _listed(html) == [honest.id]
    # ...and cancelling every entry of the tag leaves the other one parked
    assert _act(client, op="cancel", scope="filter", tag="order:9") == "cancelled 1 of 1"
    assert celery_zdelay.lookup(signed.id, app=app) is not None
    assert celery_zdelay.lookup(honest.id, app=app) is None


def test_entries_in_flight_are_listed_under_their_own_tag_only(app: Celery, store: Store) -> None:
    # Given two overdue entries of different orders, claimed by a companion
    # and not yet acknowledged (the broker is down, say)
    record = app.tasks["tests.record"]
    mine = record.apply_delayed((1,), countdown=-10, tags=["order:42"]).id
    theirs = record.apply_delayed((2,), countdown=-10, tags=["order:43"]).id
    for shard in store.shards:
        store.claim(shard, limit=10, lease_ms=600_000)
    assert {e.task_id for e in queries.in_flight(store, queries.Filters())} == {mine, theirs}
    # Then the listing of order:42 shows its own above the page, with its tags
    flying = queries.in_flight(store, queries.Filters(tag="order:42"))
    assert [(e.task_id, e.tags) for e in flying] == [(mine, ("order:42",))]
    html = Client(create_app(app)).get("/parked?tag=order:42").get_data(as_text=True)
    assert mine in html
    assert theirs not in html


def test_a_tag_page_that_reads_its_bound_says_so_and_the_next_page_goes_on(
    store: Store, stocked: dict[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a bound of 4 messages per page, and a task filter that skips two
    # of every three entries of the tag
    monkeypatch.setattr(queries, "SCAN_BOUND", 4)
    filters = queries.Filters(tag="order:42", task="tests.add")
    first = queries.parked_page(store, filters, limit=5)
    assert first.cut_short
    assert first.scanned == 4
    assert first.next is not None
    # Then paging on from where each page stopped finds every match once
    seen = _walk(store, filters, limit=5)
    assert [task_id for _, task_id in seen] == stocked["42-add"]


def test_the_tag_filter_its_action_and_the_control_page_work_on_a_redis_cluster(
    make_test_app: AppFactory, cluster: LocalCluster, broker_server: RedisServer
) -> None:
    # Given 6 shards on a 3-master cluster, with 9 entries of order:42 among 21
    app = make_test_app(
        broker=f"{broker_server.url}/0",
        conf={"zdelay_redis_url": cluster.url, "zdelay_shards": 6},
    )
    record = app.tasks["tests.record"]
    order = [
        record.apply_delayed((i,), countdown=600 + i, tags=["order:42"], key=f"k:{i}").id
        for i in range(9)
    ]
    others = [record.apply_delayed((i,), countdown=600 + i, tags=["order:7"]).id for i in range(12)]
    client = Client(create_app(app, actions=True))
    # Then the tag's listing is exact, in due order, and its entries show their keys
    assert _listed(client.get("/parked?tag=order:42").get_data(as_text=True)) == order
    assert "k:3" in client.get(f"/entry?id={order[3]}").get_data(as_text=True)
    # ...a pause set from the control page is listed there
    token = token_in(client.get("/control").get_data(as_text=True))
    reply = client.post(
        "/actions/control",
        data={"csrf_token": token, "op": "pause", "name": "queue:celery", "back": "control"},
    )
    assert reply.status_code == 303
    assert 'data-name="queue:celery"' in client.get("/control").get_data(as_text=True)
    # ...and cancelling every entry of the tag cancels those 9 only
    assert _act(client, op="cancel", scope="filter", tag="order:42") == "cancelled 9 of 9"
    html = client.get("/parked").get_data(as_text=True)
    assert sorted(_listed(html)) == sorted(others)
