"""``celery -A proj zdelay cancel|reschedule|dead`` against a real Redis: the
commands that steer parked work, by id or by filter, and the dead letters.

They run in-process through click (the same ``zdelay`` group Celery loads
from the entry point, on the test app); ``test_cli.py`` has status, list,
the probe, errors and the entry point.
"""

from __future__ import annotations

import json
import re

import celery
import pytest
from celery import Celery

import celery_zdelay
from celery_zdelay._format import utc
from celery_zdelay.cli import (
    EXIT_CHECK_FAILED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_USAGE,
)
from celery_zdelay.companion import Companion
from celery_zdelay.config import get_config
from celery_zdelay.store import Store, admin
from tests.support.cli import assert_shows, lines, run, timed
from tests.support.store import Stock, due_ms, put_raw

pytestmark = pytest.mark.timeout(90)

ISO = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"


# -- cancel and reschedule ----------------------------------------------------------------


def test_cancel_reports_each_id_and_exits_3_when_one_was_not_parked(
    app: Celery, stocked: Stock
) -> None:
    result = run(app, "cancel", stocked.soon, stocked.in_flight, "no-such-id")

    assert result.exit_code == EXIT_NOT_FOUND
    assert lines(result) == [
        f"cancelled   {stocked.soon}",
        f"not parked  {stocked.in_flight} (unknown, released, or being released)",
        "not parked  no-such-id (unknown, released, or being released)",
    ]
    assert run(app, "cancel", stocked.overdue).exit_code == EXIT_OK
    remaining = json.loads(run(app, "list", "--json").stdout)["entries"]
    assert [e["id"] for e in remaining] == [stocked.in_flight, *stocked.later]


def test_reschedule_by_countdown_or_eta(app: Celery, stocked: Stock, store: Store) -> None:
    # Given the stocked store; when one entry is moved 10 minutes ahead and
    # another to an absolute time
    by_countdown, before, after = timed(
        store, lambda: run(app, "reschedule", stocked.overdue, "--countdown", "600")
    )
    by_eta = run(app, "reschedule", stocked.soon, "--eta", "2030-01-01T00:00:00Z")

    # Then each says where it moved, and the store agrees
    assert by_countdown.exit_code == EXIT_OK
    said = re.fullmatch(
        rf"rescheduled {stocked.overdue}: due in (.+) \(({ISO})\)\n", by_countdown.stdout
    )
    assert said, by_countdown.stdout
    due = due_ms(store, stocked.overdue)
    assert before + 600_000 <= due <= after + 600_000
    assert_shows(said[1], at_least_ms=due - after, at_most_ms=due - before)
    assert said[2] == utc(due)
    assert by_eta.exit_code == EXIT_OK
    assert by_eta.stdout.endswith("(2030-01-01T00:00:00Z)\n")
    entries = {e["id"]: e for e in json.loads(run(app, "list", "--json").stdout)["entries"]}
    assert entries[stocked.soon]["due_ms"] == 1_893_456_000_000
    assert list(entries)[-1] == stocked.soon


def test_reschedule_needs_exactly_one_time_and_a_parked_id(app: Celery, stocked: Stock) -> None:
    neither = run(app, "reschedule", stocked.soon)
    both = run(app, "reschedule", stocked.soon, "--countdown", "5", "--eta", "2030-01-01")
    bad_eta = run(app, "reschedule", stocked.soon, "--eta", "tomorrow")
    unknown = run(app, "reschedule", "no-such-id", "--countdown", "5")

    assert neither.exit_code == both.exit_code == bad_eta.exit_code == EXIT_USAGE
    assert "Give exactly one of --countdown DURATION or --eta ISO." in both.stderr
    assert "eta must be a datetime or an ISO 8601 string" in bad_eta.stderr
    assert unknown.exit_code == EXIT_NOT_FOUND
    assert unknown.stdout.startswith("not parked  no-such-id")


# -- dead letters ----------------------------------------------------------------------------


