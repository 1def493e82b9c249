"""``celery -A proj zdelay status|list`` and the probe, against a real Redis.

Steering (cancel, reschedule, dead letters) is in ``test_cli_steering.py``;
stores that are missing or refuse us in ``test_cli_errors.py``.

Most commands run in-process through click (the same ``zdelay`` group Celery
loads from the entry point, on the test app); the probe and the entry point
itself run as real ``celery`` subprocesses.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import click
import pytest
from celery import Celery

import celery_zdelay
from celery_zdelay import cli
from celery_zdelay._format import utc
from celery_zdelay.cli import (
    EXIT_CHECK_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    zdelay,
)
from celery_zdelay.companion import Companion
from celery_zdelay.config import get_config
from celery_zdelay.store import Store, admin
from celery_zdelay.store.redis_keys import companions_key, shard_of
from celery_zdelay.testing import RedisServer
from tests.conftest import AppFactory
from tests.helpers import ROOT, CeleryProcess, wait_for
from tests.project import app_env
from tests.support.cli import assert_shows, lines, run, timed
from tests.support.store import Stock, due_ms, put_raw, write_heartbeat

pytestmark = pytest.mark.timeout(90)

ISO = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"


def run_celery(app: Celery, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the real ``celery -A tests.project.worker_app zdelay <args>`` command."""
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.project.worker_app", "zdelay", *args],
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **app_env(app)},
        capture_output=True,
        text=True,
        timeout=60,
    )


# -- status -----------------------------------------------------------------------


def test_status_shows_every_state_companions_and_the_redis_warning(
    app: Celery, stocked: Stock, store: Store, redis_server: RedisServer
) -> None:
    # Given the stocked store (5 parked, 1 overdue, 1 in flight, 1 dead), no
    # companion, and a Redis without persistence; when status runs
    result, before, after = timed(store, lambda: run(app, "status"))

    # Then it names the store and the server's settings, counts each state
    # with the times of the entries due next and overdue longest, and warns
    assert result.exit_code == EXIT_OK, result.output
    out = result.stdout
    assert lines(result)[0] == f"Store:  {redis_server.url}/0 (prefix zdelay, 1 shard)"
    assert re.search(
        r"^Redis:  \d+\.\d+\.\d+, maxmemory-policy noeviction, appendonly no, "
        r'appendfsync everysec, save ""$',
        out,
        re.M,
    )
    parked = re.search(rf"^Parked     5  next due in (.+) \(({ISO})\)$", out, re.M)
    assert parked, out
    soon = due_ms(store, stocked.soon)
    assert_shows(parked[1], at_least_ms=soon - after, at_most_ms=soon - before)
    assert parked[2] == utc(soon)
    # Overdue counts the entry in flight past its due time too, and the
    # oldest overdue one is it (due 10 s ago).
    overdue = re.search(r"^Overdue    2  oldest overdue (.+) \(1 of them in flight\)$", out, re.M)
    assert overdue, out
    found = celery_zdelay.lookup(stocked.in_flight, app=app)
    assert found is not None
    assert found.due_ms is not None
    late = found.due_ms
    assert_shows(overdue[1], at_least_ms=before - late, at_most_ms=after - late)
    assert "In flight  1  claimed, not yet acknowledged" in lines(result)
    assert "Dead       1  see: zdelay dead list" in lines(result)
    assert "Companions: none alive (start one with: celery -A proj zdelay)" in lines(result)
    assert (
        'Warning: Redis persistence is off (appendonly no, save ""); every parked task is '
        "lost when Redis restarts. Set appendonly yes and appendfsync everysec."
    ) in lines(result)


