"""A forked Django program behaves as ``python -c`` did (tests/support/django_forks.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tests.support import django_forks

pytestmark = pytest.mark.timeout(120)


def run(program: str, timeout: float = 30, **env: str) -> django_forks.Done:
    return django_forks.run(program, env={**os.environ, **env}, cwd=ROOT, timeout=timeout)


def test_a_program_leaves_what_python_c_leaves() -> None:
    program = "import os, sys\nprint(os.environ['ZDELAY_X'])\nprint('oops', file=sys.stderr)\n"
    program += "raise SystemExit(3)"
    done = run(program, ZDELAY_X="from the environment")
    python_c = subprocess.run(
        [sys.executable, "-c", program],
        env={**os.environ, "ZDELAY_X": "from the environment"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert (done.returncode, done.stdout, done.stderr) == (
        python_c.returncode,
        python_c.stdout,
        python_c.stderr,
    )
    failed = run("1 / 0")
    assert failed.returncode == 1
    assert "ZeroDivisionError" in failed.stderr


def test_each_program_starts_from_the_server_not_from_the_last_program() -> None:
    run("import os, django.conf\nos.environ['ZDELAY_LEAK'] = '1'\ndjango.conf.LEAK = 1")
    done = run(
        "import os, django.conf\nprint(os.environ.get('ZDELAY_LEAK'), hasattr(django.conf, 'LEAK'))"
    )
    assert done.stdout.split() == ["None", "False"]


def test_a_program_over_its_timeout_is_killed_and_the_next_one_runs() -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        run("import time\ntime.sleep(60)", timeout=1)
    assert run("print('next')").stdout == "next\n"


def test_two_lines_that_arrive_together_are_both_read() -> None:
    # A quick program's pid and status reach the pipe at once
    read, write = os.pipe()
    try:
        os.write(write, b'{"pid": 7}\n{"status": 3}\n')
        lines = django_forks.Lines(read)
        assert [lines.next(timeout=2), lines.next(timeout=2)] == [b'{"pid": 7}', b'{"status": 3}']
        with pytest.raises(TimeoutError):
            lines.next(timeout=0.1)
        os.close(write)
        write = -1
        with pytest.raises(EOFError):
            lines.next(timeout=2)
    finally:
        os.close(read)
        if write != -1:
            os.close(write)
