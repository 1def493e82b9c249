"""Faults: corrupt entries, the broker down, Redis restarted, companions
SIGKILLed over and over. Each test counts every task id afterwards."""

from __future__ import annotations

import contextlib
import json
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis
from celery import Celery

import celery_zdelay
from celery_zdelay.companion import Companion
from celery_zdelay.testing import RedisServer
from tests.conftest import AppFactory
from tests.helpers import CeleryProcess, Runs, start_companion, wait_for
from tests.support.deadletters import dead_reasons
from tests.support.keys import SHARD0

pytestmark = pytest.mark.timeout(240)

DUE, MSG, LEASE = SHARD0.due, SHARD0.msg, SHARD0.lease


@pytest.mark.parametrize("path", ["handoff", "generic"])
def test_corrupt_and_foreign_entries_are_dead_lettered_and_hold_nothing_up(
    make_test_app: AppFactory, redis_server: RedisServer, redis_client: redis.Redis, path: str
) -> None:
    # Given 10 good entries due now, and among them entries that are foreign,
    # of an unknown schema version, truncated, not an envelope, without a
    # payload, or without their template
    app = make_test_app(broker=None if path == "handoff" else f"{redis_server.url}/3")
    record = app.tasks["tests.record"]
    good = [record.apply_delayed((i,), countdown=0).id for i in range(5)]
    template = redis_client.hget(MSG, good[0])
    assert template is not None
    meta, envelope = template.split(b"\n", 1)
    corrupt = {
        "foreign": b"\x80\x04\x95 not ours at all",
        "unknown-version": meta.replace(b'"v":1', b'"v":99') + b"\n" + envelope,
        "truncated": meta + b"\n" + envelope[:-20],
        "not-an-envelope": meta.replace(
            f'"n":{len(envelope)}'.encode(), f'"n":{len(b"x" * len(envelope))}'.encode()
        )
        + b"\n"
        + b"x" * len(envelope),
    }
    score = redis_client.zscore(DUE, good[0])
    for task_id, payload in corrupt.items():
        redis_client.hset(MSG, task_id, payload)
        redis_client.zadd(DUE, {task_id: score})
    redis_client.zadd(DUE, {"missing": score})  # parked without a payload
    # An entry whose template record is gone (the only entry of its task)
    orphan = app.tasks["tests.add"].apply_delayed((1, 2), countdown=0).id
    orphan_meta = json.loads(redis_client.hget(MSG, orphan).split(b"\n", 1)[0])
    assert redis_client.hdel(SHARD0.templates, orphan_meta["t"]) == 1
    good += [record.apply_delayed((i,), countdown=0).id for i in range(5, 10)]

    # When a companion makes one pass
    with Companion(app) as companion:
        report = companion.release_due()

    # Then the good ones are released in it, and each bad one is dead-lettered
    # with its reason; nothing is left parked or in flight
    assert report.released == 10
    dead = dead_reasons(redis_client)
    assert set(dead) == {*corrupt, "missing", orphan}
    assert dead[orphan].startswith("template missing")
    assert dead["foreign"].startswith("foreign entry")
    assert dead["unknown-version"].startswith("unknown schema version 99")
    assert dead["truncated"].startswith("damaged payload")
    assert dead["not-an-envelope"].startswith("damaged payload")
    assert dead["missing"].startswith("payload missing")
    assert redis_client.zcard(DUE) == 0
    assert redis_client.zcard(LEASE) == 0


def test_while_the_broker_is_down_entries_wait_and_then_all_run(
    make_test_app: AppFactory,
    broker_server: RedisServer,
    redis_client: redis.Redis,
    worker,
    companion,
    runs: Runs,
) -> None:
    app = make_test_app(broker=f"{broker_server.url}/0", conf={"zdelay_lease_seconds": 2})
    record = app.tasks["tests.record"]
    process = companion(app)
    broker_server.kill()

    ids = {record.apply_delayed((i,), countdown=0.2 + i * 0.002).id for i in range(300)}
    process.wait_for_log("Broker unreachable")
    wait_for(lambda: redis_client.zcard(LEASE) == 0, message="claims given back")
    assert redis_client.zcard(DUE) + redis_client.zcard(LEASE) == 300
    assert redis_client.zcard(SHARD0.dead) == 0

    broker_server.start()
    worker(app)
    runs.wait_for_count(300, timeout=90)
    assert set(runs.ids()) == ids
    assert runs.duplicates() == {}


@pytest.fixture
def aof_server() -> Iterator[RedisServer]:
    with RedisServer(appendonly="yes", appendfsync="always") as server:
        yield server


def _park_until(
    app: Celery, stop: threading.Event, acknowledged: list[str], refused: dict[str, str]
) -> None:
    """Park tasks one by one until *stop*; sort ids by whether parking returned.

    *refused* maps the ids whose parking raised to the error message.
    """
    record = app.tasks["tests.record"]
    i = 0
    while not stop.is_set():
        task_id = f"p-{i}"
        try:
            record.apply_delayed((i,), task_id=task_id, countdown=random.random())
            acknowledged.append(task_id)
        except celery_zdelay.StoreUnavailableError as exc:
            refused[task_id] = str(exc)
            time.sleep(0.01)  # a producer's own pause before its next attempt
        i += 1


