"""The shop's story end to end: ``python -m example_project.demo`` (``make demo``).

Starts a Celery worker and the celery-zdelay companion, places orders whose
payment window is a few seconds instead of 30 minutes, pays some of them,
and prints what happened to each: paid (its parked cancel task removed),
cancelled automatically when the window closed (and how late the cancel
ran), or paid in the very last second (the cancel task ran anyway, looked
at the order again and left it alone).

Uses ``REDIS_URL`` when set, else a private Redis it starts and stops; the
SQLite database lives in a temporary directory; the worker's and companion's
logs stay in ``.zdelay-demo/`` of the clone. ``SHOP_PAYMENT_WINDOW_SECONDS``
sets the window (default here: 3). The companion also serves the shop's
periodic clean-up (``CELERY_BEAT_SCHEDULE``, no celery beat): every
``SHOP_SWEEP_SECONDS`` (default here: 1; hourly in production).

It exits 0 only when the story holds: no cancel task ran before its window
closed, no order paid within its window was cancelled, every order ended as
planned, and the periodic clean-up ran at least once. Its own timeline has
margin for a loaded machine (payments land at least half a second before a
window closes; the late payment waits for the cancel); should the demo
itself still fall behind, it says so instead of blaming the shop.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: Orders placed, one every PLACE_EVERY seconds.
ORDERS = 12
PLACE_EVERY = 0.1
#: The "last second" payment lands this long before the window closes: in
#: its last second, with room for a loaded machine to run the demo late.
LAST_SECOND_MARGIN = 0.5
#: Seconds to wait for the worker and companion to start, and for the story to end.
START_TIMEOUT = 60.0
END_TIMEOUT = 60.0
#: Where the shop serves the celery-zdelay dashboard (example_project/urls.py).
DASHBOARD_URL = "http://127.0.0.1:8000/admin/zdelay/"
#: Where the worker's and companion's logs stay after the demo exits.
LOG_DIR = ROOT / ".zdelay-demo"


def python_command() -> str:
    """The interpreter running the demo, as a user would type it from the clone."""
    executable = Path(sys.executable)
    with contextlib.suppress(ValueError):
        return str(executable.relative_to(ROOT))
    return str(executable)


def dashboard_hint(own_redis: bool) -> str:
    """How to see the dashboard; the private Redis and database are gone by then."""
    python = python_command()
    redis_note = (
        "  The demo's private Redis and its SQLite database are gone now that it has\n"
        "  exited: set REDIS_URL (e.g. redis://127.0.0.1:6379/0) to run it on a Redis\n"
        "  that keeps what the companion serves, and to use the commands below.\n"
        if own_redis
        else ""
    )
    return (
        f"\nDashboard of what is parked, for staff users: {DASHBOARD_URL}\n"
        f"{redis_note}"
        "  Serve the shop to see it (REDIS_URL names the Redis it reads):\n"
        "    export DJANGO_SETTINGS_MODULE=example_project.settings\n"
        f"    {python} -m django migrate && {python} -m django createsuperuser\n"
        f"    {python} -m django runserver 127.0.0.1:8000"
    )


@contextlib.contextmanager
def redis_url() -> Iterator[str]:
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    from celery_zdelay.testing import RedisServer

    with RedisServer() as server:
        print(f"Started a private Redis at {server.url} (set REDIS_URL to use yours)")
        yield f"{server.url}/0"


def start(role: str, *args: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    print(f"Starting the {role}: celery -A example_project {' '.join(args)}  (log: {log})")
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "example_project", *args],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def main() -> int:
    own_redis = not os.environ.get("REDIS_URL")
    with redis_url() as url, tempfile.TemporaryDirectory(prefix="zdelay-shop-") as tmp:
        os.environ.update(
            REDIS_URL=url,
            SHOP_DATABASE=str(Path(tmp) / "shop.sqlite3"),
            DJANGO_SETTINGS_MODULE="example_project.settings",
        )
        os.environ.setdefault("SHOP_PAYMENT_WINDOW_SECONDS", "3")
        os.environ.setdefault("SHOP_SWEEP_SECONDS", "1")
        import django
        from django.core.management import call_command

        django.setup()
        call_command("migrate", verbosity=0)
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
        LOG_DIR.mkdir(exist_ok=True)
        logs = {"worker": LOG_DIR / "worker.log", "companion": LOG_DIR / "companion.log"}
        processes = [
            start(
                "worker",
                "worker",
                "-P",
                "solo",
                "-l",
                "WARNING",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                env=env,
                log=logs["worker"],
            ),
            start("companion", "zdelay", "-l", "INFO", env=env, log=logs["companion"]),
        ]
        status = 1
        try:
            wait_until_ready(logs["companion"])
            status = run_story(own_redis=own_redis)
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait(timeout=30)
            if status:
                for role, log in logs.items():
                    print(f"\n--- {role} log ---\n{log.read_text(errors='replace')[-3000:]}")
        return status


def wait_until_ready(companion_log: Path) -> None:
    """Wait for the worker to answer a ping and for the companion's heartbeat."""
    from celery_zdelay.parking import store_for
    from celery_zdelay.store.redis_keys import companions_key
    from example_project import celery_app

    deadline = time.monotonic() + START_TIMEOUT
    while not celery_app.control.ping(timeout=0.5):
        if time.monotonic() > deadline:
            raise SystemExit(f"The worker did not start within {START_TIMEOUT:g} s")
    store = store_for(celery_app)
    while not store.client.hlen(companions_key(store.config.key_prefix)):
        if time.monotonic() > deadline:
            raise SystemExit(f"The companion did not start within {START_TIMEOUT:g} s")
        time.sleep(0.05)
    for line in companion_log.read_text().splitlines():
        if " started: " in line:
            print("Companion:", line.split("] ", 1)[-1])


