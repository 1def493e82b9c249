"""Stale releases: a task released past its ``max_late`` is dead-lettered, dropped or run.

Given a task parked with ``max_late`` (or a companion with ``zdelay_max_late``),
when a companion would release it later than that after its due time (an
outage, a pause, a backlog), then it does what ``zdelay_on_stale`` says, in the
step that takes it from the claim: ``"dead"`` dead-letters it with reason
``"stale"`` (and a requeue runs it), ``"drop"`` cancels it (``REVOKED``,
``tasks_cancelled``, ``task-revoked``), ``"run"`` publishes it and counts it.
Lateness is on the Redis clock; periodic occurrences are never stale. Each
test says the one-line change it catches.

Tasks are made late by parking them with an ``eta`` in the past (due then,
released at the next pass): what an outage of that length leaves behind.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import celery_zdelay
from celery_zdelay import signals
from celery_zdelay.companion import Companion
from celery_zdelay.companion.metrics import Metrics
from celery_zdelay.entry import entry_max_late_ms
from celery_zdelay.periodic.definition import from_beat_entry
from celery_zdelay.periodic.server import occurrence_id
from celery_zdelay.revocation import REVOKE_REASON
from celery_zdelay.stale import PERIODIC_ID_PREFIX
from celery_zdelay.steering import requeue_dead
from celery_zdelay.store import Store
from tests.conftest import AppFactory
from tests.helpers import wait_for
from tests.support.clock import redis_ms
from tests.support.deadletters import dead_reasons
from tests.support.events import EventsSeen
from tests.support.keys import SHARD0

pytestmark = pytest.mark.timeout(90)

#: Two ways to the broker: the atomic handoff (handoff.lua decides), and the
#: leased path (with a signing key every entry is leased and checked in
#: Python, then pushed by push.lua: release.py decides).
PATHS = ["handoff", "leased"]
SIGNED = {"zdelay_signing_key": "k" * 32}


def _app(make_test_app: AppFactory, path: str, **conf: Any) -> Celery:
    return make_test_app(conf={**(SIGNED if path == "leased" else {}), **conf})


def _ago(seconds: float) -> datetime:
    return datetime.now(timezone.utc) - timedelta(seconds=seconds)


def _released_ids(client: redis.Redis, queue: str = "celery") -> list[str]:
    return [json.loads(m)["headers"]["id"] for m in client.lrange(queue, 0, -1)]


def _parked(client: redis.Redis) -> int:
    return int(client.zcard(SHARD0.due)) + int(client.zcard(SHARD0.lease))


@contextlib.contextmanager
def _heard(signal: Any) -> Iterator[list[dict[str, Any]]]:
    heard: list[dict[str, Any]] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        heard.append(kwargs)

    signal.connect(receiver, weak=False)
    try:
        yield heard
    finally:
        signal.disconnect(receiver)


# -- "dead" (the default) ------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_a_stale_task_is_dead_lettered_with_reason_stale_and_a_requeue_runs_it(
    make_test_app: AppFactory, redis_client: redis.Redis, path: str
) -> None:
    """Catches, in handoff.lua's stale(): ``late_ms > limit`` -> ``false`` (handoff),
    or in ReleasePass._stale_ms: ``return None`` first (leased): it would be released."""
    app = _app(make_test_app, path)
    record = app.tasks["tests.record"]
    # Given a task due an hour ago that may be at most 10 minutes late, and
    # one due an hour ago with a limit of two hours
    stale = record.apply_delayed(("stale",), eta=_ago(3600), max_late=600)
    within = record.apply_delayed(("within",), eta=_ago(3600), max_late=7200)
    unlimited = record.apply_delayed(("no limit",), eta=_ago(3600))

    # When a companion releases them
    with Companion(app) as companion:
        report = companion.release_due()

    # Then the stale one is dead-lettered with reason "stale", the others go out
    assert report.stale == {"dead": 1}
    assert report.released == 2
    assert dead_reasons(redis_client) == {stale.id: "stale"}
    assert sorted(_released_ids(redis_client)) == sorted([within.id, unlimited.id])
    letter = celery_zdelay.lookup(stale.id, app=app)
    assert letter is not None
    assert (letter.state, letter.reason) == ("dead", "stale")
    last = celery_zdelay.history(stale.id, app=app)[-1]
    assert (last.event, last.reason) == ("dead", "stale")

    # When it is requeued (due now), then the next pass releases it
    assert requeue_dead([stale.id], app=app) == [True]
    with Companion(app) as companion:
        assert companion.release_due().released == 1
    assert stale.id in _released_ids(redis_client)
    assert _parked(redis_client) == 0


def test_a_running_companion_dead_letters_what_an_outage_left_stale_and_releases_the_rest(
    make_test_app: AppFactory, redis_client: redis.Redis, companion: Any
) -> None:
    """The ``celery zdelay`` process, configured by its app's settings alone.

    Catches the setting not reaching the companion's release pass (e.g.
    ``max_late_ms=self.config.max_late_ms`` left out of the handoff call).
    """
    app = make_test_app(conf={"zdelay_max_late": 300})
    record = app.tasks["tests.record"]
    # Given what a 20-minute outage left: tasks due 20, 10 and 2 minutes ago
    left = {ago: record.apply_delayed((ago,), eta=_ago(ago * 60)) for ago in (20, 10, 2)}
    kept = record.apply_delayed(("own limit",), eta=_ago(20 * 60), max_late=3600)

    # When the companion comes back
    companion(app)

    # Then what is past 5 minutes is dead-lettered as stale, the rest goes out
    wait_for(lambda: redis_client.llen("celery") == 2, message="two released")
    wait_for(lambda: len(dead_reasons(redis_client)) == 2, message="two dead-lettered")
    assert dead_reasons(redis_client) == {left[20].id: "stale", left[10].id: "stale"}
    assert sorted(_released_ids(redis_client)) == sorted([left[2].id, kept.id])


def test_a_backlog_gone_stale_is_logged_once_per_batch_not_once_per_task(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    """After an outage thousands go stale at once: one WARNING per batch says so
    (an ERROR per task, as other dead letters get, would flood the log).
    Catches the per-task line left at ERROR in _report_dead."""
    record = app.tasks["tests.record"]
    for i in range(50):
        record.apply_delayed((i,), eta=_ago(120), max_late=60)

    with caplog.at_level(logging.INFO, logger="celery_zdelay"), Companion(app) as companion:
        assert companion.release_due().stale == {"dead": 50}

    lines = [
        r
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("celery_zdelay.companion")
    ]
    assert [r.getMessage()[:45] for r in lines] == ["Shard 0: 50 stale entries dead-lettered (cele"]
    assert "zdelay dead requeue" in lines[0].getMessage()


@pytest.mark.parametrize("path", PATHS)
def test_the_companions_setting_applies_at_release_and_a_calls_max_late_overrides_it(
    make_test_app: AppFactory, redis_client: redis.Redis, path: str
) -> None:
    """Catches ``limit = tonumber(limit) or default_late_ms`` -> ``tonumber(limit)``
    (handoff.lua), or dropping the ``self.config.max_late_ms`` fallback (release.py);
    and a per-call limit that lost to the setting."""
    producer = _app(make_test_app, path)
    record = producer.tasks["tests.record"]
    # Given tasks parked by a producer that knows of no limit
    plain = record.apply_delayed(("plain",), eta=_ago(1800))
    allowed = record.apply_delayed(("allowed",), eta=_ago(1800), max_late=3600)

    # When a companion whose app says zdelay_max_late = 600 (set since) releases them
    producer.conf.zdelay_max_late = 600
    with Companion(producer) as companion:
        report = companion.release_due()

    # Then its setting makes the plain one stale; the call's own limit wins
    assert report.stale == {"dead": 1}
    assert dead_reasons(redis_client) == {plain.id: "stale"}
    assert _released_ids(redis_client) == [allowed.id]


# -- "drop" --------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_a_dropped_stale_task_ends_revoked_with_the_signal_and_the_flower_event(
    make_test_app: AppFactory, redis_client: redis.Redis, path: str
) -> None:
    """Catches: drop_stale.lua not called (still leased), announce_cancelled left
    out (PENDING, no signal, no event), or the outcome read as "dead"."""
    app = _app(make_test_app, path, zdelay_on_stale="drop", task_send_sent_event=True)
    record = app.tasks["tests.record"]
    stale = record.apply_delayed(("stale",), eta=_ago(120), max_late=60, tags=["t"])
    fresh = record.apply_delayed(("fresh",), eta=_ago(10), max_late=60)

    with (
        EventsSeen(app) as seen,
        _heard(signals.tasks_cancelled) as cancelled,
        Companion(app) as companion,
    ):
        report = companion.release_due()
        seen.wait_for(lambda: seen.of_type("task-revoked"), what="task-revoked")

    assert report.stale == {"drop": 1}
    assert _released_ids(redis_client) == [fresh.id]
    # Gone for good: not parked, not in flight, not dead, its tag forgotten
    assert _parked(redis_client) == 0
    assert dead_reasons(redis_client) == {}
    assert celery_zdelay.cancel_matching(tag="t", app=app) == 0
    result = AsyncResult(stale.id, app=app)
    assert result.state == "REVOKED"
    assert REVOKE_REASON in str(result.result)
    (heard,) = cancelled
    assert heard["task_ids"] == [stale.id]
    assert heard["by"].startswith("companion:")
    assert [e["uuid"] for e in seen.of_type("task-revoked")] == [stale.id]
    # Its history says who cancelled it and why
    last = celery_zdelay.history(stale.id, app=app)[-1]
    assert (last.event, last.reason) == ("cancelled", "stale")
    assert last.by == heard["by"]


def test_drop_takes_an_entry_from_the_lease_only_under_its_own_claim(
    app: Celery, store: Store, redis_client: redis.Redis
) -> None:
    """Never lost, never doubled: a companion whose claim was taken over (its lease
    expired, another claimed it) drops nothing. Catches ``zdelay_owned(...)`` ->
    ``true`` in drop_stale.lua."""
    parked = app.tasks["tests.record"].apply_delayed((1,), eta=_ago(120), max_late=60)
    claim = store.claim(0, limit=10, lease_ms=30_000)
    assert [e.task_id for e in claim.entries] == [parked.id]

    assert store.drop_stale(0, claim.token + 1, [parked.id]) == []
    assert redis_client.zscore(SHARD0.lease, parked.id) is not None
    assert redis_client.hexists(SHARD0.msg, parked.id)

    assert store.drop_stale(0, claim.token, [parked.id]) == [parked.id]
    assert redis_client.zscore(SHARD0.lease, parked.id) is None
    assert not redis_client.hexists(SHARD0.leased, parked.id)
    assert not redis_client.hexists(SHARD0.msg, parked.id)
    assert redis_client.zscore(SHARD0.due, parked.id) is None


# -- "run" ---------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_run_publishes_a_stale_task_and_counts_it_in_the_metric(
    make_test_app: AppFactory, redis_client: redis.Redis, path: str
) -> None:
    """Catches: the count left out of _released, or "run" handled as "dead"."""
    app = _app(make_test_app, path, zdelay_on_stale="run")
    record = app.tasks["tests.record"]
    stale = [record.apply_delayed((i,), eta=_ago(120), max_late=60) for i in range(3)]
    fresh = record.apply_delayed(("fresh",), eta=_ago(10), max_late=60)

    with _heard(signals.tasks_stale) as heard, Companion(app) as companion:
        metrics = Metrics(companion.store).connect(companion)
        try:
            report = companion.release_due()
            text = generate_latest(metrics.registry).decode()
        finally:
            metrics.close()

    assert report.stale == {"run": 3}
    assert report.released == 4
    assert sorted(_released_ids(redis_client)) == sorted([r.id for r in stale] + [fresh.id])
    assert dead_reasons(redis_client) == {}
    samples = {
        s.labels["outcome"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "zdelay_stale_total"
    }
    assert samples == {"dead": 0, "drop": 0, "run": 3}
    (signal,) = heard
    assert signal["outcome"] == "run"
    assert sorted(signal["task_ids"]) == sorted(r.id for r in stale)
    assert all(115_000 <= ms <= 180_000 for ms in signal["lateness_ms"])


def test_the_metric_counts_dead_letters_and_drops_by_outcome(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    """Catches: ``self.stale.labels(outcome).inc(len(task_ids))`` -> ``.inc()``, or
    the receiver not connected."""
    for outcome, count in (("dead", 2), ("drop", 3)):
        app = make_test_app(conf={"zdelay_on_stale": outcome})
        record = app.tasks["tests.record"]
        for i in range(count):
            record.apply_delayed((i,), eta=_ago(120), max_late=60)
        with Companion(app) as companion:
            metrics = Metrics(companion.store).connect(companion)
            try:
                companion.release_due()
                text = generate_latest(metrics.registry).decode()
            finally:
                metrics.close()
        samples = {
            s.labels["outcome"]: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "zdelay_stale_total"
        }
        assert samples[outcome] == count, text


# -- the generic path (kombu, a RabbitMQ broker) -------------------------------


@pytest.mark.parametrize("outcome", ["dead", "run"])
def test_the_generic_path_applies_the_same_rule(
    make_test_app: AppFactory, request: pytest.FixtureRequest, outcome: str
) -> None:
    """Catches the stale check moved into the handoff alone."""
    rabbitmq = request.getfixturevalue("rabbitmq")
    app = make_test_app(
        broker=rabbitmq.url,
        conf={"task_default_queue": rabbitmq.queue, "zdelay_on_stale": outcome},
    )
    record = app.tasks["tests.record"]
    stale = record.apply_delayed(("stale",), eta=_ago(120), max_late=60)
    fresh = record.apply_delayed(("fresh",), eta=_ago(10), max_late=60)

    with Companion(app) as companion:
        report = companion.release_due()

    assert report.stale == {outcome: 1}
    dead = celery_zdelay.lookup(stale.id, app=app)
    if outcome == "dead":
        assert report.published == 1
        assert dead is not None
        assert (dead.state, dead.reason) == ("dead", "stale")
    else:
        assert report.published == 2
        assert dead is None
    assert celery_zdelay.lookup(fresh.id, app=app) is None


# -- held entries --------------------------------------------------------------


@pytest.mark.timing
def test_a_task_held_by_a_pause_past_its_max_late_goes_stale_when_the_queue_resumes(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    """Catches the stale check placed after the gate's hold, or skipped for
    entries claimed from a held set (they would go out on resume)."""
    app = make_test_app(conf={"zdelay_shards": 1}, queues=[{"name": "celery"}, {"name": "emails"}])
    record = app.tasks["tests.record"]
    celery_zdelay.pause("queue:emails", app=app)
    due = datetime.now(timezone.utc) + timedelta(milliseconds=200)
    # Given two emails due in 0.2 s, one allowed 1 s of lateness, the other 60 s
    short = record.apply_delayed(("short",), eta=due, queue="emails", max_late=1)
    long = record.apply_delayed(("long",), eta=due, queue="emails", max_late=60)

    with Companion(app) as companion:
        # When they fall due while the queue is paused, they are held, not stale
        wait_for(lambda: sum(companion.release_due().held.values()) == 2, message="held")
        assert dead_reasons(redis_client) == {}
        # ...and the pause outlasts the short one's max_late
        due_ms = round(due.timestamp() * 1000)
        wait_for(lambda: redis_ms(redis_client) > due_ms + 1500, message="1.5 s past due")
        celery_zdelay.resume("queue:emails", app=app)

        # Then on resume the short one is dead-lettered as stale, the long one goes out
        def drained() -> bool:
            companion.release_due()
            return not redis_client.zcard(SHARD0.due) and bool(redis_client.llen("emails"))

        wait_for(drained, message="the held emails claimed again")
    assert dead_reasons(redis_client) == {short.id: "stale"}
    assert _released_ids(redis_client, "emails") == [long.id]


# -- the Redis clock -----------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("skew_s", [40, -40], ids=["ahead", "behind"])
def test_lateness_is_measured_on_the_redis_clock_not_the_companions(
    make_test_app: AppFactory,
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    path: str,
    skew_s: int,
) -> None:
    """A companion whose own clock is 40 s off decides as one whose clock is right.

    Catches, in ReleasePass._stale_ms: ``late_ms = now_ms - entry.due_ms`` ->
    ``late_ms = round(time.time() * 1000) - entry.due_ms``: ahead, the on-time
    task is dead-lettered; behind, the 60 s late one goes out.
    """
    app = _app(make_test_app, path)
    record = app.tasks["tests.record"]
    on_time = record.apply_delayed(("on time",), countdown=0.3, max_late=20)
    late = record.apply_delayed(("late",), eta=_ago(60), max_late=30)

    true_time = time.time
    monkeypatch.setattr(time, "time", lambda: true_time() + skew_s)
    with Companion(app) as companion:
        wait_for(
            lambda: (companion.release_due() and False) or not redis_client.zcard(SHARD0.due),
            message="both released or dead-lettered",
        )
    monkeypatch.undo()
    assert dead_reasons(redis_client) == {late.id: "stale"}
    assert _released_ids(redis_client) == [on_time.id]


# -- periodic occurrences ------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_a_periodic_occurrence_is_never_stale(
    make_test_app: AppFactory, redis_client: redis.Redis, path: str
) -> None:
    """Its schedule's zdelay_missed decides instead. Catches dropping the
    ``'periodic:'`` check in handoff.lua's stale() or ``exempt()`` in release.py."""
    app = _app(make_test_app, path, zdelay_max_late=60)
    occurrence_ms = round(_ago(3600).timestamp() * 1000)
    task_id = occurrence_id("hourly", 1, occurrence_ms)
    assert task_id.startswith(PERIODIC_ID_PREFIX)
    celery_zdelay.send_delayed(app, "tests.record", ("tick",), eta=_ago(3600), task_id=task_id)

    with Companion(app) as companion:
        report = companion.release_due()

    assert report.stale == {}
    assert _released_ids(redis_client) == [task_id]


