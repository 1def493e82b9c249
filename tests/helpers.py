"""Test helpers: bounded polling, Celery subprocesses, recorded task runs."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import pytest
import redis
from celery import Celery

from tests.project import RUNS_KEY, app_env

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def unavailable(skip: str, *, in_ci: str | None = None) -> NoReturn:
    """A server or tool a test needs is missing: fail in CI (``CI=true``), skip elsewhere.

    A local run without RabbitMQ or PostgreSQL still runs the rest; CI must
    not pass without them. *in_ci* is the failure's text (default: *skip*).
    """
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(in_ci or skip)
    pytest.skip(skip)


def wait_for(
    condition: Callable[[], T],
    *,
    timeout: float = 20.0,
    interval: float = 0.02,
    message: str | Callable[[], str] = "condition",
) -> T:
    """Poll *condition* until it returns a true value; fail after *timeout* seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            text = message() if callable(message) else message
            raise AssertionError(f"timed out after {timeout:g}s waiting for {text}")
        time.sleep(interval)


class Runs:
    """The runs the recording tasks appended to Redis.

    The list only grows during a test, so it is read incrementally: waiting
    for 20,000 runs must not re-read and re-parse the whole list every poll,
    which would take CPU and Redis time from the workers being waited for.
    """

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._runs: list[dict[str, Any]] = []
        self._ids: set[str] = set()

    def all(self) -> list[dict[str, Any]]:
        new = self.client.lrange(RUNS_KEY, len(self._runs), -1)
        for raw in new:
            run = json.loads(raw)
            self._runs.append(run)
            self._ids.add(run["id"])
        return list(self._runs)

    def ids(self) -> list[str]:
        return [run["id"] for run in self.all()]

    def by_id(self) -> dict[str, dict[str, Any]]:
        return {run["id"]: run for run in self.all()}

    def count(self) -> int:
        return int(self.client.llen(RUNS_KEY))

    def wait_for_count(self, n: int, *, timeout: float = 30.0) -> list[dict[str, Any]]:
        wait_for(
            lambda: self.count() >= n,
            timeout=timeout,
            message=lambda: f"{n} task runs (have {self.count()})",
        )
        return self.all()

    def wait_for_ids(self, expected: set[str], *, stall_timeout: float = 30.0) -> list[str]:
        """Wait until every id in *expected* ran (duplicates do not count).

        Fails once no further id of *expected* has run for *stall_timeout*
        seconds: a large batch on a slow machine gets the time it needs, and
        a lost task fails the test as soon as the others have run. (The
        test's own timeout bounds the whole wait.)
        """
        self.all()
        left = len(expected - self._ids)
        progressed = time.monotonic()

        def all_ran() -> bool:
            nonlocal left, progressed
            self.all()
            missing = len(expected - self._ids)
            if missing < left:
                left, progressed = missing, time.monotonic()
            elif missing and time.monotonic() - progressed > stall_timeout:
                raise AssertionError(
                    f"{missing} of {len(expected)} ids did not run, "
                    f"and none ran in the last {stall_timeout:g}s"
                )
            return not missing

        wait_for(all_ran, timeout=math.inf)
        return self.ids()

    def duplicates(self) -> dict[str, int]:
        return {i: c for i, c in Counter(self.ids()).items() if c > 1}


_Process = TypeVar("_Process", bound="CeleryProcess")