@dataclass
class Plan:
    """What the demo does to one order, and when (seconds after it was placed)."""

    kind: str  # "unpaid", "paid", "last second", "too late"
    pay_after: float | None = None


def plans(window: float) -> list[Plan]:
    """The story: some orders paid in time, one in the last second, one too late."""
    rng = random.Random(7)
    story = [Plan("unpaid") for _ in range(ORDERS)]
    for index in (0, 3, 5, 8, 10):
        story[index] = Plan("paid", rng.uniform(0.2, window * 0.5))
    story[6] = Plan("last second", max(0.0, window - LAST_SECOND_MARGIN))
    # Tried once the window has closed and the cancel task has run.
    story[9] = Plan("too late", window)
    return story


def run_story(*, own_redis: bool) -> int:
    from django.conf import settings
    from django.utils import timezone

    from example_project.shop.models import Order
    from example_project.shop.orders import OrderClosed, pay_order

    window = settings.SHOP_PAYMENT_WINDOW.total_seconds()
    story = plans(window)
    print(f"\nPayment window: {window:g} s (SHOP_PAYMENT_WINDOW_SECONDS; 1800 in production)")

    started = time.monotonic()
    actions: list[tuple[float, Callable[[], None]]] = []
    orders: list[Order] = []
    notes: dict[int, str] = {}
    #: Payments the story meant to land in the window that the demo, running
    #: late, made after it closed: pk -> ms after the window.
    demo_late: dict[int, float] = {}

    def pay(order: Order, kind: str) -> None:
        if kind == "too late":
            # The customer comes back after the cancel task ran: waiting for
            # it (not for a fixed time) keeps the story true however late it runs.
            deadline = time.monotonic() + END_TIMEOUT
            while Order.objects.filter(pk=order.pk, cancel_checked_at=None).exists():
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        now = timezone.now()
        at = f"{(now - order.created_at).total_seconds():.2f} s after it was placed"
        if kind != "too late" and now >= order.pay_by:
            demo_late[order.pk] = (now - order.pay_by).total_seconds() * 1000
        if kind == "last second":
            # The payment provider's webhook lands just as the window closes
            # and records the payment without reaching the parked task (as a
            # payment racing a cancel task that was already released would):
            # the task must look at the order before cancelling it.
            Order.objects.filter(pk=order.pk, status=Order.Status.PENDING).update(
                status=Order.Status.PAID, paid_at=timezone.now()
            )
            notes[order.pk] = f"paid {at}, parked task left in place: it re-checked"
            return
        try:
            payment = pay_order(order.pk)
        except OrderClosed as exc:
            notes[order.pk] = f"payment {at} refused: {exc}"
            return
        removed = "removed" if payment.cancel_task_removed else "already released"
        notes[order.pk] = f"paid {at}, parked cancel task {removed}"

    print(f"Placing {ORDERS} orders, {PLACE_EVERY:g} s apart, and paying some of them...")
    for index, plan in enumerate(story):
        place_at = index * PLACE_EVERY
        actions.append((place_at, _place(orders)))
        if plan.pay_after is not None:
            actions.append((place_at + plan.pay_after, _pay_later(orders, index, plan.kind, pay)))
    actions.sort(key=lambda action: action[0])
    for at, action in actions:
        # The customers' timeline: each action waits for its moment.
        time.sleep(max(0.0, at - (time.monotonic() - started)))
        action()

    expected_checks = [o.pk for o, p in zip(orders, story, strict=True) if p.kind != "paid"]
    deadline = time.monotonic() + END_TIMEOUT
    while Order.objects.filter(pk__in=expected_checks, cancel_checked_at=None).exists():
        if time.monotonic() > deadline:
            print(f"Gave up waiting after {END_TIMEOUT:g} s for the cancel tasks to run")
            break
        time.sleep(0.1)
    return report(orders, story, notes, started, demo_late, own_redis=own_redis)