# -- where the limit is stored ---------------------------------------------------


def test_max_late_is_stored_in_the_entrys_metadata_line(
    app: Celery, redis_client: redis.Redis
) -> None:
    record = app.tasks["tests.record"]
    with_limit = record.apply_delayed((1,), countdown=60, max_late=timedelta(minutes=10))
    without = record.apply_delayed((2,), countdown=60)
    many = record.apply_delayed_many([(3,), (4,)], countdown=60, max_late=1.5)
    sent = celery_zdelay.send_delayed(app, "tests.record", (5,), countdown=60, max_late=90)

    def stored(task_id: str) -> int | None:
        return entry_max_late_ms(redis_client.hget(SHARD0.msg, task_id))

    assert stored(with_limit.id) == 600_000
    assert stored(without.id) is None
    assert [stored(r.id) for r in many] == [1500, 1500]
    assert stored(sent.id) == 90_000
    # The parked-at stamp stays first; the entry still reads as the task's message.
    payload = redis_client.hget(SHARD0.msg, with_limit.id)
    assert payload is not None
    assert payload.startswith(b'{"p":')
    listed = celery_zdelay.lookup(with_limit.id, app=app)
    assert listed is not None
    assert listed.task == "tests.record"


# -- bad input -------------------------------------------------------------------