def test_dead_list_shows_when_why_and_what(app: Celery, stocked: Stock) -> None:
    human = run(app, "dead", "list")
    document = json.loads(run(app, "dead", "list", "--json").stdout)

    assert human.exit_code == EXIT_OK
    out = lines(human)
    assert re.fullmatch(r"DIED\s+TASK\s+ID\s+QUEUE\s+REASON", out[0])
    assert re.fullmatch(
        # Regression: the reason was cut at 40 characters ("celery-zde...").
        r"\d+m?s ago\s+\(unreadable\)\s+damaged-1\s+-\s+foreign entry: the payload does not "
        r"start with celery-zdelay metadata",
        out[1],
    )
    assert out[2] == "1 dead-lettered entry."
    (entry,) = document["entries"]
    assert entry["id"] == stocked.dead
    assert entry["reason"] == (
        "foreign entry: the payload does not start with celery-zdelay metadata"
    )
    assert entry["due_ms"] < entry["died_ms"] <= document["now_ms"]
    assert entry["companion"]
    assert document["more"] is False


def test_dead_requeue_by_id_or_all(app: Celery, store: Store, stocked: Stock) -> None:
    put_raw(store, "no-message-1", None, due_in_ms=-1000)
    with Companion(app, store=store) as companion:
        assert companion.release_due().dead_lettered == 1

    one = run(app, "dead", "requeue", stocked.dead, "no-such-id")
    assert one.exit_code == EXIT_NOT_FOUND
    assert lines(one) == [
        f"requeued      {stocked.dead}, due now",
        "not requeued  no-such-id (not dead-lettered, no message, or parked again)",
    ]
    assert [
        e["id"]
        for e in json.loads(run(app, "list", "--json", "--due-before", "now").stdout)["entries"]
    ] == [stocked.in_flight, stocked.dead]

    with Companion(app, store=store) as companion:
        assert companion.release_due().dead_lettered == 1  # still damaged: dead again
    everything = run(app, "dead", "requeue", "--all")
    assert everything.exit_code == EXIT_OK
    assert lines(everything) == [
        "requeued 1 entry, due now",
        "left 1 entry dead-lettered: no message, or the id was parked again "
        "(see: zdelay dead list)",
    ]
    assert run(app, "dead", "requeue").exit_code == EXIT_USAGE
    assert run(app, "dead", "requeue", "x", "--all").exit_code == EXIT_USAGE


def test_dead_purge_asks_before_deleting_everything(app: Celery, store: Store) -> None:
    for i in range(3):
        put_raw(store, f"damaged-{i}", b"damaged", due_in_ms=-1000)
    with Companion(app, store=store) as companion:
        assert companion.release_due().dead_lettered == 3

    by_id = run(app, "dead", "purge", "damaged-0", "no-such-id")
    declined = run(app, "dead", "purge", input="n\n")
    accepted = run(app, "dead", "purge", input="y\n")
    nothing = run(app, "dead", "purge", "--yes")

    assert (by_id.exit_code, by_id.stdout) == (EXIT_NOT_FOUND, "purged 1 of 2 entries\n")
    assert declined.exit_code == EXIT_CHECK_FAILED
    assert declined.stdout == "Delete all 2 dead-lettered entries? [y/N]: n\nNothing purged.\n"
    assert accepted.exit_code == EXIT_OK
    assert accepted.stdout.endswith("purged 2 entries\n")
    assert (nothing.exit_code, nothing.stdout) == (EXIT_OK, "No dead-lettered entries.\n")


# -- bulk cancel and reschedule, durations ------------------------------------------------


def test_cancel_by_filter_counts_with_a_dry_run_then_cancels(app: Celery) -> None:
    record, add = app.tasks["tests.record"], app.tasks["tests.add"]
    for i in range(3):
        record.apply_delayed((i,), countdown=600)
    later = record.apply_delayed(("later",), countdown=7200)
    add.apply_delayed((1, 1), countdown=600)

    dry = run(app, "cancel", "--task", "tests.record", "--due-before", "1h", "--dry-run")
    done = run(app, "cancel", "--task", "tests.record", "--due-before", "1h")
    one = run(app, "cancel", "--task", "tests.add")
    mixed = run(app, "cancel", later.id, "--task", "tests.record")

    assert (dry.exit_code, dry.stdout) == (EXIT_OK, "would cancel 3 parked tasks (dry run)\n")
    assert (done.exit_code, done.stdout) == (EXIT_OK, "cancelled 3 parked tasks\n")
    assert one.stdout == "cancelled 1 parked task\n"
    assert mixed.exit_code == EXIT_USAGE
    store = Store(get_config(app))
    try:
        assert [e.task_id for e in admin.list_parked(store).entries] == [later.id]
    finally:
        store.close()


