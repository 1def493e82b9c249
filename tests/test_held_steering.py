"""Tasks held back by a pause or a rate limit are listed, found, rescheduled and cancelled.

A held task waits in its control's held set (``hold.lua``), not in the due
set: these tests pin that ``zdelay list``, :func:`celery_zdelay.lookup`, the
Python listing and the bulk selections see it, marked with its control and
why, and that a reschedule moves it back into the due set in one script, so
that it passes the gate again when due. Real Redis, real companions.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis
from celery import Celery
from werkzeug.test import Client

import celery_zdelay
from celery_zdelay.companion import Companion
from celery_zdelay.parking import store_for
from celery_zdelay.schedule import Due
from celery_zdelay.store import admin
from celery_zdelay.store.marks import check_marks, key_owner, tagged_ids
from celery_zdelay.testing import RedisServer
from celery_zdelay.web import create_app, queries
from tests.conftest import AppFactory
from tests.control_support import BrokerTap
from tests.helpers import wait_for
from tests.servers import LocalCluster
from tests.support.cli import run
from tests.support.clock import redis_ms
from tests.support.keys import keys_of
from tests.support.store import held_sets

pytestmark = pytest.mark.timeout(120)

QUEUES = [{"name": "celery"}, {"name": "emails"}]
SHARDS = 4


def _app(make_test_app: AppFactory, **conf: Any) -> Celery:
    return make_test_app(conf={"zdelay_shards": SHARDS, **conf}, queues=QUEUES)


def _places(client: redis.Redis, task_id: str, control: str = "queue:emails") -> list[str]:
    """Where *task_id* is: the due set, its control's held set, the lease (one, never two)."""
    found = []
    for shard in range(SHARDS):
        keys = keys_of(shard)
        if client.zscore(keys.due, task_id) is not None:
            found.append(f"due:{shard}")
        if any(client.zscore(key, task_id) is not None for key in held_sets(shard, control)):
            found.append(f"held:{shard}")
        if client.zscore(keys.lease, task_id) is not None:
            found.append(f"lease:{shard}")
    return found


def _hold(app: Celery) -> None:
    """One companion pass: what is due and paused or limited moves to its held set."""
    with Companion(app) as comp:
        comp.release_due()


def test_a_paused_email_is_listed_found_rescheduled_and_released_at_the_new_time_not_early(
    make_test_app: AppFactory, redis_client: redis.Redis, companion: Any
) -> None:
    # Given the emails queue paused and an email held behind the pause
    app = _app(make_test_app)
    celery_zdelay.pause("queue:emails", app=app)
    email = app.tasks["tests.record"].apply_delayed(
        (1,), countdown=0, queue="emails", tags=["welcome"]
    )
    later = app.tasks["tests.record"].apply_delayed((2,), countdown=3600)
    _hold(app)
    assert _places(redis_client, email.id) == [f"held:{store_for(app).shard_of(email.id)}"]

    # Then lookup finds it, held, with its control and why
    found = celery_zdelay.lookup(email.id, app=app)
    assert found is not None
    assert (found.state, found.held_by, found.held_reason) == ("held", "queue:emails", "pause")
    assert (found.queue, found.tags) == ("emails", ("welcome",))

    # ...the Python listing shows it first (overdue), marked, before the parked one
    listing = admin.list_parked(store_for(app))
    assert [(e.task_id, e.state, e.held_by, e.held_reason) for e in listing.entries] == [
        (email.id, "held", "queue:emails", "pause"),
        (later.id, "parked", None, None),
    ]

    # ...and so does `zdelay list`, as JSON and for people
    document = json.loads(run(app, "list", "--json").stdout)
    (held,) = [e for e in document["entries"] if e["id"] == email.id]
    assert (held["state"], held["held_by"], held["held_reason"]) == (
        "held",
        "queue:emails",
        "pause",
    )
    text = run(app, "list").stdout
    assert "held by queue:emails (paused)" in text
    assert "2 entries: 1 parked, 1 held." in text

    # When, with a companion running, it is rescheduled to 2 s from now (still
    # paused), and the queue is resumed
    with BrokerTap(redis_client, "emails") as tap:
        companion(app)
        before_ms = redis_ms(redis_client)
        assert celery_zdelay.reschedule(email.id, countdown=2, app=app) is True

        # Then it is back in the due set only, due at Redis-now + 2 s
        assert _places(redis_client, email.id) == [f"due:{store_for(app).shard_of(email.id)}"]
        moved = celery_zdelay.lookup(email.id, app=app)
        assert moved is not None
        assert (moved.state, moved.held_by, moved.held_reason) == ("parked", None, None)
        assert moved.due_ms is not None
        assert before_ms + 2000 <= moved.due_ms <= redis_ms(redis_client) + 2000
        assert tagged_ids(store_for(app), "welcome") == [email.id]
        assert check_marks(store_for(app)) == []
        celery_zdelay.resume("queue:emails", app=app)

        # ...and nothing reaches the broker while the Redis clock is before
        # its new due time (watched until 20 ms before it)
        def almost_due() -> bool:
            assert tap.of("emails") == [], "released early"
            return redis_ms(redis_client) >= moved.due_ms - 20

        wait_for(almost_due, timeout=30, message="the new due time")

        # Then it goes out once, at its new due time
        (arrival,) = tap.wait_for("emails", 1, timeout=30)
    assert arrival.task_id == email.id
    assert arrival.redis_ms >= moved.due_ms
    assert celery_zdelay.lookup(email.id, app=app) is None


