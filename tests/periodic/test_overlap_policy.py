"""An occurrence starting while its schedule's previous run goes on is skipped or waits.

Pins the lines of ``celery_zdelay/periodic/overlap.py`` and of the overlap
hook of ``celery_zdelay/worker.py`` (see docs/mutation.rst): the headers an
occurrence carries for its policy (none for ``allow``), read from the
message's headers however Celery hands them to the task, and
:func:`apply_overlap_policy` on a private Redis in this process, the
task's request pushed as a worker pushes it: the first run takes the
schedule's key for ``zdelay_overlap_timeout`` (by default
``zdelay_max_run_seconds``, also for a timeout header that is not a
positive count), an occurrence starting meanwhile is skipped and counted
(``skip``) or waits for the run to end (``buffer_one``) and then logs
that it waited (only then), an eager call or one without an id takes
nothing, and a store out of reach lets the occurrence run. The stories through real workers are in
test_periodic_overlap.py.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore

from celery_zdelay import worker
from celery_zdelay.parking import store_for
from celery_zdelay.periodic.definition import Definition, from_beat_entry
from celery_zdelay.periodic.overlap import overlap_headers, overlap_key, overlap_key_of_run
from celery_zdelay.periodic.store import PeriodicStore
from celery_zdelay.store import Store
from celery_zdelay.store.headers import OVERLAP_HEADER, OVERLAP_TIMEOUT_HEADER, SCHEDULE_HEADER
from celery_zdelay.store.marks import key_owner
from celery_zdelay.testing import free_port
from celery_zdelay.worker import apply_overlap_policy, release_key
from tests.conftest import AppFactory
from tests.support.clock import redis_ms

pytestmark = pytest.mark.timeout(60)

KEY = overlap_key("a")


def _schedule(overlap: str, timeout_s: float | None = None) -> Definition:
    entry: dict[str, Any] = {"task": "tests.record", "schedule": 10.0, "zdelay_overlap": overlap}
    if timeout_s is not None:
        entry["zdelay_overlap_timeout"] = timeout_s
    return from_beat_entry("a", entry)


def _start(app: Celery, task_id: str | None, headers: dict[str, Any], **request: Any) -> None:
    """Apply the policy to an occurrence *task_id* with *headers*, as a worker pushes it."""
    task = app.tasks["tests.record"]
    task.push_request(id=task_id, headers=headers, **headers, **request)
    try:
        apply_overlap_policy(task)
    finally:
        task.pop_request()


def _finish(app: Celery, task_id: str, headers: dict[str, Any]) -> None:
    task = app.tasks["tests.record"]
    task.push_request(id=task_id, headers=headers, **headers)
    try:
        release_key(task)
    finally:
        task.pop_request()


def _owned_until(store: Store, task_id: str) -> int:
    """When *task_id*'s ownership of the schedule's key ends (Redis ms)."""
    owner = key_owner(store, KEY)
    assert owner is not None
    assert owner[0] == task_id
    assert owner[1] is not None
    return owner[1]


def test_an_occurrence_carries_its_schedule_and_policy_and_allow_carries_nothing() -> None:
    assert overlap_headers(_schedule("allow")) == {}
    assert overlap_headers(_schedule("skip", 5)) == {
        SCHEDULE_HEADER: "a",
        OVERLAP_HEADER: "skip",
        OVERLAP_TIMEOUT_HEADER: 5000,
    }
    assert overlap_headers(_schedule("buffer_one")) == {
        SCHEDULE_HEADER: "a",
        OVERLAP_HEADER: "buffer_one",
    }


class _Request:
    """A request as Celery gives it: headers as attributes, or in ``headers`` only."""

    def __init__(self, headers: dict[str, Any], *, as_attributes: bool) -> None:
        self.headers = None if as_attributes else headers
        if as_attributes:
            self.__dict__.update(headers)


def test_the_overlap_key_is_read_from_attributes_or_headers_for_skip_and_buffer_one_only() -> None:
    for policy in ("skip", "buffer_one"):
        headers = overlap_headers(_schedule(policy))
        assert overlap_key_of_run(_Request(headers, as_attributes=True)) == KEY
        assert overlap_key_of_run(_Request(headers, as_attributes=False)) == KEY
    for headers in (
        {SCHEDULE_HEADER: "a", OVERLAP_HEADER: "allow"},
        {SCHEDULE_HEADER: 7, OVERLAP_HEADER: "skip"},
        {OVERLAP_HEADER: "skip"},
    ):
        assert overlap_key_of_run(_Request(headers, as_attributes=False)) is None


def test_skip_takes_the_key_for_the_overlap_timeout_and_skips_and_counts_an_occurrence_meanwhile(
    app: Celery,
) -> None:
    headers = overlap_headers(_schedule("skip", 5))
    store = store_for(app)
    before = redis_ms(store.client)

    _start(app, "first", headers)

    until = _owned_until(store, "first")
    assert before + 5000 <= until <= redis_ms(store.client) + 5000
    assert PeriodicStore(store).snapshot().counts == {}
    with pytest.raises(Ignore):
        _start(app, "second", headers)
    assert PeriodicStore(store).snapshot().counts == {"a": {"skipped_overlap": 1}}

    _finish(app, "first", headers)
    _start(app, "third", headers)
    assert (key_owner(store, KEY) or ("",))[0] == "third"


def test_without_an_overlap_timeout_the_key_is_taken_for_the_max_run(
    make_test_app: AppFactory,
) -> None:
    app = make_test_app(conf={"zdelay_max_run_seconds": 120})
    store = store_for(app)
    before = redis_ms(store.client)
    _start(app, "first", overlap_headers(_schedule("skip")))
    until = _owned_until(store, "first")
    assert before + 120_000 <= until <= redis_ms(store.client) + 120_000


def test_the_old_name_zdelay_key_hold_seconds_still_sets_the_max_run_with_a_warning(
    make_test_app: AppFactory,
) -> None:
    # Given an app that still spells the setting by its old name
    app = make_test_app(conf={"zdelay_key_hold_seconds": 120})
    with pytest.warns(DeprecationWarning, match="rename it to zdelay_max_run_seconds"):
        store = store_for(app)
    before = redis_ms(store.client)

    # When a run takes its schedule's key, the old name sets how long
    _start(app, "first", overlap_headers(_schedule("skip")))

    until = _owned_until(store, "first")
    assert before + 120_000 <= until <= redis_ms(store.client) + 120_000


@pytest.mark.parametrize(
    ("timeout", "owned_ms"),
    [(1, 1), (0, 120_000), (-5, 120_000), ("5000", 120_000), (None, 120_000)],
    ids=["1-ms", "zero", "negative", "not-a-number", "none"],
)
def test_an_overlap_timeout_header_of_a_positive_count_is_the_max_run_else_the_setting(
    make_test_app: AppFactory, timeout: Any, owned_ms: int
) -> None:
    # Definitions give at least 1 ms; a message written otherwise (by hand,
    # by another producer) takes the key for the worker's max run
    app = make_test_app(conf={"zdelay_max_run_seconds": 120})
    store = store_for(app)
    headers = {**overlap_headers(_schedule("skip")), OVERLAP_TIMEOUT_HEADER: timeout}
    before = redis_ms(store.client)

    _start(app, "first", headers)

    until = _owned_until(store, "first")
    assert before + owned_ms <= until <= redis_ms(store.client) + owned_ms


def test_an_eager_call_or_one_without_an_id_takes_nothing(app: Celery) -> None:
    headers = overlap_headers(_schedule("skip", 5))
    _start(app, "eager", headers, is_eager=True)
    _start(app, None, headers)
    assert key_owner(store_for(app), KEY) is None


def test_buffer_one_waits_for_the_run_before_it_to_end_then_runs(app: Celery) -> None:
    headers = overlap_headers(_schedule("buffer_one", 30))
    _start(app, "first", headers)
    failures: list[BaseException] = []

    def second() -> None:
        try:
            _start(app, "second", headers)
        except BaseException as exc:  # reported by the test below
            failures.append(exc)

    waiting = threading.Thread(target=second)
    waiting.start()
    waiting.join(timeout=1.0)
    assert waiting.is_alive(), "the second occurrence ran while the first one went on"

    _finish(app, "first", headers)
    waiting.join(timeout=30)

    assert not waiting.is_alive()
    assert failures == []
    assert (key_owner(store_for(app), KEY) or ("",))[0] == "second"


def test_only_an_occurrence_that_waited_logs_that_it_ran_after_the_run_before_it(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    # A max run of 0.3 s: the second occurrence waits for it to end, here
    headers = overlap_headers(_schedule("buffer_one", 0.3))
    caplog.set_level(logging.INFO, logger=worker.__name__)

    _start(app, "first", headers)
    assert _waited_logs(caplog) == []
    _start(app, "second", headers)

    assert _waited_logs(caplog) == ["second"]
    assert (key_owner(store_for(app), KEY) or ("",))[0] == "second"


def _waited_logs(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Ids of the occurrences logged as run after the run before them ended."""
    return [
        str(r.args[1])
        for r in caplog.records
        if r.name == worker.__name__ and "ran after the run before it ended" in r.msg
    ]


def test_a_store_out_of_reach_lets_the_occurrence_run(make_test_app: AppFactory) -> None:
    app = make_test_app(conf={"zdelay_redis_url": f"redis://127.0.0.1:{free_port()}/0"})
    _start(app, "first", overlap_headers(_schedule("skip", 5)))
