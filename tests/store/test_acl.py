"""Least privilege: Redis 7 ACL users, and the truth about what a refused step wrote.

Every test runs a private redis-server as the store, with the ACL users of
``docs/deployment.rst`` ("Redis ACL"), read from that page, or with one
permission taken away. The broker, result backend and task records stay on
the session's own private Redis (its default user).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import re
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery, chain
from click.testing import Result
from werkzeug.test import Client

import celery_zdelay
from celery_zdelay.cli import EXIT_CHECK_FAILED
from celery_zdelay.companion import Companion
from celery_zdelay.config import get_config
from celery_zdelay.errors import StoreRefusedError
from celery_zdelay.limits import concurrency
from celery_zdelay.store import Store, admin
from celery_zdelay.testing import RedisServer
from celery_zdelay.web import create_app, queries
from tests.conftest import BACKEND_DB, BROKER_DB, RECORD_DB
from tests.helpers import ROOT, CeleryProcess, start_worker, wait_for
from tests.project import close_app, make_app
from tests.support.cli import run
from tests.support.deadletters import make_dead_letter
from tests.support.store import is_parked

# The documented ACL rules use Redis 7's selectors (%R~, %W~): make servers
# runs the rest of the store layer on Redis 6.2.
pytestmark = [pytest.mark.timeout(120), pytest.mark.redis7]

DOCS = ROOT / "docs" / "deployment.rst"
PASSWORD = "s3cret-acl"
WAKE_PATTERN = "&{zdelay:*}:wake"


def documented_acl(role: str) -> list[str]:
    """The ``ACL SETUSER zdelay-<role>`` line of the docs, as arguments, with our password."""
    for line in Path(DOCS).read_text().splitlines():
        words = line.split()
        if words[:3] == ["ACL", "SETUSER", f"zdelay-{role}"]:
            return [PASSWORD.join(w.split("PASSWORD")) for w in words[2:]]
    raise AssertionError(f"docs/deployment.rst lists no ACL SETUSER zdelay-{role}")


def without_channels(rule: list[str]) -> list[str]:
    """*rule* with its channel patterns taken away (Redis 7's default: resetchannels)."""
    return [word for word in rule if not word.startswith("&")]


@pytest.fixture
def store_server() -> Iterator[RedisServer]:
    """A private Redis 7 store, its users made by each test."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def make_acl_app(
    redis_server: RedisServer, store_server: RedisServer
) -> Iterator[Callable[[list[str]], Celery]]:
    """Build an app whose store user is made from an ``ACL SETUSER`` rule."""
    apps: list[Celery] = []

    def factory(rule: list[str], **conf: object) -> Celery:
        admin_client = store_server.client()
        admin_client.execute_command("ACL", "SETUSER", *rule)
        # Redis 7.2+ and Valkey know CLIENT SETINFO, which redis-py sends on
        # connecting, and the docs give the users that right there; Redis 7.0
        # refuses the rule (no such command).
        assert "``ACL SETUSER zdelay-producer +client|setinfo``" in DOCS.read_text()
        with contextlib.suppress(redis.exceptions.ResponseError):
            admin_client.execute_command("ACL", "SETUSER", rule[0], "+client|setinfo")
        admin_client.close()
        user = rule[0]
        store_url = f"redis://{user}:{PASSWORD}@127.0.0.1:{store_server.port}/0"
        app = make_app(
            f"{redis_server.url}/{BROKER_DB}",
            f"{redis_server.url}/{BACKEND_DB}",
            f"{redis_server.url}/{RECORD_DB}",
            conf={"zdelay_redis_url": store_url, "zdelay_shards": 4, **conf},
        )
        apps.append(app)
        return app

    yield factory
    # AsyncResults unsubscribe from the result backend when collected: let
    # them do it while Redis still runs (as conftest's make_test_app does).
    gc.collect()
    for app in apps:
        close_app(app)


def superuser_store(store_server: RedisServer) -> Store:
    """The store as its default (all-powerful) user sees it: what was really written."""
    app = Celery("truth", broker="memory://", set_as_current=False)
    app.conf.zdelay_redis_url = f"{store_server.url}/0"
    app.conf.zdelay_shards = 4
    return Store(get_config(app))


def denials(store_server: RedisServer) -> list[str]:
    """What Redis refused any user since the log was reset (ACL LOG)."""
    client = store_server.client()
    try:
        entries = client.execute_command("ACL", "LOG")
    finally:
        client.close()
    found = []
    for entry in entries:
        fields = entry
        if not isinstance(entry, dict):  # RESP2: a flat list of names and values
            fields = dict(zip(entry[::2], entry[1::2], strict=True))
        text = {_text(k): _text(v) for k, v in fields.items()}
        found.append(f"{text.get('username')}: {text.get('reason')} {text.get('object')}")
    return found


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def broker_length(redis_server: RedisServer, queue: str = "celery") -> int:
    client = redis_server.client(BROKER_DB)
    try:
        return int(client.llen(queue))
    finally:
        client.close()


def documented_users(
    make_acl_app: Callable[..., Celery], store_server: RedisServer
) -> tuple[Celery, Celery, Celery]:
    """Apps of the producer, companion and dashboard users as the docs list them.

    The server's ACL log is emptied first, so that :func:`denials` then
    holds what these users were refused.
    """
    producer = make_acl_app(documented_acl("producer"))
    companion = make_acl_app(documented_acl("companion"))
    dashboard = make_acl_app(documented_acl("dashboard"))
    store_client = store_server.client()
    try:
        store_client.execute_command("ACL", "LOG", "RESET")
    finally:
        store_client.close()
    return producer, companion, dashboard


# -- the wake-up channels: a refusal never makes "parked" look like "not parked" -----


def test_a_producer_denied_the_wake_up_channels_parks_once_and_is_not_told_otherwise(
    make_acl_app: Callable[..., Celery],
    store_server: RedisServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given the documented producer user, without its channel rights
    app = make_acl_app(without_channels(documented_acl("producer")))
    record = app.tasks["tests.record"]
    truth = superuser_store(store_server)
    try:
        # When it parks a task that becomes the earliest one (so park.lua
        # publishes the wake-up after its writes)
        with caplog.at_level(logging.WARNING, logger="celery_zdelay"):
            result = record.apply_delayed((1,), countdown=600)

        # Then the call returned, and the task is parked: a caller that trusted an
        # error and parked again would have run it twice
        assert is_parked(truth, result.id)
        # And the producer was told, once, what to grant
        warnings = [r.getMessage() for r in caplog.records if WAKE_PATTERN in r.getMessage()]
        assert len(warnings) == 1, caplog.text
        assert "publish to" in warnings[0]

        # When it reschedules it earlier, and parks many across shards in one transaction
        assert celery_zdelay.reschedule(result.id, countdown=5, app=app) is True
        many = record.apply_delayed_many([(i,) for i in range(20)], countdown=1)

        # Then each moved or parked, and no call failed
        due_ms = truth.client.zscore(truth.keys(truth.shard_of(result.id)).due, result.id)
        assert due_ms is not None
        assert due_ms // 1024 < truth.time_ms() + 10_000
        assert all(is_parked(truth, r.id) for r in many)
    finally:
        truth.close()


def test_a_dead_letter_requeued_by_a_user_denied_the_channels_is_requeued_once(
    make_acl_app: Callable[..., Celery], store_server: RedisServer
) -> None:
    # Given a dead-lettered entry, and the companion's user without channel rights
    app = make_acl_app(without_channels(documented_acl("companion")))
    truth = superuser_store(store_server)
    try:
        result = app.tasks["tests.record"].apply_delayed((1,), countdown=600)
        keys = truth.keys(truth.shard_of(result.id))
        make_dead_letter(truth, result.id, "test")

        # When that user requeues it (requeue.lua publishes after its writes)
        store = Store(get_config(app))
        try:
            requeued = admin.requeue_dead(store, [result.id])
        finally:
            store.close()

        # Then it says so, truly: the entry is due again and no longer dead
        assert requeued == [True]
        assert is_parked(truth, result.id)
        assert truth.client.zscore(keys.dead, result.id) is None
    finally:
        truth.close()


def test_a_companion_denied_the_wake_up_channels_keeps_releasing_and_says_what_is_missing(
    make_acl_app: Callable[..., Celery],
    store_server: RedisServer,
    redis_server: RedisServer,
    processes: list[CeleryProcess],
) -> None:
    # Given a companion whose user may not subscribe to the wake-up channels
    companion_app = make_acl_app(without_channels(documented_acl("companion")))
    producer_app = make_acl_app(documented_acl("producer"))
    process = CeleryProcess(companion_app, "zdelay", "-l", "INFO").start()
    processes.append(process)
    process.wait_for_log(" started: ")

    # Then it logs the permission it lacks, and runs on
    process.wait_for_log(WAKE_PATTERN)
    assert "subscribe to" in process.log()

    # And it still releases what is parked (on its idle timer)
    record = producer_app.tasks["tests.record"]
    for i in range(3):
        record.apply_delayed((i,), countdown=0.2)
        wait_for(lambda n=i + 1: broker_length(redis_server) == n, timeout=20)  # type: ignore[misc]
    assert process.process.poll() is None

    # And `status --check` (run by an operator) fails naming the missing permission
    operator = superuser_app(store_server, redis_server)

    def failing_check() -> Result | None:
        result = run(operator, "status", "--check")
        return result if result.exit_code == EXIT_CHECK_FAILED else None

    try:
        result = wait_for(failing_check, timeout=30, message="status --check to fail")
    finally:
        close_app(operator)
    assert WAKE_PATTERN in result.output
    assert "subscribe to" in result.output


def superuser_app(store_server: RedisServer, redis_server: RedisServer) -> Celery:
    return make_app(
        f"{redis_server.url}/{BROKER_DB}",
        f"{redis_server.url}/{BACKEND_DB}",
        f"{redis_server.url}/{RECORD_DB}",
        conf={"zdelay_redis_url": f"{store_server.url}/0", "zdelay_shards": 4},
    )


# -- the documented users do their whole job, and nothing more ---------------------------


def test_the_documented_acl_users_park_release_and_browse_without_one_refusal(
    make_acl_app: Callable[..., Celery],
    store_server: RedisServer,
    redis_server: RedisServer,
    processes: list[CeleryProcess],
) -> None:
    # Given the three users exactly as docs/deployment.rst lists them
    producer, companion, dashboard = documented_users(make_acl_app, store_server)
    record = producer.tasks["tests.record"]

    # When the producer parks in every way, cancels and reschedules
    kept = record.apply_delayed((0,), countdown=600)
    record.apply_delayed_many([(i,) for i in range(10)], countdown=600)
    with celery_zdelay.batch(producer):
        for i in range(5):
            record.apply_delayed((i,), countdown=600)
    canvas = celery_zdelay.apply_delayed(
        chain(record.s(1), record.s()), countdown=600, app=producer
    )
    assert celery_zdelay.cancel(canvas.id, app=producer) is True
    assert celery_zdelay.reschedule(kept.id, countdown=700, app=producer) is True
    soon = [record.apply_delayed((i,), countdown=0.3).id for i in range(3)]

    # And the companion releases what falls due
    process = CeleryProcess(companion, "zdelay", "-l", "INFO").start()
    processes.append(process)
    process.wait_for_log(" started: ")
    wait_for(lambda: broker_length(redis_server) == len(soon), timeout=30)

    # And the dashboard user browses every page and reads the status
    client = Client(create_app(dashboard, actions=False))
    for path in ("/", "/parked", "/dead", "/periodic", f"/entry?id={kept.id}"):
        reply = client.get(path)
        assert reply.status_code == 200, (path, reply.get_data(as_text=True)[:300])
    dashboard_store = Store(get_config(dashboard))
    try:
        assert admin.status(dashboard_store).counts.parked >= 16

        # Then nobody was refused anything, the best-effort wake-ups included,
        # but CONFIG GET, which the docs leave out on purpose
        refused = [d for d in denials(store_server) if "config|get" not in d]
        assert refused == []

        # And the dashboard user cannot change what is parked
        with pytest.raises((StoreRefusedError, redis.exceptions.NoPermissionError)):
            dashboard_store.cancel([kept.id])
    finally:
        dashboard_store.close()

    # And the CLI's steering commands (and a dashboard's actions) work under
    # the companion's rule, as the page says
    assert run(companion, "reschedule", kept.id, "--countdown", "900").exit_code == 0
    assert run(companion, "cancel", kept.id).exit_code == 0
    truth = superuser_store(store_server)
    try:
        assert not is_parked(truth, kept.id)
    finally:
        truth.close()
    expected = ("config|get", "zdelay-dashboard: command evalsha")  # the refusal above
    assert [d for d in denials(store_server) if not any(e in d for e in expected)] == []
    assert "refused" not in process.log(), process.log()


def test_a_worker_under_the_producer_user_frees_a_slot_of_a_control_set_at_run_time(
    make_acl_app: Callable[..., Celery],
    store_server: RedisServer,
    redis_server: RedisServer,
    processes: list[CeleryProcess],
) -> None:
    # Given a concurrency control set at run time (as the CLI does, under the
    # companion's user) and a task released under it, holding its slot
    producer, companion, _ = documented_users(make_acl_app, store_server)
    control = "task:tests.record"
    celery_zdelay.set_concurrency(control, 1, app=companion)
    wait_for(lambda: concurrency(app=companion).get(control) == 1, timeout=10)
    producer.tasks["tests.record"].apply_delayed((1,), countdown=0)
    with Companion(companion) as released:
        assert released.release_due().released == 1
    slots = get_config(companion).key_prefix

    def live() -> int:
        truth = store_server.client()
        try:
            return int(truth.zcard(f"{{{slots}:slots:{control}}}"))
        finally:
            truth.close()

    assert live() == 1

    # When a worker running as the producer's user (as the page says) runs it
    processes.append(start_worker(producer))

    # Then it reads the control's name and frees the slot, refused nothing
    wait_for(lambda: live() == 0, timeout=30)
    assert [d for d in denials(store_server) if "config|get" not in d] == []


def test_a_user_denied_the_store_keys_is_refused_before_anything_is_written(
    make_acl_app: Callable[..., Celery], store_server: RedisServer
) -> None:
    # Given the producer's rule with its key patterns narrowed to one shard
    rule = [
        ("~{zdelay:0}*" if word == "~{zdelay:*" else word) for word in documented_acl("producer")
    ]
    app = make_acl_app(rule)
    truth = superuser_store(store_server)
    try:
        # When it parks a task on a shard it may not touch
        target = next(
            tid for tid in (str(uuid.uuid4()) for _ in range(100)) if truth.shard_of(tid) != 0
        )
        with pytest.raises(StoreRefusedError) as refused:
            app.tasks["tests.record"].apply_delayed((1,), countdown=600, task_id=target)
        # Then the error says nothing was written, and that is true
        assert "nothing was written" in str(refused.value)
        assert re.search(r"NOPERM|permission", str(refused.value))
        assert not is_parked(truth, target)
    finally:
        truth.close()


def test_a_user_denied_a_command_a_script_runs_after_its_first_write_is_refused_before_it(
    make_acl_app: Callable[..., Celery], store_server: RedisServer
) -> None:
    # Given the producer's rule without SET, which park.lua runs last (its
    # retry marker), after it wrote the entries
    rule = [word for word in documented_acl("producer") if word != "+set"]
    assert len(rule) == len(documented_acl("producer")) - 1
    app = make_acl_app(rule)
    truth = superuser_store(store_server)
    try:
        # When it parks
        result_id = str(uuid.uuid4())
        with pytest.raises(StoreRefusedError) as refused:
            app.tasks["tests.record"].apply_delayed((1,), countdown=600, task_id=result_id)

        # Then nothing was written, as the error says, and it names the command
        assert not is_parked(truth, result_id)
        assert truth.client.hget(truth.keys(truth.shard_of(result_id)).msg, result_id) is None
        assert "nothing was written" in str(refused.value)
        assert "refuse SET, which park.lua runs" in str(refused.value)
    finally:
        truth.close()


def test_a_requeue_by_a_user_denied_zrem_is_refused_before_it_writes(
    make_acl_app: Callable[..., Celery], store_server: RedisServer
) -> None:
    # Given a dead letter, and the companion's rule without ZREM (requeue.lua
    # removes the dead letter after it parked the entry again)
    rule = [word for word in documented_acl("companion") if word != "+zrem"]
    app = make_acl_app(rule)
    truth = superuser_store(store_server)
    try:
        producer = make_acl_app(documented_acl("producer"))
        result = producer.tasks["tests.record"].apply_delayed((1,), countdown=600)
        make_dead_letter(truth, result.id, "test")

        # When that user requeues it
        store = Store(get_config(app))
        try:
            with pytest.raises(StoreRefusedError, match=r"refuse ZREM, which requeue\.lua runs"):
                admin.requeue_dead(store, [result.id])
        finally:
            store.close()

        # Then it is still only a dead letter: not parked again besides
        keys = truth.keys(truth.shard_of(result.id))
        assert not is_parked(truth, result.id)
        assert truth.client.zscore(keys.dead, result.id) is not None
    finally:
        truth.close()


def test_held_tasks_are_listed_looked_up_and_steered_by_the_documented_users(
    make_acl_app: Callable[..., Celery], store_server: RedisServer
) -> None:
    # Given tests.record paused by the producer user and tasks the companion
    # user held behind the pause
    producer, companion, dashboard = documented_users(make_acl_app, store_server)
    celery_zdelay.pause("task:tests.record", app=producer)
    record = producer.tasks["tests.record"]
    held = [record.apply_delayed((i,), countdown=0).id for i in range(4)]
    with Companion(companion) as comp:
        comp.release_due()

    # When the dashboard user browses them, by listing, filter and entry page
    client = Client(create_app(dashboard, actions=False))
    for path in ("/parked", "/parked?task=tests.record", f"/entry?id={held[0]}"):
        reply = client.get(path)
        assert reply.status_code == 200, (path, denials(store_server))
        assert "held" in reply.get_data(as_text=True)

    # And the producer user looks them up, reschedules and cancels them, and
    # the companion's (the CLI's) cancels the rest by filter
    found = celery_zdelay.lookup(held[0], app=producer)
    assert found is not None
    assert found.state == "held"
    assert celery_zdelay.reschedule(held[0], countdown=600, app=producer) is True
    assert celery_zdelay.cancel(held[1], app=producer) is True
    assert celery_zdelay.cancel_matching(task="tests.record", app=companion) == 3

    # Then nobody was refused anything (but CONFIG GET, left out on purpose)
    assert [d for d in denials(store_server) if "config|get" not in d] == []


def test_tags_are_listed_and_steered_by_the_documented_users(
    make_acl_app: Callable[..., Celery], store_server: RedisServer
) -> None:
    # Regression: the documented users lacked ZRANGEBYLEX and ZMSCORE, which
    # the tag index is read with: a tag filter was refused for all three.
    producer, companion, dashboard = documented_users(make_acl_app, store_server)
    record = producer.tasks["tests.record"]
    tagged = [record.apply_delayed((i,), countdown=600, tags=["order:42"]).id for i in range(3)]
    other = record.apply_delayed((9,), countdown=600, tags=["order:7"]).id

    # When the dashboard user filters by the tag, and the CLI (the
    # companion's user) lists it
    reply = Client(create_app(dashboard, actions=False)).get("/parked?tag=order:42")
    assert reply.status_code == 200, (reply.get_data(as_text=True)[:300], denials(store_server))
    page = reply.get_data(as_text=True)
    assert all(task_id in page for task_id in tagged)
    assert other not in page
    assert "3 entries tagged <code>order:42</code>" in page
    # (a dashboard with actions runs as the companion's user)
    with_actions = Client(create_app(companion, actions=True)).get("/parked?tag=order:42")
    assert with_actions.status_code == 200, denials(store_server)
    listed = run(companion, "list", "--tag", "order:42", "--json")
    assert listed.exit_code == 0, listed.output
    assert sorted(e["id"] for e in json.loads(listed.stdout)["entries"]) == sorted(tagged)

    # And the producer reschedules and cancels by the tag
    assert celery_zdelay.reschedule_matching(tag="order:42", countdown=900, app=producer) == 3
    assert celery_zdelay.cancel_matching(tag="order:42", app=producer) == 3

    # Then only the other order's task is left, and nobody was refused anything
    assert celery_zdelay.lookup(other, app=producer) is not None
    assert all(celery_zdelay.lookup(t, app=producer) is None for t in tagged)
    assert [d for d in denials(store_server) if "config|get" not in d] == []


def test_the_dashboard_user_pages_through_entries_sharing_one_score(
    make_acl_app: Callable[..., Celery], store_server: RedisServer
) -> None:
    # Regression: the documented users lacked ZRANK, which the next page of a
    # run of entries sharing one score (a bulk park) reads its place with.
    producer, companion, dashboard = documented_users(make_acl_app, store_server)
    record = producer.tasks["tests.record"]
    truth = superuser_store(store_server)
    try:
        # Twelve ids on one shard, so that two pages end inside the run of one score
        candidates = (str(uuid.uuid4()) for _ in range(400))
        ids = [i for i in candidates if truth.shard_of(i) == 0][:12]
        assert len(ids) == 12
        for i, task_id in enumerate(ids):
            record.apply_delayed((i,), countdown=600, task_id=task_id)
        due_key = truth.keys(0).due
        score = int(truth.client.zscore(due_key, ids[0]))
        truth.client.zadd(due_key, dict.fromkeys(ids, score), xx=True)
    finally:
        truth.close()

    for user in (dashboard, companion):  # a dashboard with actions runs as the companion
        store = Store(get_config(user))
        try:
            seen: list[str] = []
            cursor = None
            for _ in range(10):
                page = queries.parked_page(store, queries.Filters(), after=cursor, limit=5)
                seen += [entry.task_id for entry in page.entries]
                cursor = page.next
                if cursor is None:
                    break
        finally:
            store.close()
        assert sorted(seen) == sorted(ids)  # each once
    assert [d for d in denials(store_server) if "config|get" not in d] == []


def test_a_dashboard_with_actions_browses_every_page_as_the_companion_user(
    make_acl_app: Callable[..., Celery], store_server: RedisServer
) -> None:
    # The docs run a dashboard with actions (and the CLI's steering) as the
    # companion's user: its rule must also read every page the dashboard has.
    producer, companion, _ = documented_users(make_acl_app, store_server)
    kept = producer.tasks["tests.record"].apply_delayed((0,), countdown=600)

    client = Client(create_app(companion, actions=True))
    for path in ("/", "/parked", "/dead", "/periodic", f"/entry?id={kept.id}"):
        reply = client.get(path)
        assert reply.status_code == 200, (path, reply.get_data(as_text=True)[:300])
    assert run(companion, "dead", "list").exit_code == 0
    assert [d for d in denials(store_server) if "config|get" not in d] == []


def test_adopt_runs_as_the_companion_user_and_refuses_a_producer_before_taking_anything(
    make_acl_app: Callable[..., Celery], store_server: RedisServer, redis_server: RedisServer
) -> None:
    # Given ETA tasks sent the native way, waiting in the broker's queue
    producer, companion, _ = documented_users(make_acl_app, store_server)
    for n in range(3):
        producer.tasks["tests.record"].apply_async((n,), countdown=600)

    # When the producer's user runs adopt, it is refused before anything is taken
    refused = run(producer, "adopt", "--queue", "celery", "--force")
    assert refused.exit_code == 69, refused.output
    assert "adopt_once.lua" in refused.stderr
    assert broker_length(redis_server) == 3

    # And the companion's user adopts them, refused nothing (docs/cli.rst says so)
    adopted = run(companion, "adopt", "--queue", "celery", "--force", "--json")
    assert adopted.exit_code == 0, adopted.output
    assert json.loads(adopted.stdout)["queues"][0]["adopted"] == 3
    assert broker_length(redis_server) == 0
    assert [d for d in denials(store_server) if "config|get" not in d] == []