def test_status_per_shard_adds_a_table_of_each_shard(make_test_app: AppFactory) -> None:
    app = make_test_app(conf={"zdelay_shards": 2})
    for i in range(10):
        app.tasks["tests.record"].apply_delayed((i,), countdown=0 if i < 4 else 600)
    store = Store(get_config(app))
    try:
        counted = admin.counts(store)
    finally:
        store.close()

    result = run(app, "status", "--per-shard")

    assert result.exit_code == EXIT_OK
    out = lines(result)
    header = out.index("SHARD  PARKED  OVERDUE  OLDEST OVERDUE  IN FLIGHT  DEAD  NEXT DUE")
    for shard, row in zip(counted.shards, out[header + 1 : header + 3], strict=True):
        cells = row.split()
        assert cells[:3] == [str(shard.shard), str(shard.parked), str(shard.overdue)]
    assert sum(int(row.split()[1]) for row in out[header + 1 : header + 3]) == 10
    assert "(prefix zdelay, 2 shards)" in out[0]
    assert "SHARD  PARKED  OVERDUE" in run(app, "status", "--shards").stdout  # the alias


def test_status_json_is_one_document_with_every_count(
    app: Celery, stocked: Stock, store: Store
) -> None:
    # Given the stocked store; when status --json runs
    result = run(app, "status", "--json")

    # Then one document holds every count, read at the document's own now_ms

    assert result.exit_code == EXIT_OK
    document = json.loads(result.stdout)
    assert {k: document[k] for k in ("parked", "overdue", "in_flight", "dead")} == {
        "parked": 5,
        "overdue": 2,
        "in_flight": 1,
        "dead": 1,
    }
    assert document["overdue_in_flight"] == 1
    in_flight = celery_zdelay.lookup(stocked.in_flight, app=app)
    assert in_flight is not None
    assert in_flight.due_ms is not None
    assert document["oldest_overdue_age_ms"] == document["now_ms"] - in_flight.due_ms
    assert document["next_due_ms"] == due_ms(store, stocked.soon)
    assert 0 < document["next_due_ms"] - document["now_ms"] <= 60_000
    assert document["store"] == {
        "url": get_config(app).redis_url,
        "key_prefix": "zdelay",
        "shards": 1,
    }
    (shard,) = document["shards"]
    assert shard["shard"] == 0
    assert shard["parked"] == 5
    assert document["companions"] == []
    assert document["redis"]["maxmemory_policy"] == "noeviction"
    assert document["redis"]["warnings"][0].startswith("Redis persistence is off")
    assert "check" not in document


def test_status_hides_the_store_password(make_test_app: AppFactory, redis_server: Any) -> None:
    client = redis_server.client()
    client.config_set("requirepass", "s3cret")
    try:
        app = make_test_app(
            conf={"zdelay_redis_url": f"redis://:s3cret@127.0.0.1:{redis_server.port}/0"}
        )
        result = run(app, "status", "--json")
        text = run(app, "status")
    finally:
        client.execute_command("AUTH", "s3cret")
        client.config_set("requirepass", "")
        client.close()

    assert result.exit_code == EXIT_OK
    assert "s3cret" not in result.stdout
    assert "s3cret" not in text.stdout
    assert json.loads(result.stdout)["store"]["url"].startswith("redis://:**@127.0.0.1")


# -- status --check, the probe ------------------------------------------------------------


