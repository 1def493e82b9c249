"""Django programs run in processes forked from one that imported Django already.

The tests write to django-celery-beat's tables from a process of their own,
as the admin would (``tests/support/django_beat.py``'s ``django_run``). A
new interpreter that imports Django, Celery and a database driver spends
about 0.5 s of CPU before the first line of the program runs; the suite runs
a few hundred of them. Here one server process per test process imports
those libraries once (nothing that reads Django's settings, so each program
still chooses its own), and every program runs in a child forked from it:
a process of its own, with its own environment, settings, connections,
stdout, stderr and exit status, as ``python -c`` gave it, for about a fifth
of the CPU.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Done", "Lines", "run"]

#: The server: reads one request per line, forks a child for each, and
#: answers with the child's pid and then its exit status.
SERVER = """
import json, os, sys, traceback
# Libraries only: importing them reads no settings (django.setup() does).
import django, django.db.models, django.forms, django.contrib.admin.options
import django.db.backends.sqlite3.base, django.db.backends.postgresql.base
import celery, celery.schedules, kombu

def child(request):
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[:0] = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_TRUNC), fd)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    status = 0
    try:
        exec(compile(request["program"], "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(request)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), flush=True)
"""


@dataclass(frozen=True)
class Done:
    """What a program left: as :class:`subprocess.CompletedProcess` has it."""

    returncode: int
    stdout: str
    stderr: str


class Lines:
    """The lines written to a pipe, each waited for with a timeout.

    Read from the file descriptor itself: a buffered ``readline`` after a
    ``select`` can take two lines off the pipe at once, and the next
    ``select`` then waits for the second in vain (the pid and the status of
    a quick program come together).
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._pending = b""

    def next(self, timeout: float) -> bytes:
        """The next line; TimeoutError after *timeout* s, EOFError once the writer closed."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError
            chunk = os.read(self.fd, 65536)
            if not chunk:
                raise EOFError("the Django program server exited")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line


class _Server:
    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        self._lines = Lines(self.process.stdout.fileno())

    def alive(self) -> bool:
        return self.process.poll() is None

    def answer(self, timeout: float) -> dict[str, int]:
        answer: dict[str, int] = json.loads(self._lines.next(timeout))
        return answer

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def close(self) -> None:
        if self.alive():
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


_lock = threading.Lock()
#: This test process's server, once started (restarted if it died).
_servers: list[_Server] = []


def _server() -> _Server:
    if not _servers or not _servers[-1].alive():
        server = _Server()
        atexit.register(server.close)
        _servers.append(server)
    return _servers[-1]


def run(program: str, *, env: dict[str, str], cwd: Path, timeout: float) -> Done:
    """Run *program* (Python source) as ``python -c`` would, in a forked child.

    Raises :class:`subprocess.TimeoutExpired` after *timeout* seconds, the
    child killed, as :func:`subprocess.run` does.
    """
    with _lock, tempfile.TemporaryDirectory(prefix="zdelay-django-") as folder:
        server = _server()
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        out.touch()
        err.touch()
        request = {
            "program": program,
            "env": env,
            "cwd": str(cwd),
            "stdout": str(out),
            "stderr": str(err),
        }
        pid: int | None = None
        try:
            assert server.process.stdin is not None
            server.process.stdin.write(json.dumps(request) + "\n")
            server.process.stdin.flush()
            # The server's interpreter may still be importing (its first request).
            pid = server.answer(timeout=timeout + 60)["pid"]
            status = server.answer(timeout=timeout)["status"]
        except BaseException as exc:
            # Timed out, or interrupted (the test's own timeout): the answers
            # still due would be read as the next request's. The child and
            # the server go; the next call starts another server.
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            server.kill()
            if isinstance(exc, TimeoutError):
                raise subprocess.TimeoutExpired(program, timeout) from None
            raise
        return Done(status, out.read_text(errors="replace"), err.read_text(errors="replace"))