BAD_MAX_LATE = [
    -1,
    0,
    0.5,
    "600",
    True,
    float("nan"),
    float("inf"),
    timedelta(seconds=-5),
    10**12,
]


@pytest.mark.parametrize("value", BAD_MAX_LATE, ids=repr)
def test_a_max_late_that_is_not_a_number_of_seconds_of_at_least_one_parks_nothing(
    app: Celery, redis_client: redis.Redis, value: Any
) -> None:
    """Catches dropping any bound of stale.max_late_ms (a zero limit would
    dead-letter every task; a string would fail in the companion)."""
    record = app.tasks["tests.record"]
    calls = [
        lambda: record.apply_delayed((1,), countdown=60, max_late=value),
        lambda: record.apply_delayed_many([(1,), (2,)], countdown=60, max_late=value),
        lambda: celery_zdelay.send_delayed(app, "tests.record", (1,), countdown=60, max_late=value),
        lambda: celery_zdelay.apply_delayed(record.s(1), countdown=60, max_late=value),
    ]
    for call in calls:
        with pytest.raises(celery_zdelay.ConfigurationError, match="max_late must be a number"):
            call()
    assert redis_client.zcard(SHARD0.due) == 0


def test_a_bad_max_late_is_refused_under_task_always_eager_too(make_test_app: AppFactory) -> None:
    app = make_test_app(conf={"task_always_eager": True})
    with pytest.raises(celery_zdelay.ConfigurationError, match="max_late"):
        app.tasks["tests.record"].apply_delayed((1,), max_late=-5)


