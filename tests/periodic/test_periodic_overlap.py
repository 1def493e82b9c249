"""Overlap policy: an occurrence due while its schedule's previous run is unfinished.

Issue 26 item 2: ``zdelay_overlap`` is ``allow`` (celery beat's behaviour),
``skip`` or ``buffer_one``. The companions release every occurrence once as
before; the worker that is about to run it applies the policy, taking the
schedule's key as an ``until_finished`` key is taken, freed when the task
returns or, for a SIGKILLed worker, once ``zdelay_overlap_timeout`` passed.
Real Redis, real solo workers (three, so runs could overlap), real
companions, a task that runs long (``tests.slow_late``).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import pytest
from celery import Celery
from werkzeug.test import Client

from celery_zdelay import ConfigurationError
from celery_zdelay.periodic.definition import Definition, from_beat_entry
from celery_zdelay.periodic.overlap import overlap_headers
from celery_zdelay.web import create_app
from tests.helpers import CeleryProcess, Runs, wait_for
from tests.support.cli import run
from tests.support.periodic import (
    finished_runs,
    occurrence_ms,
    overlapping_runs,
    run_spans,
    start_beat_companion,
    tick_counts,
    ticks_of,
)

pytestmark = pytest.mark.timeout(300)

SLOW = "tests.slow_late"


def _entry(seconds: float, **extra: Any) -> dict[str, Any]:
    return {"task": SLOW, "schedule": 1.0, "args": [seconds], **extra}


def test_bad_overlap_values_are_refused_with_the_fix() -> None:
    def entry(**extra: Any) -> None:
        from_beat_entry("a", {"task": "t", "schedule": 10.0, **extra}, known_tasks={"t"})

    for bad in ("sometimes", "", None, 1, ["skip"]):
        with pytest.raises(ConfigurationError, match="zdelay_overlap must be one of allow, skip"):
            entry(zdelay_overlap=bad)
    for bad in (0, -5, "60", True, 8 * 86_400):
        with pytest.raises(ConfigurationError, match="zdelay_overlap_timeout must be a number"):
            entry(zdelay_overlap="skip", zdelay_overlap_timeout=bad)
    with pytest.raises(ConfigurationError, match="set zdelay_overlap to 'skip' or 'buffer_one'"):
        entry(zdelay_overlap_timeout=60)


def test_the_policy_is_stored_and_travels_to_the_worker_in_the_headers() -> None:
    # Given entries with each policy
    skip = from_beat_entry(
        "s", _entry(1, zdelay_overlap="skip", zdelay_overlap_timeout=90), known_tasks={SLOW}
    )
    allow = from_beat_entry("a", _entry(1), known_tasks={SLOW})

    # Then the stored definition keeps it, an entry without it keeps its old text
    assert Definition.from_body("s", skip.body()) == skip
    assert (skip.overlap, skip.overlap_timeout_ms) == ("skip", 90_000)
    assert "overlap" not in allow.body()
    assert "(overlap skip)" in skip.describe()
    # and only an occurrence of a schedule with a policy carries headers for it
    assert overlap_headers(skip) == {
        "zdelay_schedule": "s",
        "zdelay_overlap": "skip",
        "zdelay_overlap_timeout_ms": 90_000,
    }
    assert overlap_headers(allow) == {}


def _serve(
    app: Celery,
    worker: Any,
    processes: list[CeleryProcess],
    schedule: dict[str, Any],
    *,
    workers: int = 3,
    companions: int = 1,
) -> list[CeleryProcess]:
    for _ in range(workers):
        worker(app)
    started = [start_beat_companion(app, schedule) for _ in range(companions)]
    processes.extend(started)
    return started


def test_allow_lets_runs_overlap_as_celery_beat_does(
    app: Celery, worker: Any, processes: list[CeleryProcess], runs: Runs
) -> None:
    # Given three workers and a 1-second schedule whose task runs 2.5 s, no policy
    _serve(app, worker, processes, {"slow": _entry(2.5)})

    # When a few runs finished
    wait_for(lambda: finished_runs(runs, "slow") >= 3, timeout=90)

    # Then runs overlapped (the workers could run them side by side), none skipped
    assert overlapping_runs(run_spans(runs, "slow"))
    assert tick_counts(app, "slow")["skipped_overlap"] == 0


def test_skip_never_overlaps_and_counts_the_skipped_ticks_under_three_companions_and_a_sigkill(
    app: Celery, worker: Any, processes: list[CeleryProcess], runs: Runs
) -> None:
    # Given three workers, three companions, and the same schedule with overlap skip
    schedule = {"slow": _entry(2.5, zdelay_overlap="skip", zdelay_overlap_timeout=60)}
    companions = _serve(app, worker, processes, schedule, companions=3)
    wait_for(lambda: finished_runs(runs, "slow") >= 2, timeout=90)

    # When a companion is SIGKILLed and the others go on
    companions[0].kill()
    wait_for(lambda: finished_runs(runs, "slow") >= 4, timeout=90)

    # Then no run started while another was unfinished, each occurrence ran once,
    spans = run_spans(runs, "slow")
    assert overlapping_runs(spans) == []
    started = Counter(r["id"] for r in ticks_of(runs.all(), "slow") if r["result"] == "started")
    assert max(started.values()) == 1
    # and the ticks released meanwhile were skipped and counted, as list shows
    counts = tick_counts(app, "slow")
    assert counts["skipped_overlap"] >= 2
    listed = re.search(r"skipped by overlap (\d+)", run(app, "periodic", "list").stdout)
    assert listed is not None
    assert int(listed.group(1)) >= counts["skipped_overlap"]
    # and the dashboard's periodic page shows them, with the last run's task id
    html = Client(create_app(app)).get("/periodic").get_data(as_text=True)
    shown = re.search(r"skipped by overlap (\d+)", html)
    assert shown is not None
    assert int(shown.group(1)) >= counts["skipped_overlap"]
    assert "overlap skip" in html
    # (a long id may break between its parts: <wbr> there)
    assert re.search(r"<code>periodic:slow:v1:[0-9T:.-]+Z</code>", html.replace("<wbr>", ""))


def test_buffer_one_runs_one_waiting_tick_after_the_run_ends_and_skips_the_rest(
    app: Celery, worker: Any, processes: list[CeleryProcess], runs: Runs
) -> None:
    # Given three workers and a 1-second schedule whose task runs 3 s, buffer_one
    schedule = {"slow": _entry(3.0, zdelay_overlap="buffer_one", zdelay_overlap_timeout=60)}
    _serve(app, worker, processes, schedule)

    # When a few runs finished
    wait_for(lambda: finished_runs(runs, "slow") >= 3, timeout=120)

    # Then runs never overlapped,
    spans = run_spans(runs, "slow")
    assert overlapping_runs(spans) == []
    # a run waited for the one before it (started well after its own time,
    # which a skipped-or-run-at-once policy never does),
    waited = [start - occurrence_ms(i) for i, (start, _) in spans.items()]
    assert max(waited) >= 1500, waited
    # and, one waiting at most, the third tick of each run was skipped
    assert tick_counts(app, "slow")["skipped_overlap"] >= 1


def test_a_sigkilled_worker_blocks_the_schedule_until_the_timeout_and_no_longer(
    app: Celery, worker: Any, processes: list[CeleryProcess], runs: Runs
) -> None:
    # Given two workers and a 1-second schedule whose task runs 60 s, skip, timeout 4 s
    schedule = {"slow": _entry(60, zdelay_overlap="skip", zdelay_overlap_timeout=4)}
    workers = [worker(app), worker(app)]
    processes.append(start_beat_companion(app, schedule))
    wait_for(lambda: run_spans(runs, "slow"), timeout=60)
    (first_id, (first_start, _)), *_ = run_spans(runs, "slow").items()

    # When the worker running it is SIGKILLed mid-run (it never reports the end)
    wait_for(lambda: any(first_id in w.log() for w in workers), timeout=30)
    running = next(w for w in workers if first_id in w.log())
    running.kill()

    # Then the other worker skips the ticks while the run owns the key, and runs
    # one once it ended (with no bound: zdelay_max_run_seconds, an hour)
    wait_for(lambda: len(run_spans(runs, "slow")) >= 2, timeout=90)
    later = {i: s for i, (s, _) in run_spans(runs, "slow").items() if i != first_id}
    assert min(later.values()) >= first_start + 4000 - 50, (first_start, later)
    assert tick_counts(app, "slow")["skipped_overlap"] >= 2