def test_a_dry_run_with_ids_is_refused_and_changes_nothing(app: Celery) -> None:
    # Regression: --dry-run was ignored with ids: "cancel ID --dry-run" cancelled.
    result = app.tasks["tests.record"].apply_delayed(("x",), countdown=600)
    before = celery_zdelay.lookup(result.id, app=app)

    cancel = run(app, "cancel", result.id, "--dry-run")
    move = run(app, "reschedule", result.id, "--countdown", "2h", "--dry-run")

    assert cancel.exit_code == EXIT_USAGE
    assert "--dry-run" in cancel.output
    assert move.exit_code == EXIT_USAGE
    assert "--dry-run" in move.output
    assert before is not None
    assert celery_zdelay.lookup(result.id, app=app) == before


def test_a_due_bound_beyond_the_furthest_due_time_is_a_usage_error(app: Celery) -> None:
    # Regression: cancel --due-before 99999999999d ended in an OverflowError traceback.
    result = app.tasks["tests.record"].apply_delayed(("x",), countdown=600)

    far = run(app, "cancel", "--due-before", "99999999999d", "--dry-run")
    listed = run(app, "list", "--due-after", "-99999999999d")

    for refused in (far, listed):
        assert refused.exit_code == EXIT_USAGE, refused.output
        assert "at most" in refused.output
    assert celery_zdelay.lookup(result.id, app=app) is not None


def test_reschedule_takes_the_duration_format_list_takes(app: Celery) -> None:
    # Regression: --countdown 5m was rejected while list --due-before 5m worked.
    result = app.tasks["tests.record"].apply_delayed(("x",), countdown=60)

    moved = run(app, "reschedule", result.id, "--countdown", "5m")
    found = celery_zdelay.lookup(result.id, app=app)

    assert moved.exit_code == EXIT_OK, moved.output
    assert re.fullmatch(
        rf"rescheduled {result.id}: due in (4m 5\ds|5m 0s) \({ISO}\)\n", moved.stdout
    )
    assert found is not None
    assert found.due_ms is not None


def test_rescheduling_into_the_past_says_so(app: Celery) -> None:
    result = app.tasks["tests.record"].apply_delayed(("x",), countdown=600)

    moved = run(app, "reschedule", result.id, "--countdown", "-10m")

    assert moved.exit_code == EXIT_OK, moved.output
    assert re.fullmatch(
        rf"rescheduled {result.id}: due {ISO}, (9m 5\ds|10m \ds) ago: that is in the past, "
        r"so it is released at once\n",
        moved.stdout,
    )


def test_reschedule_by_filter_counts_and_moves(app: Celery) -> None:
    record = app.tasks["tests.record"]
    for i in range(2):
        record.apply_delayed((i,), countdown=600, queue="orders")
    record.apply_delayed(("mail",), countdown=600, queue="mail")

    dry = run(app, "reschedule", "--queue", "orders", "--countdown", "2h", "--dry-run")
    done = run(app, "reschedule", "--queue", "orders", "--countdown", "2h")

    assert dry.stdout == "would reschedule 2 parked tasks (dry run)\n"
    assert done.stdout == "rescheduled 2 parked tasks\n"


def test_cancel_takes_a_parked_chains_result_id_among_plain_ids(app: Celery) -> None:
    record = app.tasks["tests.record"]
    chained = celery_zdelay.apply_delayed(
        celery.chain(record.si("a"), record.si("b")), countdown=600, app=app
    )
    plain = record.apply_delayed(("p",), countdown=600)

    result = run(app, "cancel", chained.id, plain.id, "no-such-id")

    assert result.exit_code == EXIT_NOT_FOUND
    assert lines(result) == [
        f"cancelled   {chained.id}",
        f"cancelled   {plain.id}",
        "not parked  no-such-id (unknown, released, or being released)",
    ]
    assert celery_zdelay.lookup(chained.parent.id, app=app) is None