@pytest.mark.parametrize(
    ("setting", "value", "says"),
    [
        ("zdelay_on_stale", "later", 'zdelay_on_stale must be one of "dead", "drop", "run"'),
        ("zdelay_on_stale", "", "zdelay_on_stale must be one of"),
        ("zdelay_max_late", 0, "zdelay_max_late must be a number of seconds"),
        ("zdelay_max_late", "10m", "zdelay_max_late must be a number of seconds"),
    ],
)
def test_bad_settings_say_what_to_do_and_park_nothing(
    make_test_app: AppFactory, redis_client: redis.Redis, setting: str, value: Any, says: str
) -> None:
    app = make_test_app(conf={setting: value})
    with pytest.raises(celery_zdelay.ConfigurationError) as raised:
        app.tasks["tests.record"].apply_delayed((1,), countdown=60)
    assert says.replace('"', "'") in str(raised.value).replace('"', "'")
    assert redis_client.zcard(SHARD0.due) == 0
    with pytest.raises(celery_zdelay.ConfigurationError):
        Companion(app)


def test_max_late_on_a_message_parked_whole_is_refused_and_the_setting_still_applies(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    """A message stored whole has no metadata line: a call's max_late cannot be
    kept, so it is refused; the companions' zdelay_max_late covers such entries."""
    app = make_test_app(conf={"zdelay_whole_messages": True, "zdelay_max_late": 60})
    record = app.tasks["tests.record"]
    with pytest.raises(celery_zdelay.ConfigurationError, match="zdelay_whole_messages"):
        record.apply_delayed((1,), countdown=60, max_late=600)
    assert redis_client.zcard(SHARD0.due) == 0

    stale = record.apply_delayed(("stale",), eta=_ago(120))
    fresh = record.apply_delayed(("fresh",), eta=_ago(10))
    with Companion(app) as companion:
        report = companion.release_due()
    assert report.stale == {"dead": 1}
    assert dead_reasons(redis_client) == {stale.id: "stale"}
    assert _released_ids(redis_client) == [fresh.id]


def test_max_late_is_refused_on_a_periodic_schedule_and_on_a_periodic_id(app: Celery) -> None:
    """A periodic occurrence follows its schedule's zdelay_missed: a max_late there
    would say something that never happens."""
    with pytest.raises(celery_zdelay.ConfigurationError, match="zdelay_missed"):
        from_beat_entry(
            "hourly",
            {"task": "tests.record", "schedule": 3600.0, "options": {"max_late": 600}},
        )
    with pytest.raises(celery_zdelay.ConfigurationError, match="periodic occurrences"):
        app.tasks["tests.record"].apply_delayed(
            (1,), countdown=60, max_late=600, task_id="periodic:hourly:v1:2026-01-01T00:00:00Z"
        )