def test_a_held_task_rescheduled_while_still_paused_is_held_again_when_due(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given an email held behind a pause
    app = _app(make_test_app)
    celery_zdelay.pause("queue:emails", app=app)
    email = app.tasks["tests.record"].apply_delayed((1,), countdown=0, queue="emails")
    _hold(app)

    # When it is rescheduled to 0.3 s from now and companions make passes
    due_ms = redis_ms(redis_client) + 300
    assert celery_zdelay.reschedule(email.id, countdown=0.3, app=app) is True
    with Companion(app) as comp:

        def held_again() -> bool:
            comp.release_due()
            found = celery_zdelay.lookup(email.id, app=app)
            return found is not None and found.state == "held"

        wait_for(held_again, timeout=20, message="the email held again")

    # Then once due it passed the gate again and is held again, not released
    assert redis_ms(redis_client) >= due_ms
    assert redis_client.llen("emails") == 0
    assert _places(redis_client, email.id) == [f"held:{store_for(app).shard_of(email.id)}"]


def test_a_task_held_by_a_rate_limit_is_listed_and_rescheduled_and_held_again_when_due(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given a limit of 1/m (burst 1) and three emails due now, each in a
    # millisecond of its own: on 4 shards, two due in one millisecond keep
    # their parking order only within a shard (they were listed by shard,
    # 1 run in 30 under load, when all three were parked with countdown=0)
    app = _app(make_test_app)
    celery_zdelay.set_rate_limit("queue:emails", "1/m", app=app)
    record = app.tasks["tests.record"]
    now_ms = redis_ms(redis_client)
    emails = [
        record.apply_delayed((i,), eta=_eta(now_ms - 10 + i), queue="emails") for i in range(3)
    ]
    _hold(app)
    assert redis_client.llen("emails") == 1
    sent = json.loads(redis_client.lindex("emails", 0))["headers"]["id"]
    waiting = [e.id for e in emails if e.id != sent]

    # Then the two held back are listed as held by the rate limit, in due order
    listing = admin.list_parked(store_for(app), queue="emails")
    assert [(e.task_id, e.held_by, e.held_reason) for e in listing.entries] == [
        (task_id, "queue:emails", "rate_limit") for task_id in waiting
    ]
    found = celery_zdelay.lookup(waiting[0], app=app)
    assert found is not None
    assert (found.state, found.held_reason) == ("held", "rate_limit")

    # When one is rescheduled to 0.5 s from now
    assert celery_zdelay.reschedule(waiting[0], countdown=0.5, app=app) is True
    moved = celery_zdelay.lookup(waiting[0], app=app)
    assert moved is not None
    assert moved.state == "parked"
    assert moved.due_ms is not None

    # Then a pass before its new time leaves it parked; once due, the limit
    # (no token left) holds it again
    with Companion(app) as comp:
        comp.release_due()
        if redis_ms(redis_client) < moved.due_ms:
            assert _places(redis_client, waiting[0])[0].startswith("due:")

        def held_again() -> bool:
            comp.release_due()
            again = celery_zdelay.lookup(waiting[0], app=app)
            return again is not None and again.state == "held"

        wait_for(held_again, timeout=20, message="the email held by the limit again")
    assert redis_client.llen("emails") == 1


def test_held_tasks_on_every_shard_are_filtered_sorted_and_steered_with_the_parked(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given 4 shards, 12 emails held behind a pause (due over the last 12 ms
    # of a second ago) and 12 other tasks parked, due later
    app = _app(make_test_app)
    store = store_for(app)
    celery_zdelay.pause("queue:emails", app=app)
    record = app.tasks["tests.record"]
    now_ms = redis_ms(redis_client)
    emails = [
        record.apply_delayed(
            (i,), eta=_eta(now_ms - 1000 + i), queue="emails", tags=["batch"], key=f"mail:{i}"
        )
        for i in range(12)
    ]
    others = [record.apply_delayed((i,), eta=_eta(now_ms + 60_000 + i)) for i in range(12)]
    _hold(app)
    shards = {store.shard_of(e.id) for e in emails}
    assert len(shards) > 1, "the emails must spread over several shards"
    assert sum(redis_client.zcard(keys_of(s).due) for s in range(SHARDS)) == 12

    # Then the listing merges held and parked in due order across the shards
    listing = admin.list_parked(store)
    assert [e.task_id for e in listing.entries] == [r.id for r in [*emails, *others]]
    assert [e.state for e in listing.entries] == ["held"] * 12 + ["parked"] * 12

    # ...and every filter applies to held tasks as to parked ones
    by_queue = admin.list_parked(store, queue="emails").entries
    assert [e.task_id for e in by_queue] == [e.id for e in emails]
    by_tag = admin.list_parked(store, tag="batch").entries
    assert [(e.task_id, e.held_by) for e in by_tag] == [(e.id, "queue:emails") for e in emails]
    window = admin.list_parked(store, due_after_ms=now_ms - 1000 + 4, due_before_ms=now_ms - 990)
    assert [e.task_id for e in window.entries] == [e.id for e in emails[4:10]]
    assert [e.task_id for e in admin.list_parked(store, task="tests.re*", limit=5).entries] == [
        e.id for e in emails[:5]
    ]
    assert celery_zdelay.cancel_matching(queue="emails", dry_run=True, app=app) == 12
    assert celery_zdelay.cancel_matching(tag="batch", dry_run=True, app=app) == 12

    # When the first six are moved by tag and window, the other six cancelled by queue
    moved = celery_zdelay.reschedule_matching(
        countdown=3600, tag="batch", due_before=_eta(now_ms - 1000 + 6), app=app
    )
    assert moved == 6
    cancelled = celery_zdelay.cancel_matching(
        queue="emails", due_after=_eta(now_ms - 994), due_before=_eta(now_ms), app=app
    )
    assert cancelled == 6

    # Then each is in one place, the cancelled ones nowhere, keys and tags exact
    for email in emails[:6]:
        assert _places(redis_client, email.id) == [f"due:{store.shard_of(email.id)}"]
    for email in emails[6:]:
        assert _places(redis_client, email.id) == []
        assert key_owner(store, f"mail:{emails.index(email)}") is None
    assert sorted(tagged_ids(store, "batch")) == sorted(e.id for e in emails[:6])
    assert check_marks(store) == []
    listed = admin.list_parked(store, queue="emails").entries
    assert sorted(e.task_id for e in listed) == sorted(e.id for e in emails[:6])
    assert [e.state for e in listed] == ["parked"] * 6


def test_a_cancelled_held_task_gives_up_its_key_and_its_tags(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given a keyed, tagged email held behind a pause
    app = _app(make_test_app)
    store = store_for(app)
    celery_zdelay.pause("queue:emails", app=app)
    email = app.tasks["tests.record"].apply_delayed(
        (1,), countdown=0, queue="emails", key="order:7", tags=["shop"]
    )
    _hold(app)

    # When it is cancelled
    assert celery_zdelay.cancel(email.id, app=app) is True

    # Then its key and its tag go with it, as for a parked one
    assert _places(redis_client, email.id) == []
    assert key_owner(store, "order:7") is None
    assert tagged_ids(store, "shop") == []
    assert check_marks(store) == []
    assert celery_zdelay.lookup(email.id, app=app) is None


def test_the_dashboard_lists_and_shows_a_held_task_marked_and_reschedules_it(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    # Given an email held behind a pause, one held by a limit, and a parked task
    app = _app(make_test_app)
    celery_zdelay.pause("queue:emails", app=app)
    celery_zdelay.set_rate_limit("task:tests.add", "1/m", app=app)
    email = app.tasks["tests.record"].apply_delayed((1,), countdown=0, queue="emails")
    adds = [app.tasks["tests.add"].apply_delayed((i, i), countdown=0) for i in range(2)]
    later = app.tasks["tests.record"].apply_delayed((2,), countdown=3600)
    _hold(app)
    limited = [a.id for a in adds if celery_zdelay.lookup(a.id, app=app) is not None]
    assert len(limited) == 1
    client = Client(create_app(app, actions=True))

    # When an operator opens the listing
    html = client.get("/parked").get_data(as_text=True)

    # Then the held tasks are in it, marked with their control and why, the parked not
    assert _due_cell(html, email.id).endswith("held: paused queue:emails")
    assert _due_cell(html, limited[0]).endswith("held: rate limit task:tests.add")
    assert "held" not in _due_cell(html, later.id)
    # ...and a filter selects them as it selects parked ones
    by_queue = client.get("/parked?queue=emails").get_data(as_text=True)
    assert email.id in by_queue
    assert later.id not in by_queue

    # When the operator opens the held email's page
    page = client.get(f"/entry?id={email.id}")
    entry = page.get_data(as_text=True)

    # Then it says held, by which control and why, and offers the actions
    assert page.status_code == 200
    assert re.search(r'id="entry-state">held<', entry)
    held_row = re.search(r'id="entry-held">(.*?)</td>', entry, re.DOTALL)
    assert held_row is not None
    assert re.sub(r"<[^>]+>", "", held_row.group(1)) == (
        "queue:emails (paused: it goes out when resumed)"
    )
    assert 'id="entry-actions"' in entry

    # When it is rescheduled from that page
    token = re.search(r'name="csrf_token" value="([0-9a-f]+)"', entry)
    assert token is not None
    reply = client.post(
        "/actions/parked",
        data={
            "csrf_token": token.group(1),
            "op": "reschedule",
            "ids": email.id,
            "delay": "1h",
            "back": f"entry?id={email.id}",
        },
    )

    # Then it moved back to the due set, an hour on
    assert reply.status_code == 303
    assert "rescheduled+1+of+1" in reply.headers["Location"]
    assert _places(redis_client, email.id) == [f"due:{store_for(app).shard_of(email.id)}"]
    moved = client.get(f"/entry?id={email.id}").get_data(as_text=True)
    assert re.search(r'id="entry-state">parked<', moved)
    assert 'id="entry-held"' not in moved


def test_dashboard_pages_walk_held_and_parked_entries_once_each_in_due_order(
    make_test_app: AppFactory,
) -> None:
    # Given 4 shards, 40 emails held behind a pause and 40 other tasks parked,
    # their due times interleaved, many sharing a millisecond
    app = _app(make_test_app)
    store = store_for(app)
    celery_zdelay.pause("queue:emails", app=app)
    record = app.tasks["tests.record"]
    now_ms = redis_ms(store.client)
    emails = [
        record.apply_delayed((i,), eta=_eta(now_ms - 5000 + (i % 5) * 100), queue="emails").id
        for i in range(40)
    ]
    others = [
        record.apply_delayed((i,), eta=_eta(now_ms + 600_000 + (i % 5) * 100)).id for i in range(40)
    ]
    _hold(app)
    # (the others, due later, are parked; move half of them among the held emails)
    for i, task_id in enumerate(others[:20]):
        store.reschedule(task_id, Due("a", now_ms - 5000 + (i % 5) * 100))

    # When the listing is walked page by page (7 a page)
    seen: list[tuple[int, str, str]] = []
    cursor = None
    while True:
        page = queries.parked_page(store, queries.Filters(), after=cursor, limit=7)
        seen += [(e.due_ms, e.task_id, e.state) for e in page.entries]
        if page.next is None:
            break
        cursor = page.next

    # Then every entry came once, held and parked alike, in due order
    assert sorted(t for _, t, _ in seen) == sorted(emails + others)
    assert [d for d, _, _ in seen] == sorted(d for d, _, _ in seen)
    assert {t for _, t, state in seen if state == "held"} == set(emails)


def test_held_tasks_are_listed_and_steered_on_a_redis_cluster_store(
    make_test_app: AppFactory, cluster: LocalCluster, broker_server: RedisServer
) -> None:
    # Given 6 shards over 3 cluster nodes and emails held behind a pause
    app = make_test_app(
        broker=f"{broker_server.url}/0",
        conf={"zdelay_redis_url": cluster.url, "zdelay_shards": 6},
        queues=QUEUES,
    )
    store = store_for(app)
    assert store.cluster
    celery_zdelay.pause("queue:emails", app=app)
    record = app.tasks["tests.record"]
    emails = [record.apply_delayed((i,), countdown=0, queue="emails", tags=["c"]) for i in range(6)]
    _hold(app)
    assert len({store.shard_of(e.id) for e in emails}) > 1

    # Then the listing, the tag listing and lookup see them held, on every node
    listing = admin.list_parked(store)
    assert sorted(e.task_id for e in listing.entries) == sorted(e.id for e in emails)
    assert {e.held_by for e in listing.entries} == {"queue:emails"}
    assert len(admin.list_parked(store, tag="c").entries) == 6
    found = celery_zdelay.lookup(emails[0].id, app=app)
    assert found is not None
    assert found.state == "held"
    html = Client(create_app(app)).get("/parked?tag=c").get_data(as_text=True)
    assert html.count("held: paused queue:emails") == 6

    # When one is rescheduled and the rest cancelled by tag
    assert celery_zdelay.reschedule(emails[0].id, countdown=600, app=app) is True
    assert celery_zdelay.cancel_matching(tag="c", due_before=timedelta(0), app=app) == 5

    # Then only the rescheduled one is left, parked, and the tag index agrees
    (left,) = admin.list_parked(store).entries
    assert (left.task_id, left.state) == (emails[0].id, "parked")
    assert tagged_ids(store, "c") == [emails[0].id]
    assert check_marks(store) == []


def _due_cell(html: str, task_id: str) -> str:
    """The text of the due cell of *task_id*'s row on the listing page."""
    row = re.search(r'<tr data-id="' + re.escape(task_id) + r'">(.*?)</tr>', html, re.DOTALL)
    assert row is not None, task_id
    cells = [c for c in re.findall(r"<td>(.*?)</td>", row.group(1), re.DOTALL) if "<input" not in c]
    return " ".join(re.sub(r"<[^>]+>", " ", cells[0]).split())


def _eta(ms: int) -> datetime:
    """The instant of epoch *ms*, exactly (a float division may land a microsecond early)."""
    return datetime.fromtimestamp(ms // 1000, tz=timezone.utc) + timedelta(milliseconds=ms % 1000)
