"""The dashboard's pages and actions over WSGI, against a real Redis.

The browser tests (test_web_browser.py) prove what an operator sees; these
prove the reads and writes underneath: pages that walk every entry exactly
once, bounded filters that say where they stopped, read-only mode,
authentication, and actions on a whole filter.
"""

from __future__ import annotations

import base64
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone

import pytest
from celery import Celery
from werkzeug.test import Client

import celery_zdelay
from celery_zdelay.store import Store
from celery_zdelay.store.admin import EntryState
from celery_zdelay.testing import RedisServer, free_port
from celery_zdelay.web import create_app, queries
from celery_zdelay.web.security import BasicAuth, ProxyHeaderAuth
from tests.conftest import AppFactory
from tests.helpers import CeleryProcess
from tests.servers import LocalCluster
from tests.support.cli import run
from tests.support.deadletters import make_dead_letter
from tests.support.store import stock
from tests.web_support import open_store

pytestmark = pytest.mark.timeout(60)


def _form_token(client: Client, path: str) -> str:
    html = client.get(path).get_data(as_text=True)
    match = re.search(r'name="csrf_token" value="([0-9a-f]+)"', html)
    assert match, html[:500]
    return match.group(1)


def test_pages_walk_every_entry_once_in_due_order_across_shards(
    make_test_app: AppFactory,
) -> None:
    # Given 4 shards and 230 entries, many sharing a due millisecond.
    app = make_test_app(conf={"zdelay_shards": 4})
    store = open_store(app)
    try:
        now = store.time_ms()
        for i in range(230):
            due = datetime.fromtimestamp((now + 60_000 + (i % 7) * 1000) / 1000, tz=timezone.utc)
            app.tasks["tests.record"].apply_delayed((i,), eta=due)
        # Drop the same-millisecond sequence: equal scores, ordered by id in Redis.
        for shard in store.shards:
            due_key = store.keys(shard).due
            for member, score in store.client.zrange(due_key, 0, -1, withscores=True):
                store.client.zadd(due_key, {member: int(score) // 1024 * 1024}, xx=True)
        seen: list[tuple[int, str]] = []
        cursor = None
        pages = 0
        while True:
            page = queries.parked_page(store, queries.Filters(), after=cursor, limit=25)
            seen += [(e.due_ms, e.task_id) for e in page.entries]
            pages += 1
            if page.next is None:
                break
            cursor = page.next
        assert len(seen) == 230
        assert len({task_id for _, task_id in seen}) == 230
        assert [due for due, _ in seen] == sorted(due for due, _ in seen)
        assert pages == 10
    finally:
        store.close()


def test_pages_walk_a_long_run_of_entries_sharing_one_score(app: Celery, store: Store) -> None:
    # Given 60 entries in one score slot of one shard (beyond 1,024 parks in
    # one millisecond the rest share its last slot, as a bulk park does),
    record = app.tasks["tests.record"]
    ids = [record.apply_delayed((i,), countdown=600).id for i in range(60)]
    due_key = store.keys(0).due
    score = int(store.client.zscore(due_key, ids[0]))
    store.client.zadd(due_key, dict.fromkeys(ids, score), xx=True)
    # when they are paged through 5 at a time, with and without a filter,
    for filters in (queries.Filters(), queries.Filters(task="tests.record")):
        seen: list[str] = []
        cursor = None
        for _ in range(100):
            page = queries.parked_page(store, filters, after=cursor, limit=5)
            seen += [e.task_id for e in page.entries]
            if page.next is None:
                break
            cursor = page.next
        # then each is shown once, in Redis's order (by id), and the walk ends.
        assert seen == sorted(ids)
        assert page.next is None


@pytest.mark.parametrize("shards", [1, 4])
def test_a_filter_that_reads_its_bound_says_so_and_the_next_page_goes_on(
    make_test_app: AppFactory, monkeypatch: pytest.MonkeyPatch, shards: int
) -> None:
    # Given 60 additions behind 40 recordings, and a scan bound of 40 entries a page.
    monkeypatch.setattr(queries, "SCAN_BOUND", 40)
    app = make_test_app(conf={"zdelay_shards": shards})
    store = open_store(app)
    try:
        record, add = app.tasks["tests.record"], app.tasks["tests.add"]
        for i in range(40):
            record.apply_delayed((i,), countdown=100 + i)
        adds = [add.apply_delayed((i, 1), countdown=200 + i).id for i in range(60)]
        found: list[str] = []
        cursor = None
        cut_short = 0
        while True:
            page = queries.parked_page(
                store, queries.Filters(task="tests.add"), after=cursor, limit=6
            )
            found += [e.task_id for e in page.entries]
            cut_short += page.cut_short
            assert page.scanned <= max(40, 7 * shards)  # the bound, shared by the shards
            if page.next is None:
                break
            cursor = page.next
        assert found == adds  # each once, in due order
        assert cut_short >= 1  # the first read only saw recordings
        # The page says how many it read: the bound, shared by the shards.
        first = Client(create_app(app)).get("/parked?task=tests.add").get_data(as_text=True)
        page = queries.parked_page(store, queries.Filters(task="tests.add"), limit=50)
        if page.cut_short:
            assert f"This filter read {page.scanned} entries without filling" in first
        else:
            assert "This filter read" not in first
    finally:
        store.close()


def test_filters_by_queue_id_prefix_and_due_window(app: Celery, store: Store) -> None:
    record = app.tasks["tests.record"]
    orders = [record.apply_delayed((i,), countdown=600 + i, queue="orders") for i in range(3)]
    other = record.apply_delayed((9,), countdown=7200, task_id="abc-other")
    by_queue = queries.parked_page(store, queries.Filters(queue="orders"))
    assert [e.task_id for e in by_queue.entries] == [r.id for r in orders]
    by_prefix = queries.parked_page(store, queries.Filters(id_prefix="abc-"))
    assert [e.task_id for e in by_prefix.entries] == [other.id]
    now = store.time_ms()
    window = queries.Filters(due_after_ms=now + 3600_000, due_before_ms=now + 3 * 3600_000)
    assert [e.task_id for e in queries.parked_page(store, window).entries] == [other.id]
    client = Client(create_app(app))
    html = client.get("/parked?queue=orders&due_before=1h").get_data(as_text=True)
    assert all(r.id in html for r in orders)
    assert other.id not in html


def test_relative_filters_count_from_the_redis_clock_not_the_web_hosts(
    app: Celery, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given one task due in 10 minutes, and a web host whose clock is an hour fast
    soon = app.tasks["tests.record"].apply_delayed((1,), countdown=600).id
    fast = time.time() + 3600
    monkeypatch.setattr(time, "time", lambda: fast)
    client = Client(create_app(app))

    # Then "due within the hour" and "overdue" select on the store's clock
    # (before: the hour-fast host called the task overdue and not due soon)
    within_hour = client.get("/parked?due_before=1h").get_data(as_text=True)
    overdue = client.get("/parked?due_before=0s").get_data(as_text=True)
    assert soon in within_hour
    assert soon not in overdue


def test_a_queue_filter_finds_entries_of_one_task_sent_with_several_routing_keys(
    app: Celery, store: Store
) -> None:
    # Given one task parked with two routing keys on one exchange: its entries
    # share a template, and the routing key is a per-call value, not part of it.
    record = app.tasks["tests.record"]
    to_a = record.apply_delayed((1,), countdown=600, exchange="zdelay-topic", routing_key="queue-a")
    to_b = record.apply_delayed((2,), countdown=700, exchange="zdelay-topic", routing_key="queue-b")
    # When a page has read both (the newest read entry was sent to queue-b),
    everything = queries.parked_page(store, queries.Filters())
    assert [e.queue for e in everything.entries] == ["queue-a", "queue-b"]
    # then a filter on either queue still finds its entry.
    by_a = queries.parked_page(store, queries.Filters(queue="queue-a"))
    assert [e.task_id for e in by_a.entries] == [to_a.id]
    by_b = queries.parked_page(store, queries.Filters(queue="queue-b"))
    assert [e.task_id for e in by_b.entries] == [to_b.id]
    both = queries.parked_page(store, queries.Filters(task="tests.record", queue="queue-a"))
    assert [e.task_id for e in both.entries] == [to_a.id]


def test_the_timeline_counts_each_entry_in_its_bar(app: Celery, store: Store) -> None:
    record = app.tasks["tests.record"]
    for minutes in (5, 5, 30, 125, 60 * 30):
        record.apply_delayed((minutes,), countdown=minutes * 60)
    record.apply_delayed(("late",), countdown=-30)
    day = queries.timeline(store, "day")
    assert day.bars[0].count == 1  # overdue
    assert [b.count for b in day.bars[1:4]] == [3, 0, 1]
    assert day.later == 1
    everything = queries.timeline(store, "all")
    assert sum(b.count for b in everything.bars) + everything.later == 6
    hour = queries.timeline(store, "hour")
    assert sum(b.count for b in hour.bars[1:]) == 3


def test_a_read_only_dashboard_refuses_every_action(app: Celery, store: Store) -> None:
    parked = app.tasks["tests.record"].apply_delayed((1,), countdown=600)
    client = Client(create_app(app, actions=False))
    html = client.get(f"/entry?id={parked.id}").get_data(as_text=True)
    assert "entry-actions" not in html
    assert "read-only" in html
    reply = client.post("/actions/parked", data={"op": "cancel", "ids": parked.id})
    assert reply.status_code == 403
    assert "read-only" in reply.get_data(as_text=True)
    assert store.client.zscore(store.keys(store.shard_of(parked.id)).due, parked.id) is not None


def test_actions_apply_to_every_entry_a_filter_matches(app: Celery, store: Store) -> None:
    record, add = app.tasks["tests.record"], app.tasks["tests.add"]
    keep = [record.apply_delayed((i,), countdown=600).id for i in range(5)]
    drop = [add.apply_delayed((i, i), countdown=600).id for i in range(7)]
    client = Client(create_app(app, actions=True))
    token = _form_token(client, "/parked")
    reply = client.post(
        "/actions/parked",
        data={"csrf_token": token, "op": "cancel", "scope": "filter", "task": "tests.add"},
    )
    assert reply.status_code == 303
    assert "cancelled+7+of+7" in reply.headers["Location"]
    remaining = {e.task_id for e in queries.parked_page(store, queries.Filters()).entries}
    assert remaining == set(keep)
    assert not set(drop) & remaining

    # Run now: due at once; reschedule to a date.
    reply = client.post(
        "/actions/parked",
        data={"csrf_token": token, "op": "reschedule", "ids": keep[0], "eta": "2100-01-01T00:00Z"},
    )
    assert "rescheduled+1+of+1" in reply.headers["Location"]
    score = store.client.zscore(store.keys(store.shard_of(keep[0])).due, keep[0])
    assert int(score) // 1024 == 4102444800000
    client.post("/actions/parked", data={"csrf_token": token, "op": "run", "ids": keep[1]})
    score = store.client.zscore(store.keys(store.shard_of(keep[1])).due, keep[1])
    assert int(score) // 1024 <= store.time_ms()


def test_a_reschedule_beyond_the_furthest_due_time_is_refused_and_changes_nothing(
    app: Celery, store: Store
) -> None:
    # Regression: the delay field skipped the bound countdown= has, so a delay
    # of a million years was sent to the store as is.
    parked = app.tasks["tests.record"].apply_delayed((1,), countdown=600)
    due_key = store.keys(store.shard_of(parked.id)).due
    before = store.client.zscore(due_key, parked.id)
    client = Client(create_app(app, actions=True))
    token = _form_token(client, "/parked")
    for delay in ("365000000d", "-365000000d"):
        reply = client.post(
            "/actions/parked",
            data={"csrf_token": token, "op": "reschedule", "ids": parked.id, "delay": delay},
        )
        assert reply.status_code == 303
        assert "Not+rescheduled" in reply.headers["Location"], reply.headers["Location"]
        assert store.client.zscore(due_key, parked.id) == before


def test_an_entry_in_flight_shows_the_due_time_it_was_claimed_at(app: Celery, store: Store) -> None:
    # Given an overdue entry a companion claimed and has not acknowledged,
    stocked = stock(app)
    found = celery_zdelay.lookup(stocked.in_flight, app=app)
    assert found is not None
    assert found.state == "in_flight"
    assert found.due_ms is not None
    # then its entry page gives its due time, as lookup() does.
    detail = queries.entry_detail(store, stocked.in_flight)
    assert detail is not None
    assert detail.state is EntryState.IN_FLIGHT
    assert detail.due_ms == found.due_ms
    assert detail.lease_until_ms is not None


def test_an_overdue_entry_in_flight_is_listed_and_in_the_overdue_bar(
    app: Celery, store: Store
) -> None:
    # Given an overdue entry a companion holds (the broker is down, say): the
    # overview counts it as overdue,
    stocked = stock(app)
    client = Client(create_app(app))
    overview = client.get("/").get_data(as_text=True)
    assert 'id="count-overdue">2<' in overview
    # then the timeline's overdue bar counts it too, and the listing shows it
    # (first page only), as zdelay list does.
    assert queries.timeline(store, "day").bars[0].count == 2
    listing = client.get("/parked").get_data(as_text=True)
    assert stocked.in_flight in listing
    assert 'id="in-flight"' in listing
    assert [e.task_id for e in queries.in_flight(store, queries.Filters())] == [stocked.in_flight]
    assert queries.in_flight(store, queries.Filters(task="tests.add")) == []


def test_dead_letters_are_listed_with_reasons_requeued_and_purged(
    app: Celery, store: Store
) -> None:
    ids = [app.tasks["tests.record"].apply_delayed((i,), countdown=600).id for i in range(3)]
    for task_id in ids:
        make_dead_letter(store, task_id, f"refused <{task_id}>")
    client = Client(create_app(app, actions=True))
    html = client.get("/dead").get_data(as_text=True)
    assert all(f"refused &lt;{task_id}&gt;" in html for task_id in ids)
    token = _form_token(client, "/dead")
    client.post("/actions/dead", data={"csrf_token": token, "op": "requeue", "ids": ids[0]})
    assert store.client.zscore(store.keys(store.shard_of(ids[0])).due, ids[0]) is not None
    reply = client.post("/actions/dead", data={"csrf_token": token, "op": "purge", "scope": "all"})
    assert "purged+2" in reply.headers["Location"]
    assert store.client.zcard(store.keys(0).dead) == 0


def test_an_action_sends_the_browser_back_within_the_dashboard_only(app: Celery) -> None:
    client = Client(create_app(app, actions=True))
    token = _form_token(client, "/dead")
    for back in ("//evil.example/x", "https://evil.example/", "dead\\@evil", "../../x"):
        reply = client.post(
            "/actions/dead",
            data={"csrf_token": token, "op": "purge", "ids": "none", "back": back},
        )
        assert reply.headers["Location"].startswith("/?msg=")


def test_an_empty_secret_key_is_refused(app: Celery) -> None:
    # Regression: secret_key="" (a Flask app's empty SECRET_KEY) signed CSRF
    # tokens with an empty key, which anyone can do.
    from celery_zdelay.errors import ConfigurationError

    for empty in ("", b""):
        with pytest.raises(ConfigurationError, match="secret_key is empty"):
            create_app(app, actions=True, secret_key=empty)


def test_basic_auth_and_proxy_header_keep_strangers_out(app: Celery) -> None:
    client = Client(BasicAuth(create_app(app), "ops", "s3cret"))
    assert client.get("/").status_code == 401
    wrong = base64.b64encode(b"ops:nope").decode()
    assert client.get("/", headers={"Authorization": f"Basic {wrong}"}).status_code == 401
    right = base64.b64encode(b"ops:s3cret").decode()
    assert client.get("/", headers={"Authorization": f"Basic {right}"}).status_code == 200
    proxied = Client(ProxyHeaderAuth(create_app(app), "X-Forwarded-User"))
    assert proxied.get("/").status_code == 403
    assert proxied.get("/", headers={"X-Forwarded-User": "alice"}).status_code == 200


@pytest.mark.parametrize("auth", ["ops:", ":s3cret"])
def test_basic_auth_with_an_empty_user_or_password_is_refused(app: Celery, auth: str) -> None:
    # Regression: --auth ops: served the dashboard to anyone who typed "ops".

    result = run(app, "web", "--port", "0", "--auth", auth)
    assert result.exit_code == 2
    assert "USER:PASSWORD" in result.output


def test_pages_never_unpickle_and_show_an_unknown_id_as_not_found(
    make_test_app: AppFactory,
) -> None:
    # A pickled task whose argument would run code when unpickled.
    app = make_test_app(conf={"task_serializer": "pickle"})
    parked = celery_zdelay.send_delayed(app, "tests.record", args=(Exploit(),), countdown=600)
    client = Client(create_app(app))
    for path in ("/", "/parked", f"/entry?id={parked.id}", "/dead"):
        assert client.get(path).status_code == 200
    assert not Exploit.unpickled
    reply = client.get("/entry?id=no-such-id")
    assert reply.status_code == 404
    assert "Not found" in reply.get_data(as_text=True)


class Exploit:
    """Records being unpickled, as a hostile payload would run code."""

    unpickled = False

    def __reduce__(self) -> tuple[object, tuple[()]]:
        return (_mark_unpickled, ())


def _mark_unpickled() -> None:
    Exploit.unpickled = True


def test_the_standalone_server_binds_loopback_and_asks_for_a_password(
    app: Celery, processes: list[CeleryProcess]
) -> None:
    server = CeleryProcess(app, "zdelay", "web", "--port", "0", "--auth", "ops:s3cret").start()
    processes.append(server)
    server.wait_for_log("dashboard on http://")
    url = re.search(r"dashboard on (http://[^/]+)/ \(read-only\)", server.log())
    assert url is not None, server.log()
    assert url.group(1).startswith("http://127.0.0.1:")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url.group(1) + "/", timeout=10)
    assert refused.value.code == 401
    refused.value.close()
    request = urllib.request.Request(
        url.group(1) + "/parked",
        headers={"Authorization": "Basic " + base64.b64encode(b"ops:s3cret").decode()},
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert reply.status == 200
        assert "Parked tasks" in reply.read().decode()


def test_the_cli_runs_without_the_web_extra_imported() -> None:
    # The companion's command line must not need Jinja2 or Werkzeug.
    code = "import sys, celery_zdelay.cli; print(sorted({'jinja2', 'werkzeug'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_flask_app_serves_the_dashboard_under_its_prefix(app: Celery) -> None:
    from flask import Flask

    from celery_zdelay.web.flask import mount

    site = Flask("shop")
    site.config["SECRET_KEY"] = "flask secret"

    @site.get("/")
    def home() -> str:
        return "the shop"

    parked = app.tasks["tests.record"].apply_delayed((1,), countdown=600)
    dashboard = mount(site, app, "/zdelay", actions=True)
    client = Client(site)
    assert client.get("/").get_data(as_text=True) == "the shop"
    listing = client.get("/zdelay/parked").get_data(as_text=True)
    assert f'href="/zdelay/entry?id={parked.id}"' in listing
    assert 'action="/zdelay/actions/parked"' in listing
    assert dashboard.secret == b"flask secret"
    dashboard.close()
    # Regression: a prefix of "/" mounted nothing, without a word.
    from celery_zdelay.errors import ConfigurationError

    for prefix in ("/", "", "zdelay"):
        with pytest.raises(ConfigurationError, match="prefix"):
            mount(Flask("other"), app, prefix)


def test_periodic_schedules_are_listed_paused_resumed_and_run_now(
    app: Celery, store: Store
) -> None:
    from celery_zdelay import periodic

    assert periodic.add("nightly<b>", app=app, task="tests.record", schedule=3600, args=[7])
    client = Client(create_app(app, actions=True))
    html = client.get("/periodic").get_data(as_text=True)
    assert "nightly&lt;b&gt;" in html
    assert "tests.record" in html
    token = _form_token(client, "/periodic")

    def act(op: str, name: str = "nightly<b>") -> str:
        reply = client.post(
            "/actions/periodic",
            data={"csrf_token": token, "op": op, "name": name, "back": "periodic"},
        )
        assert reply.status_code == 303
        return reply.headers["Location"]

    act("pause")
    assert periodic.schedules(app)[1][0].paused
    act("resume")
    assert not periodic.schedules(app)[1][0].paused
    assert "runs+now+as+periodic" in act("run")
    run_ids = [e.task_id for e in queries.parked_page(store, queries.Filters()).entries]
    assert any(task_id.startswith("periodic:nightly<b>:run:") for task_id in run_ids)
    assert "no+schedule+is+named" in act("pause", "nope")
    refused = client.post("/actions/periodic", data={"op": "pause", "name": "nightly<b>"})
    assert refused.status_code == 403


def test_schedules_no_companion_serves_are_listed_with_why_and_counted_in_the_metrics(
    app: Celery, store: Store
) -> None:
    from prometheus_client import generate_latest

    from celery_zdelay.companion.metrics import Metrics
    from celery_zdelay.periodic.definition import Definition
    from celery_zdelay.periodic.store import PeriodicStore

    # Given a stored schedule beside one a companion could not serve (a bad row, say)
    periodic_store = PeriodicStore(store)
    good = Definition(name="good", task="tests.record", schedule={"every": 60.0, "relative": False})
    periodic_store.store_config(
        [good], "h1", writer="c", force=False, keep={"bad<row>": "unknown task 'tests.recrod'"}
    )

    # Then the periodic page names it, with why, apart from the served ones
    html = Client(create_app(app)).get("/periodic").get_data(as_text=True)
    unserved = html.split('<table id="unserved">', 1)[1]
    assert '<tr data-name="bad&lt;row&gt;"><td>bad&lt;row&gt;</td>' in unserved
    assert "unknown task &#39;tests.recrod&#39;" in unserved
    assert "good" not in unserved
    # And the metrics count it, and only it
    scraped = generate_latest(Metrics(store).registry).decode()
    assert 'zdelay_periodic_unserved{schedule="bad<row>"} 1.0' in scraped
    assert 'zdelay_periodic_unserved{schedule="good"}' not in scraped

    # When it is fixed, neither shows it any more
    periodic_store.store_config([good], "h2", writer="c", force=False)
    html = Client(create_app(app)).get("/periodic").get_data(as_text=True)
    assert 'id="unserved"' not in html
    assert "zdelay_periodic_unserved{" not in generate_latest(Metrics(store).registry).decode()


def test_an_unreachable_store_is_a_503_page_naming_it_without_its_password(
    make_test_app: AppFactory,
) -> None:
    port = free_port()
    app = make_test_app(conf={"zdelay_redis_url": f"redis://:hunter2@127.0.0.1:{port}/0"})
    client = Client(create_app(app))
    for path in ("/", "/parked", "/entry?id=x", "/dead"):
        reply = client.get(path)
        assert reply.status_code == 503
        text = reply.get_data(as_text=True)
        assert f"127.0.0.1:{port}" in text
        assert "hunter2" not in text


def test_a_closed_dashboard_opens_no_store_again(app: Celery) -> None:
    # A request thread that outlives its server must not leak a new connection.
    dashboard = create_app(app)
    client = Client(dashboard)
    assert client.get("/").status_code == 200
    dashboard.close()
    reply = client.get("/")
    assert reply.status_code == 503
    assert "closed" in reply.get_data(as_text=True)
    assert dashboard._store is None


def test_every_page_and_action_works_on_a_redis_cluster_store(
    make_test_app: AppFactory, cluster: LocalCluster, broker_server: RedisServer
) -> None:
    # Given a store of 6 shards spread over 3 cluster nodes, with every state.
    app = make_test_app(
        broker=f"{broker_server.url}/0",
        conf={"zdelay_redis_url": cluster.url, "zdelay_shards": 6},
    )
    stocked = stock(app)
    client = Client(create_app(app, actions=True))
    overview = client.get("/").get_data(as_text=True)
    assert 'id="count-parked">5<' in overview
    assert 'id="count-dead">1<' in overview
    for span in ("hour", "week", "all"):
        assert client.get(f"/overview.part?span={span}").status_code == 200
    listing = client.get("/parked").get_data(as_text=True)
    assert all(task_id in listing for task_id in [stocked.soon, *stocked.later])
    filtered = client.get("/parked?task=tests.add").get_data(as_text=True)
    assert stocked.soon in filtered
    assert stocked.later[0] not in filtered
    assert "tests.add" in client.get(f"/entry?id={stocked.soon}").get_data(as_text=True)
    assert stocked.dead in client.get("/dead").get_data(as_text=True)
    token = _form_token(client, "/parked")
    reply = client.post(
        "/actions/parked",
        data={"csrf_token": token, "op": "cancel", "scope": "filter", "task": "tests.record"},
    )
    assert "cancelled+" in reply.headers["Location"]
    store = open_store(app)
    try:
        assert [e.task_id for e in queries.parked_page(store, queries.Filters()).entries] == [
            stocked.soon
        ]
    finally:
        store.close()