class CeleryProcess:
    """``celery -A tests.project.worker_app <args>`` as a subprocess, logging to a file."""

    #: The ``-A`` of the command: the module of the Celery app it runs.
    app_module = "tests.project.worker_app"

    def __init__(self, app: Celery, *args: str, env: dict[str, str] | None = None) -> None:
        self.args = list(args)
        self.log_path = Path(tempfile.mkstemp(prefix="zdelay-test-", suffix=".log")[1])
        self.env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1",
            # The pickle tests accept pickle; CI runs as root.
            "C_FORCE_ROOT": "1",
            **app_env(app),
            **(env or {}),
        }
        self.process: subprocess.Popen[bytes] | None = None

    def start(self: _Process) -> _Process:
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", self.app_module, *self.args],
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                # A group of its own: teardown can kill a prefork worker's
                # pool processes with it (stop_all).
                start_new_session=True,
            )
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text: str, *, timeout: float = 30.0) -> None:
        def seen() -> bool:
            if self.process is not None and self.process.poll() is not None:
                raise AssertionError(f"process exited early:\n{self.log()[-3000:]}")
            return text in self.log()

        wait_for(seen, timeout=timeout, message=lambda: f"{text!r} in log:\n{self.log()[-3000:]}")

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def kill(self) -> None:
        """SIGKILL: no cleanup at all, as a crash or an OOM kill."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def terminate(self, *, timeout: float = 20.0, resend_after: float | None = None) -> int:
        """SIGTERM and wait; return the exit code.

        With *resend_after*, a second SIGTERM goes that many seconds after
        the first if the process still runs: as an operator's second
        ``kill`` would, for ``celery beat``, whose handler raises
        ``SystemExit`` wherever the main thread is, and a finalizer
        (``__del__``) that it lands in swallows it ("Exception ignored"):
        beat then runs on (seen under load).
        """
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            if resend_after is not None:
                try:
                    return self.process.wait(timeout=resend_after)
                except subprocess.TimeoutExpired:
                    self.process.send_signal(signal.SIGTERM)
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
            said = _tail_from_traceback(self.log())
            raise AssertionError(f"did not stop on SIGTERM:\n{said}") from None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.log_path.unlink(missing_ok=True)


def _tail_from_traceback(log: str, limit: int = 8000) -> str:
    """The end of *log*, from its first traceback when it has one (a process
    that printed one and then hung: the traceback's head says why)."""
    start = log.find("Traceback (most recent call last)")
    text = log[start:] if start >= 0 else log
    if len(text) <= limit:
        return text
    return text[: limit // 2] + "\n[...]\n" + text[-limit // 2 :]


#: At teardown, how long SIGTERMed processes get to exit before SIGKILL: the
#: test is over, so a warm shutdown that waits for a long task proves nothing.
TEARDOWN_GRACE = 5.0


def stop_all(processes: list[CeleryProcess]) -> None:
    """Stop *processes* together: SIGTERM to each, one shared grace, then SIGKILL.

    One after the other, a worker finishing a long task and a companion
    finishing its batch cost a test up to 15 s each in teardown.
    """
    running = [p for p in processes if p.process is not None and p.process.poll() is None]
    try:
        for each in running:
            assert each.process is not None
            each.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + TEARDOWN_GRACE
        for each in running:
            assert each.process is not None
            try:
                each.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(each)
    except BaseException:
        # Interrupted (the test's timeout fired during teardown, on a loaded
        # machine): none may outlive its test, or the next test on this
        # xdist worker fails on its "still running" ResourceWarning.
        for each in running:
            _kill_group(each)
        raise
    for each in processes:
        each.log_path.unlink(missing_ok=True)


def _kill_group(each: CeleryProcess) -> None:
    """SIGKILL *each*'s process group and reap its leader."""
    assert each.process is not None
    if each.process.poll() is not None:
        return  # reaped: its group id may be another's by now
    # Its leader still runs, so the group is its own: the worker's pool
    # processes go with it.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(each.process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        each.process.wait(timeout=10)


def start_worker(
    app: Celery, *queues: str, env: dict[str, str] | None = None, pool: str = "solo"
) -> CeleryProcess:
    """Start a worker consuming *queues* (default: the app's default queue).

    Solo by default; ``pool="prefork"`` runs one pool process beside the
    main one (what ``revoke(terminate=True)`` and a lost pool process need).
    """
    args = [
        "worker",
        "-P",
        pool,
        *(["-c", "1"] if pool == "prefork" else []),
        "-l",
        "INFO",
        "-n",
        f"w{uuid.uuid4().hex[:8]}@%h",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]
    if queues:
        args += ["-Q", ",".join(queues)]
    worker = CeleryProcess(app, *args, env=env).start()
    with _stopped_on_failure(worker):
        worker.wait_for_log(" ready.")
    return worker


def start_companion(app: Celery, *args: str, env: dict[str, str] | None = None) -> CeleryProcess:
    """Start ``celery zdelay`` and wait for its start-up line."""
    companion = CeleryProcess(app, "zdelay", "-l", "DEBUG", *args, env=env).start()
    with _stopped_on_failure(companion):
        companion.wait_for_log("companion")
        companion.wait_for_log(" started: ")
    return companion


@contextlib.contextmanager
def _stopped_on_failure(process: CeleryProcess) -> Iterator[None]:
    """Kill *process* (its group) when waiting for it to start fails.

    No fixture knows of it yet: a worker that was not ready in time ran on
    past its test, and through the rest of the session (seen: two workers
    still busy 20 minutes after the test that started them failed).
    """
    try:
        yield
    except BaseException:
        _kill_group(process)
        raise