def test_check_passes_while_a_companion_runs_and_fails_once_it_stops(
    app: Celery, companion: Callable[..., CeleryProcess]
) -> None:
    # Given no companion, the probe fails
    probe = run_celery(app, "status", "--check")
    assert (probe.returncode, probe.stdout.strip()) == (
        EXIT_CHECK_FAILED,
        "FAIL: no companion is alive",
    )

    # When a companion runs, the probe passes once its heartbeat is in
    process = companion(app)
    wait_for(lambda: run(app, "status", "--check").exit_code == EXIT_OK, timeout=20)
    probe = run_celery(app, "status", "--check")
    assert (probe.returncode, probe.stdout.strip()) == (
        EXIT_OK,
        "OK: 1 companion alive, nothing overdue",
    )
    document = json.loads(run(app, "status", "--check", "--json").stdout)
    assert document["check"] == {"ok": True, "problems": [], "max_overdue_ms": 60_000}
    (beat,) = document["companions"]
    assert (beat["pid"], beat["alive"], beat["shards"]) == (process.pid, True, [0])
    human = run(app, "status").stdout
    assert "Companions: 1 alive" in human
    assert re.search(rf"^\S+:{process.pid}:\S+\s+alive\s+\S+\s+{process.pid}\s+0\s", human, re.M)

    # When it stops, it removes its heartbeat and the probe fails again
    assert process.terminate() == 0
    result = run(app, "status", "--check")
    assert (result.exit_code, result.stdout.strip()) == (
        EXIT_CHECK_FAILED,
        "FAIL: no companion is alive",
    )


def test_check_fails_when_an_entry_is_overdue_longer_than_allowed(
    app: Celery, store: Store
) -> None:
    # Given a live companion and an entry 90 s overdue
    write_heartbeat(store, "live-1", seen_ago_ms=0)
    late = due_ms(store, put_raw(store, "late-1", b"x", due_in_ms=-90_000))

    # When the probe allows 60 s, and then 300 s
    strict, before, _ = timed(store, lambda: run(app, "status", "--check", "--max-overdue", "60"))
    lenient, _, after = timed(store, lambda: run(app, "status", "--check", "--max-overdue", "300"))

    # Then the first fails naming the age and the limit, the second passes
    assert strict.exit_code == EXIT_CHECK_FAILED
    failed = re.fullmatch(
        r"FAIL: the oldest overdue entry is (.+) overdue \(limit 1m 0s\)\n", strict.stdout
    )
    assert failed, strict.stdout
    assert_shows(failed[1], at_least_ms=before - late, at_most_ms=after - late)
    assert lenient.exit_code == EXIT_OK
    passed = re.fullmatch(r"OK: 1 companion alive, oldest overdue (.+)\n", lenient.stdout)
    assert passed, lenient.stdout
    assert_shows(passed[1], at_least_ms=before - late, at_most_ms=after - late)


def test_a_companion_killed_without_cleanup_shows_as_stale_and_fails_the_check(
    app: Celery, store: Store
) -> None:
    # Given a heartbeat last written 2 minutes ago
    write_heartbeat(store, "host-a:4242:dead0000", seen_ago_ms=120_000)
    beat = store.client.hget(companions_key("zdelay"), "host-a:4242:dead0000")
    seen = json.loads(beat)["seen_ms"]

    # When status and the probe look at it
    result, before, after = timed(store, lambda: run(app, "status"))
    check = run(app, "status", "--check")

    # Then it is stale, last seen 2 minutes ago, and the probe fails

    assert "Companions: 0 alive, 1 stale" in lines(result)
    assert re.search(
        r"^host-a:4242:dead0000\s+stale\s+host-a\s+4242\s+0\s+on\s+7\s+1\s", result.stdout, re.M
    )
    last_seen = re.search(r"^host-a:4242:dead0000\s.*\s(\S+ \S+) ago$", result.stdout, re.M)
    assert last_seen, result.stdout
    assert_shows(last_seen[1], at_least_ms=before - seen, at_most_ms=after - seen)
    assert (check.exit_code, check.stdout.strip()) == (
        EXIT_CHECK_FAILED,
        "FAIL: no companion is alive",
    )