@pytest.mark.parametrize("how", ["restart", "kill"])
def test_redis_restarted_during_parking_and_release_loses_nothing_acknowledged(
    make_test_app: AppFactory, aof_server: RedisServer, worker, companion, runs: Runs, how: str
) -> None:
    # Given a store that is also the broker (atomic handoff), with AOF fsync always
    url = f"{aof_server.url}/0"
    app = make_test_app(
        broker=url,
        conf={
            "zdelay_redis_url": url,
            "zdelay_retry_policy": {"max_retries": 1, "interval_start": 0.05},
            "task_ignore_result": True,
        },
    )
    releasing = companion(app)
    acknowledged: list[str] = []
    refused: dict[str, str] = {}
    stop = threading.Event()
    producer = threading.Thread(target=_park_until, args=(app, stop, acknowledged, refused))
    producer.start()
    try:
        wait_for(lambda: len(acknowledged) > 300, message="parking under way")
        # When Redis goes away mid-stream and comes back
        if how == "restart":
            aof_server.restart()
        else:
            aof_server.kill()
            wait_for(lambda: len(refused) > 0, message="a producer seeing the outage")
            aof_server.start()
        count = len(acknowledged)
        wait_for(lambda: len(acknowledged) > count + 300, message="parking again")
    finally:
        stop.set()
        producer.join(timeout=30)

    # Then every acknowledged task reaches the broker queue exactly once. (No
    # worker consumes during the fault: a worker's own prefetched messages
    # are the broker transport's business, not the store's.)
    client = aof_server.client()
    try:
        wait_for(
            lambda: client.zcard(DUE) + client.zcard(LEASE) == 0,
            timeout=90,
            message=lambda: f"everything released; companion log:\n{releasing.log()[-3000:]}",
        )
        queued = [json.loads(raw)["headers"]["id"] for raw in client.lrange("celery", 0, -1)]
    finally:
        client.close()
    assert set(acknowledged) <= set(queued)
    assert set(queued) <= set(acknowledged) | set(refused)
    assert len(queued) == len(set(queued)), "released twice"
    if how == "kill":
        assert refused, "producers saw a clear error while Redis was down"
    for message in refused.values():
        assert f"Cannot reach the celery-zdelay store at {url}" in message

    # And the released messages run as usual
    worker(app)
    runs.wait_for_count(len(queued), timeout=120)
    assert sorted(runs.ids()) == sorted(queued)


class _Up:
    """Which companions have logged their start line (and so claim)."""

    def __init__(self) -> None:
        # A log is read until its start line shows: the DEBUG logs of a
        # busy companion grow by megabytes, and are polled many times.
        self.started: set[int] = set()

    def __call__(self, companions: list[CeleryProcess]) -> list[CeleryProcess]:
        for c in companions:
            if c.pid not in self.started and " started: " in c.log():
                self.started.add(c.pid)
        return [c for c in companions if c.pid in self.started]


#: Waves of tasks in the repeated-kill test, one kill landing in each.
WAVES = 5
#: Waves at most, when kills land after their wave is out (see the test).
MAX_WAVES = WAVES + 3


