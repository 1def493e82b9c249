"""Teardown leaves no process behind, even when the test's timeout cuts it short."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from types import FrameType, SimpleNamespace
from typing import cast

import pytest

from tests.conftest import AppFactory
from tests.helpers import CeleryProcess, start_worker, stop_all

#: A process that ignores SIGTERM, as a worker finishing a long task does.
STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(60)"
)


class Interrupted(Exception):
    """Raised by the alarm, as pytest-timeout's signal method raises its Failed."""


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise Interrupted


@pytest.mark.timeout(30)
def test_a_teardown_cut_short_by_the_timeout_still_kills_what_it_started() -> None:
    # Given a started process that ignores SIGTERM, in a group of its own
    process = subprocess.Popen(
        [sys.executable, "-c", STUBBORN], start_new_session=True, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    assert process.stdout.readline() == "ready\n"  # SIGTERM is ignored from here on
    log = Path(tempfile.mkstemp(prefix="zdelay-test-", suffix=".log")[1])
    stubborn = cast(CeleryProcess, SimpleNamespace(process=process, log_path=log))
    previous = signal.signal(signal.SIGALRM, _interrupt)
    try:
        # When the test's timeout fires while teardown waits out the grace
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(Interrupted):
            stop_all([stubborn])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        log.unlink(missing_ok=True)
    # Then the process is gone all the same (left running, it failed the
    # next test on the same xdist worker with a "still running" warning)
    try:
        assert process.poll() is not None
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()


@pytest.mark.timeout(60)
def test_a_worker_not_ready_when_its_wait_is_cut_short_is_killed(
    make_test_app: AppFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a worker being started, which no fixture knows of until it is ready
    app = make_test_app()
    started: list[CeleryProcess] = []
    start = CeleryProcess.start

    def noted(self: CeleryProcess) -> CeleryProcess:
        started.append(self)
        return start(self)

    monkeypatch.setattr(CeleryProcess, "start", noted)
    previous = signal.signal(signal.SIGALRM, _interrupt)
    try:
        # When its wait for " ready." ends first (the test's timeout, or the
        # wait's own: a worker starts in a second at best, not in 0.3 s)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(Interrupted):
            start_worker(app)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    # Then the worker is gone (it ran on through the rest of the session)
    (worker,) = started
    assert worker.process is not None
    try:
        assert worker.process.poll() is not None
    finally:
        worker.kill()