def test_entries_left_on_shards_beyond_zdelay_shards_are_a_warning_and_fail_the_check(
    make_test_app: AppFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # Given tasks parked over 4 shards, and zdelay_shards then lowered to 2
    wide = make_test_app(conf={"zdelay_shards": 4})
    ids = [wide.tasks["tests.record"].apply_delayed((i,), countdown=600).id for i in range(40)]
    narrow = make_test_app(conf={"zdelay_shards": 2})
    store = Store(get_config(narrow))
    try:
        write_heartbeat(store, "live-1", seen_ago_ms=0, shards=[0, 1])
        left = sorted({shard_of(task_id, 4) for task_id in ids} - {0, 1})
        assert left  # 40 random ids leave shards 2 and 3 both empty once in 50,000 runs
        expected = (
            f"Shard{'s' if len(left) > 1 else ''} {','.join(map(str, left))} "
            f"still hold{'' if len(left) > 1 else 's'} entries, but zdelay_shards is 2: "
            "no companion releases them and cancel does not find them. "
            f"Set zdelay_shards back to at least {left[-1] + 1}."
        )

        # Then status, its JSON, the probe and the companion's start-up all say so
        assert admin.stranded_shards(store) == left
        assert f"Warning: {expected}" in lines(run(narrow, "status"))
        assert json.loads(run(narrow, "status", "--json").stdout)["stranded_shards"] == left
        check = run(narrow, "status", "--check")
        assert (check.exit_code, check.stdout.strip()) == (EXIT_CHECK_FAILED, f"FAIL: {expected}")
        caplog.set_level(logging.WARNING, logger="celery_zdelay")
        assert expected in admin.log_store_warnings(store)

        # And with the setting back at 4 nothing is stranded
        restored = Store(get_config(wide))
        try:
            assert admin.stranded_shards(restored) == []
        finally:
            restored.close()
    finally:
        store.close()


# -- list ---------------------------------------------------------------------------------


def test_list_shows_entries_in_due_order_with_relative_times(
    app: Celery, stocked: Stock, store: Store
) -> None:
    # Given the stocked store; when list runs
    result, before, after = timed(store, lambda: run(app, "list"))

    # Then a row per parked entry, in due order, says when it is due (relative
    # and UTC), its task, id, queue and arguments, in aligned columns
    assert result.exit_code == EXIT_OK
    out = lines(result)
    assert re.fullmatch(r"DUE\s+DUE AT \(UTC\)\s+TASK\s+ID\s+QUEUE\s+ARGS", out[0])
    rows = [row.split("  ") for row in out[1:-1]]
    cells = [[c.strip() for c in row if c.strip()] for row in rows]
    # The entry in flight past its due time is listed, first, as status counts it.
    assert [row[3] for row in cells] == [
        stocked.in_flight,
        stocked.overdue,
        stocked.soon,
        *stocked.later,
    ]
    assert re.fullmatch(r"overdue \d+s, in flight", cells[0][0])
    late = due_ms(store, stocked.overdue)
    assert cells[1][0].startswith("overdue ")
    assert_shows(cells[1][0][8:], at_least_ms=before - late, at_most_ms=after - late)
    assert cells[1][2:] == ["tests.record", stocked.overdue, "celery", "('late',) {'x': 1}"]
    soon = due_ms(store, stocked.soon)
    assert cells[2][0].startswith("in ")
    assert_shows(cells[2][0][3:], at_least_ms=soon - after, at_most_ms=soon - before)
    assert cells[2][2:] == ["tests.add", stocked.soon, "celery", "(2, 3)"]
    assert all(re.fullmatch(r"in (29m 5\d|30m \d)s", row[0]) for row in cells[3:])
    assert all(re.fullmatch(ISO, row[1]) for row in cells)
    assert [row[4] for row in cells[3:]] == ["orders"] * 3
    assert out[-1] == "6 entries: 5 parked, 1 in flight."
    # Columns line up: every row starts its TASK cell where the header does.
    task_column = out[0].index("TASK")
    assert all(row[task_column - 2 : task_column] == "  " for row in out[1:-1])


def test_list_json_is_stable_and_complete(app: Celery, stocked: Stock) -> None:
    result = run(app, "list", "--json", "--limit", "3")

    document = json.loads(result.stdout)
    assert document["more"] is True
    assert [e["id"] for e in document["entries"]] == [
        stocked.in_flight,
        stocked.overdue,
        stocked.soon,
    ]
    assert [e["state"] for e in document["entries"]] == ["in_flight", "parked", "parked"]
    first = document["entries"][1]
    assert set(first) == {
        "state",
        "id",
        "task",
        "shard",
        "due_ms",
        "parked_ms",
        "queue",
        "argsrepr",
        "kwargsrepr",
        "expires",
        "error",
        "held_by",
        "held_reason",
        "key",
        "tags",
    }
    assert (first["held_by"], first["held_reason"]) == (None, None)
    assert (first["task"], first["queue"], first["argsrepr"], first["kwargsrepr"]) == (
        "tests.record",
        "celery",
        "('late',)",
        "{'x': 1}",
    )
    assert first["due_ms"] < document["now_ms"]
    assert first["error"] is None
    human = run(app, "list", "--limit", "3")
    assert lines(human)[-1] == (
        "Showing the first 3 entries: 2 parked, 1 in flight; more match (raise --limit)."
    )


def test_list_filters_by_task_and_due_window(app: Celery, stocked: Stock) -> None:
    def ids(*args: str) -> list[str]:
        result = run(app, "list", "--json", *args)
        assert result.exit_code == EXIT_OK, result.output
        return [e["id"] for e in json.loads(result.stdout)["entries"]]

    assert ids("--task", "tests.add") == [stocked.soon]
    assert ids("--task", "tests.rec*") == [stocked.in_flight, stocked.overdue, *stocked.later]
    assert ids("--due-before", "now") == [stocked.in_flight, stocked.overdue]
    assert ids("--due-after", "now", "--due-before", "10m") == [stocked.soon]
    assert ids("--due-after", "20m") == stocked.later
    assert ids("--due-after", "-1h", "--due-before", "-1s") == [stocked.in_flight, stocked.overdue]
    assert ids("--due-after", "2000-01-01T00:00:00Z", "--task", "tests.add") == [stocked.soon]
    assert run(app, "list", "--task", "nothing").stdout.strip() == "No parked entries match."


def test_list_filters_by_queue_with_task_and_due_window(app: Celery) -> None:
    # Given the same task parked for two queues, in flight for one of them
    record = app.tasks["tests.record"]
    orders = [record.apply_delayed((i,), countdown=600, queue="orders").id for i in range(3)]
    mails = [record.apply_delayed((i,), countdown=900, queue="mails").id for i in range(2)]
    with Companion(app) as companion:
        store = companion.store
        taken = store.claim(
            store.shard_of(orders[0]), limit=1, lease_ms=600_000, advance_ms=700_000
        )
    assert [entry.task_id for entry in taken.entries] == [orders[0]]

    def ids(*args: str) -> list[str]:
        result = run(app, "list", "--json", *args)
        assert result.exit_code == EXIT_OK, result.output
        return [e["id"] for e in json.loads(result.stdout)["entries"]]

    # Then --queue selects by queue (name or pattern), in flight included,
    # and combines with the task and due-time filters
    assert ids("--queue", "orders") == orders
    assert ids("--queue", "m*") == mails
    assert ids("--queue", "orders", "--task", "tests.add") == []
    assert ids("--queue", "*s", "--due-after", "12m") == mails
    assert run(app, "list", "--queue", "nothing").stdout.strip() == "No parked entries match."


@pytest.mark.parametrize("bad", ["soon", "10 minutes", "2025-13-45"])
def test_list_refuses_a_time_it_cannot_read(app: Celery, bad: str) -> None:
    result = run(app, "list", "--due-before", bad)

    assert result.exit_code == EXIT_USAGE
    assert "use now, a duration such as 30s" in result.stderr


# -- help and the entry point --------------------------------------------------------------


def _commands(group: click.Group, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    yield path
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            yield from _commands(command, (*path, name))
        else:
            yield (*path, name)


def test_every_command_has_help_with_examples_of_itself(app: Celery) -> None:
    paths = list(_commands(zdelay))
    # Named, so that a command added says which one it is
    assert {" ".join(path) for path in paths} == {
        "",
        "adopt",
        "cancel",
        "concurrency",
        "dead",
        "history",
        "limit",
        "list",
        "pause",
        "repair",
        "reschedule",
        "resume",
        "status",
        "web",
        *(f"dead {sub}" for sub in ("list", "purge", "requeue")),
        "periodic",
        *(
            f"periodic {sub}"
            for sub in ("add", "backfill", "list", "pause", "remove", "resume", "run", "sync")
        ),
    }

    for path in paths:
        result = run(app, *path, "--help")
        assert result.exit_code == EXIT_OK, path
        assert "Examples:" in result.stdout, path
        examples = result.stdout.split("Examples:", 1)[1]
        assert f"celery -A proj zdelay {' '.join(path)}".rstrip() in examples, path


def test_exit_codes_are_named_and_distinct() -> None:
    codes = {name: getattr(cli, name) for name in cli.__all__ if name.startswith("EXIT_")}

    assert codes == {
        "EXIT_OK": 0,
        "EXIT_CHECK_FAILED": 1,
        "EXIT_USAGE": 2,
        "EXIT_NOT_FOUND": 3,
        "EXIT_UNAVAILABLE": 69,
        "EXIT_CONFIG": 78,
    }


def test_the_celery_entry_point_runs_the_subcommands(app: Celery, stocked: Stock) -> None:
    status = run_celery(app, "status", "--json")
    listing = run_celery(app, "list", "--json", "--task", "tests.add")
    usage = run_celery(app, "--help")

    assert status.returncode == EXIT_OK, status.stderr
    assert json.loads(status.stdout)["parked"] == 5
    assert [e["id"] for e in json.loads(listing.stdout)["entries"]] == [stocked.soon]
    for name in ("status", "list", "cancel", "reschedule", "dead"):
        assert re.search(rf"^  {name}\s", usage.stdout, re.M), name


def test_the_companion_logs_json_lines_on_request(
    app: Celery, store: Store, companion: Callable[..., CeleryProcess]
) -> None:
    process = companion(app, "--log-format", "json")
    put_raw(store, "damaged-1", b"damaged", due_in_ms=0)
    process.wait_for_log("Dead-lettered damaged-1")

    records = [json.loads(line) for line in process.log().splitlines() if line.strip()]

    assert {"time", "level", "logger", "message"} <= set(records[0])
    started = next(r for r in records if " started: " in r["message"])
    assert (started["level"], started["logger"]) == ("INFO", "celery_zdelay.companion.loop")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", started["time"])
    dead = next(r for r in records if r["message"].startswith("Dead-lettered"))
    assert dead["level"] == "ERROR"
    assert "damaged-1" in dead["message"]


def test_an_entry_in_flight_past_its_due_time_is_late_for_status_check_and_list(
    app: Celery, store: Store
) -> None:
    # Regression: during a broker outage, status --check said "OK, nothing
    # overdue" while an entry was overdue and in flight, and list said "no
    # parked entries" while status said "Overdue 1".
    write_heartbeat(store, "live-1", seen_ago_ms=1_000)
    result = app.tasks["tests.record"].apply_delayed(("x",), countdown=-120)
    store.claim(store.shard_of(result.id), limit=10, lease_ms=600_000)

    check = run(app, "status", "--check", "--max-overdue", "60")
    listed = run(app, "list", "--json", "--due-before", "now")

    assert check.exit_code == EXIT_CHECK_FAILED
    assert re.fullmatch(
        r"FAIL: the oldest overdue entry is 2m \ds overdue \(limit 1m 0s\)\n", check.stdout
    )
    (entry,) = json.loads(listed.stdout)["entries"]
    assert (entry["id"], entry["state"]) == (result.id, "in_flight")