# The waves below add up to more than the module's timeout: on a loaded
# 2-core machine, starting replacement companions competes with the workers.
@pytest.mark.timeout(360)
@pytest.mark.parametrize(
    ("path", "dedupe"),
    [("handoff", False), ("generic", False), ("generic", True)],
)
def test_companions_killed_over_and_over_lose_nothing(
    make_test_app: AppFactory,
    broker_server: RedisServer,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    processes: list[CeleryProcess],
    worker,
    runs: Runs,
    path: str,
    dedupe: bool,
) -> None:
    # Given 4 companions and 2 workers
    broker = f"{redis_server.url}/0" if path == "handoff" else f"{broker_server.url}/0"
    batch_size = 200
    app = make_test_app(
        broker=broker,
        conf={
            "zdelay_lease_seconds": 2,
            "zdelay_batch_size": batch_size,
            "zdelay_worker_dedupe": dedupe,
            "task_ignore_result": True,
        },
    )
    record = app.tasks["tests.record"]
    live = []
    for _ in range(4):
        live.append(start_companion(app))
        processes.append(live[-1])  # stopped at teardown
    worker(app)
    worker(app)

    # When 6,000 tasks are parked in 5 waves (1,200 a wave: six batches of
    # 200), each falling due over 2 s, and once a third of a wave is claimed
    # one of the companions is SIGKILLed
    # (then replaced). The next wave waits for three companions to be up:
    # the kills follow how fast replacements start, so a loaded machine
    # (a Celery process costs about a second of CPU to start) slows the test
    # down instead of killing companions before they claim anything.
    up = _Up()
    size = 6_000 // WAVES
    ids: set[str] = set()
    pending_at_kill: list[int] = []
    # Until WAVES kills have landed mid-wave: a wave's entries fall due over
    # 2 s, and a test process descheduled that long on a loaded machine once
    # killed after its wave was out (0 pending: a kill that tests nothing).
    # Such a wave is followed by one more, up to MAX_WAVES.
    wave = 0
    while sum(1 for pending in pending_at_kill if pending) < WAVES:
        assert wave < MAX_WAVES, f"kills landing mid-wave: {pending_at_kill}"
        wait_for(lambda: len(up(live)) >= 3, timeout=60, message="three companions up")
        with celery_zdelay.batch(app):
            for i in range(size):
                ids.add(record.apply_delayed((wave, i), countdown=0.5 + 2.0 * i / size).id)
        third_claimed = redis_client.zcard(DUE) - size // 3
        wait_for(
            lambda: redis_client.zcard(DUE) <= third_claimed,  # noqa: B023 (called at once)
            timeout=60,
            message=f"a third of wave {wave} claimed",
        )
        victim = random.choice(up(live))
        live.remove(victim)
        pending_at_kill.append(redis_client.zcard(DUE) + redis_client.zcard(LEASE))
        victim.kill()
        replacement = CeleryProcess(app, "zdelay", "-l", "DEBUG").start()
        processes.append(replacement)  # stopped at teardown
        live.append(replacement)
        wave += 1
    wait_for(lambda: redis_client.zcard(DUE) == 0, timeout=120, message="all claimed")

    # Then every task runs; twice only where the design allows it
    ran = runs.wait_for_ids(ids, stall_timeout=120)
    assert set(ran) == ids
    duplicates = runs.duplicates()
    if path == "handoff" or dedupe:
        assert duplicates == {}
    else:
        # Only entries published by a companion killed before its store ack
        # run twice: at most one batch per kill.
        assert len(duplicates) <= len(pending_at_kill) * batch_size
    wait_for(lambda: redis_client.zcard(LEASE) == 0, timeout=30, message="nothing in flight")
    assert redis_client.hlen(MSG) == 0


class _ReplyDropper:
    """A TCP proxy in front of Redis that loses one reply, as a restart can.

    Once armed, the first successful reply to a request holding *trigger* is
    not passed on: *on_drop* runs, then the client's connection is closed, so
    the client knows its command was sent but not whether it ran.
    """

    def __init__(self, port: int, trigger: bytes, on_drop: Callable[[], None]) -> None:
        self.upstream = port
        self.trigger = trigger
        self.on_drop = on_drop
        self.armed = False
        self.dropped = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            self.sockets += [client, server]
            pending = threading.Event()  # a request holding the trigger was sent
            threading.Thread(
                target=self._requests, args=(client, server, pending), daemon=True
            ).start()
            threading.Thread(
                target=self._replies, args=(server, client, pending), daemon=True
            ).start()

    def _requests(
        self, client: socket.socket, server: socket.socket, pending: threading.Event
    ) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                if self.armed and self.trigger in data:
                    pending.set()
                server.sendall(data)

    def _replies(
        self, server: socket.socket, client: socket.socket, pending: threading.Event
    ) -> None:
        with contextlib.suppress(OSError):
            while data := server.recv(65536):
                # An error reply (NOSCRIPT before the script is loaded) is passed on.
                if pending.is_set() and self.armed and not data.startswith(b"-"):
                    self.armed = False
                    self.dropped += 1
                    self.on_drop()
                    client.shutdown(socket.SHUT_RDWR)
                    client.close()
                    server.close()
                    return
                client.sendall(data)

    def close(self) -> None:
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.close()


def test_a_park_whose_reply_was_lost_is_not_parked_again_by_the_retry_even_once_released(
    make_test_app: AppFactory, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    # Given a producer that reaches the store through a connection that will
    # lose the reply to a park, and a companion that releases the entry in
    # the moment between the park running and the producer's retry
    direct = make_test_app()
    released = []
    with Companion(direct) as companion:
        proxy = _ReplyDropper(
            redis_server.port, b":parked:", lambda: released.append(companion.release_due())
        )
        try:
            producer = make_test_app(
                broker=f"{redis_server.url}/0",
                conf={"zdelay_redis_url": f"redis://127.0.0.1:{proxy.port}/0"},
            )
            record = producer.tasks["tests.record"]
            record.apply_delayed(("warm-up",), countdown=600)  # loads the scripts
            proxy.armed = True

            # When a task is parked (due now) and the reply to the park is lost
            result = record.apply_delayed(("once",), countdown=0)
        finally:
            proxy.close()

    # Then the producer's retry found the park's marker: the call returned,
    # the entry was released once, and it is not parked a second time
    assert proxy.dropped == 1
    assert [report.released for report in released] == [1]
    queued = [json.loads(raw)["headers"]["id"] for raw in redis_client.lrange("celery", 0, -1)]
    assert queued == [result.id]
    assert redis_client.zscore(DUE, result.id) is None
    assert redis_client.hexists(MSG, result.id) == 0
    assert redis_client.zcard(DUE) == 1  # the warm-up, due in 10 minutes