def _place(orders: list[Any]) -> Callable[[], None]:
    from example_project.shop.orders import place_order

    return lambda: orders.append(place_order(f"customer-{len(orders) + 1}", 4200))


def _pay_later(
    orders: list[Any], index: int, kind: str, pay: Callable[[Any, str], None]
) -> Callable[[], None]:
    return lambda: pay(orders[index], kind)


def report(
    orders: list[Any],
    story: list[Plan],
    notes: dict[int, str],
    started: float,
    demo_late: dict[int, float],
    *,
    own_redis: bool,
) -> int:
    from example_project.shop.models import Order

    print()
    print(f"{'order':<7}{'planned':<13}{'final state':<13}{'cancel task ran':<18}what happened")
    lateness_ms: list[float] = []
    correct = 0
    paid_then_cancelled: set[int] = set()
    for order, plan in zip(orders, story, strict=True):
        order.refresh_from_db()
        ran = "-"
        if order.cancel_checked_at is not None:
            late = (order.cancel_checked_at - order.pay_by).total_seconds() * 1000
            lateness_ms.append(late)
            ran = f"{late:+.0f} ms"
        expected = Order.Status.PAID if plan.kind in ("paid", "last second") else "cancelled"
        correct += order.status == expected
        # Paid (in time, by the demo's own clock) yet cancelled in the end.
        if order.status == Order.Status.CANCELLED and (
            order.paid_at is not None
            or (plan.kind in ("paid", "last second") and order.pk not in demo_late)
        ):
            paid_then_cancelled.add(order.pk)
        note = notes.get(order.pk, "never paid")
        if order.status == Order.Status.CANCELLED and plan.kind == "unpaid":
            note = "cancelled automatically when its window closed"
        print(f"{order.pk:<7}{plan.kind:<13}{order.status:<13}{ran:<18}{note}")

    counts = {status: sum(o.status == status for o in orders) for status in Order.Status}
    print()
    print(f"{'orders placed':<40}{len(orders):>6}")
    print(f"{'paid':<40}{counts[Order.Status.PAID]:>6}")
    print(f"{'cancelled automatically':<40}{counts[Order.Status.CANCELLED]:>6}")
    print(f"{'orders in the expected state':<40}{correct:>6}")
    if lateness_ms:
        lateness_ms.sort()
        early = sum(1 for ms in lateness_ms if ms < 0)
        print(f"{'cancel tasks run':<40}{len(lateness_ms):>6}")
        print(f"{'  of them before the window closed':<40}{early:>6}")
        print(f"{'  lateness median (ms)':<40}{lateness_ms[len(lateness_ms) // 2]:>6.0f}")
        print(f"{'  lateness max (ms)':<40}{lateness_ms[-1]:>6.0f}")
    print(
        "(lateness: when the worker started the cancel task minus the end of the "
        "payment window, on this machine's clock)"
    )
    print(f"The story took {time.monotonic() - started:.1f} s.")
    sweeps = report_sweeps()
    print(dashboard_hint(own_redis))

    failures = []
    early = [ms for ms in lateness_ms if ms < 0]
    if early:
        failures.append(
            f"{len(early)} cancel task(s) ran before the window closed, "
            f"by up to {-min(early):.0f} ms"
        )
    if paid_then_cancelled:
        failures.append(
            f"order(s) paid in their window were cancelled: {sorted(paid_then_cancelled)}"
        )
    if correct != len(orders):
        failures.append(f"{len(orders) - correct} order(s) not in the expected state")
    if not sweeps:
        failures.append("the periodic clean-up never ran")
    if demo_late:
        late = ", ".join(f"order {pk}: +{ms:.0f} ms" for pk, ms in sorted(demo_late.items()))
        failures.append(
            "the demo itself fell behind its timeline (the machine is busy): payments "
            f"meant for the window landed after it closed ({late}); run it again"
        )
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


def report_sweeps() -> int:
    """Print the runs of the periodic clean-up the companion served; return how many."""
    from django.conf import settings

    from example_project.shop.models import Sweep

    sweeps = list(Sweep.objects.order_by("ran_at"))
    print(
        f"\nPeriodic clean-up shop-sweep, every {settings.SHOP_SWEEP_SECONDS:g} s, served by "
        f"the companion (no celery beat): {len(sweeps)} runs"
    )
    if len(sweeps) > 3:
        print(f"  the last 3 of {len(sweeps)} runs:")
    for sweep in sweeps[-3:]:
        print(f"  {sweep.task_id}  ran {sweep.ran_at:%H:%M:%S.%f}"[:-3])
    print(
        f"  ({python_command()} -m celery -A example_project zdelay periodic list shows its "
        "next run, on a Redis that is still there: see REDIS_URL below)"
    )
    return len(sweeps)


if __name__ == "__main__":
    sys.exit(main())
