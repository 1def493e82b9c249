"""The demo (``make demo``) passes only when its story holds.

It runs the shop end to end, a real worker and companion on a private
Redis, and its exit status is what CI and a reader trust: 0 only when no
cancel task ran early, no paid order was cancelled, every order ended as
planned and the periodic clean-up ran.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.timeout(240)

#: Parks every cancel task 400 ms before its window closes, in the demo's
#: own process (the producer), as a broken due time would.
EARLY_CANCELS = """
import datetime, sys
from example_project import demo
story = demo.run_story
def run_story_with_early_cancels(**options):
    from example_project.shop import orders
    parked = orders.cancel_unpaid.apply_delayed_on_commit
    def early(args, *, eta, **options):
        return parked(args, eta=eta - datetime.timedelta(milliseconds=400), **options)
    orders.cancel_unpaid.apply_delayed_on_commit = early
    return story(**options)
demo.run_story = run_story_with_early_cancels
sys.exit(demo.main())
"""

#: A ``sitecustomize`` for the worker the demo starts: each cancel task finds
#: its order pending again, as a cancel task that no longer looked at the
#: order would. The "last second" order, paid while its task stays parked,
#: is then cancelled.
REOPEN_BEFORE_CANCEL = """
import sys
if "worker" in sys.argv:
    from celery.signals import task_prerun

    def reopen(sender=None, args=None, **_):
        if getattr(sender, "name", "") == "shop.cancel_unpaid":
            from example_project.shop.models import Order
            Order.objects.filter(pk=args[0]).update(status=Order.Status.PENDING)

    task_prerun.connect(reopen, weak=False)
"""


def _demo(*, code: str | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    command = ["-c", code] if code else ["-m", "example_project.demo"]
    environment = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    return subprocess.run(
        [sys.executable, *command],
        check=False,
        cwd=ROOT,
        env={**environment, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=200,
    )


def test_the_demo_tells_its_story_and_exits_0() -> None:
    done = _demo()
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-3000:]
    assert "orders in the expected state                12" in done.stdout
    assert "FAILED" not in done.stdout


def test_what_the_demo_prints_to_try_next_works_after_it_exits() -> None:
    """The old demo printed log names in a directory it had deleted, a bare
    ``python`` that is not the clone's .venv, and commands for a Redis that
    was gone; "3 runs" listed were the last 3 of more, unlabelled."""
    done = _demo(SHOP_SWEEP_SECONDS="0.5")
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-3000:]
    logs = re.findall(r"\(log: (\S+)\)", done.stdout)
    assert len(logs) == 2
    for log in logs:
        assert Path(log).is_file(), log
        assert Path(log).stat().st_size > 0, log
    for command in re.findall(r"^\s+(\S+) -m django ", done.stdout, re.MULTILINE):
        assert (ROOT / command).is_file() or Path(command).is_file(), command
    assert "private Redis and its SQLite database are gone" in done.stdout
    runs = int(re.search(r"no celery beat\): (\d+) runs", done.stdout)[1])
    if runs > 3:
        assert f"the last 3 of {runs} runs:" in done.stdout


def test_the_demo_fails_when_the_periodic_clean_up_never_runs() -> None:
    """Old demo exited 0 here: it printed "0 runs" and carried on."""
    done = _demo(SHOP_SWEEP_SECONDS="3600")
    assert done.returncode == 1, done.stdout[-5000:]
    assert "FAILED: the periodic clean-up never ran" in done.stdout


def test_the_demo_fails_when_a_cancel_task_runs_early() -> None:
    """Old demo exited 0 here when the orders still ended as planned: it
    counted early cancels but never failed on them."""
    done = _demo(code=EARLY_CANCELS)
    assert done.returncode == 1, done.stdout[-5000:]
    assert "cancel task(s) ran before the window closed" in done.stdout


def test_the_demo_fails_when_a_paid_order_is_cancelled(tmp_path: Path) -> None:
    """The story's own check, not the count of orders in the expected state,
    names the paid order that was cancelled."""
    (tmp_path / "sitecustomize.py").write_text(REOPEN_BEFORE_CANCEL)
    done = _demo(PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    assert done.returncode == 1, done.stdout[-5000:]
    assert "FAILED: order(s) paid in their window were cancelled" in done.stdout
