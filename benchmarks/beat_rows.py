"""django-celery-beat rows at scale, served by two companions: ``python -m benchmarks.beat_rows``.

``python -m benchmarks.beat_rows [--rows 100000] [--probes 50] [--db sqlite|postgres]
[--window 60] [--daily interval|crontab] [--out FILE]``: issue 34's
"100,000 periodic schedules ... as django-celery-beat rows served by two
companions". On a private Redis
(broker and store) and a migrated django-celery-beat database (the test
project's settings, ``tests/beat_project``):

- ``--rows`` rows of ``bench.tick``: ``--probes`` of them every 5 s (the
  ticks timed), the others every day (an interval, or with ``--daily
  crontab`` the crontab ``0 3 * * *``; stored, planned, none due in the run),
  created with ``bulk_create`` and one ``PeriodicTasks.update_changed()``;
- two ``celery -A benchmarks.proj zdelay --beat -S django`` and a worker
  (threads, 8) start: how long until every row is stored in Redis and until
  the first tick runs (the first pass plans every schedule's first
  occurrence before), and how many of the probes' ticks ran meanwhile;
- then ``--window`` seconds of steady serving: each probe tick's lateness
  (the worker's start on the Redis clock minus the occurrence's time, which
  its id names), ticks missing or doubled, each companion's CPU and RSS,
  Redis's memory, and the slowest answer to a ``PING`` sent every 10 ms
  (what one script holding Redis costs every other client);
- an edit of one daily row in the database (its interval made 5 s): how long
  until its first tick runs, the slowest ``PING`` meanwhile (every
  companion reads the rows again and stores the changed configuration:
  ``define.lua`` over every schedule, see docs/performance.rst), and the
  probes' ticks due meanwhile: how many ran, and the latest of them.

The load average is printed with the result.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import redis

from celery_zdelay.store.redis_keys import periodic_keys
from tests.support.django_beat import SETTINGS, django_run, migrated_database

from .common import quantiles
from .infra import (
    CeleryProcess,
    MachineLoad,
    Resources,
    cpu_seconds,
    rss_bytes,
    used_memory,
    wait_for,
)
from .proj import TICKS_KEY, make_app

PROBE_S = 5


@contextlib.contextmanager
def database(kind: str) -> Iterator[str]:
    """A migrated django-celery-beat database: ``sqlite:<path>`` or ``postgres:<name>``."""
    with tempfile.TemporaryDirectory(prefix="zbench-rows-") as tmp:
        made = migrated_database(kind, Path(tmp))
        try:
            yield next(made)
        finally:
            made.close()


def create_rows(spec: str, rows: int, probes: int, daily: str = "interval") -> float:
    """Create the rows (see the module docstring); return the seconds it took.

    *daily*: the other rows' schedule, an interval of a day or the crontab
    ``0 3 * * *`` (each companion builds Celery's schedule object of it).
    """
    started = time.perf_counter()
    django_run(
        spec,
        f"""
        from django_celery_beat.models import (
            CrontabSchedule, IntervalSchedule, PeriodicTask, PeriodicTasks,
        )
        probe, _ = IntervalSchedule.objects.get_or_create(every={PROBE_S}, period="seconds")
        if {daily!r} == "crontab":
            day, _ = CrontabSchedule.objects.get_or_create(minute="0", hour="3", timezone="UTC")
            daily_field = "crontab"
        else:
            day, _ = IntervalSchedule.objects.get_or_create(every=1, period="days")
            daily_field = "interval"
        batch = []
        for i in range({rows}):
            if i < {probes}:
                row = PeriodicTask(name=f"probe-{{i}}", task="bench.tick", interval=probe)
            else:
                row = PeriodicTask(name=f"day-{{i}}", task="bench.tick", **{{daily_field: day}})
            batch.append(row)
            if len(batch) == 5000:
                PeriodicTask.objects.bulk_create(batch)
                batch = []
        PeriodicTask.objects.bulk_create(batch)
        PeriodicTasks.update_changed()
        """,
    )
    return time.perf_counter() - started


def edit_row(spec: str, name: str) -> float:
    """Make row *name* tick every 5 s, as an admin save does; return when (epoch s)."""
    saved: float = django_run(
        spec,
        f"""
        import time
        from django_celery_beat.models import IntervalSchedule, PeriodicTask
        every, _ = IntervalSchedule.objects.get_or_create(every={PROBE_S}, period="seconds")
        row = PeriodicTask.objects.get(name={name!r})
        row.interval, row.crontab = every, None
        row.save()
        print(json.dumps(time.time()))
        """,
    )
    return saved


class PingProbe:
    """PING Redis every 10 ms from a thread: the slowest answers, per span."""

    def __init__(self, url: str) -> None:
        # No socket timeout (redis-py's default is 5 s): a script holding
        # Redis longer is what it measures, not a reason to stop.
        self.client = redis.Redis.from_url(url, socket_timeout=None)
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> PingProbe:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.client.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            sent = time.perf_counter()
            # A script running past Redis's busy threshold (5 s) is answered
            # BUSY: the PING waits until Redis answers it.
            while _busy(self.client.ping):
                time.sleep(0.001)
            self.samples.append((time.monotonic(), (time.perf_counter() - sent) * 1000))
            time.sleep(0.01)

    def slowest(self, since: float, until: float) -> float | None:
        found = [ms for at, ms in self.samples if since <= at <= until]
        return round(max(found), 1) if found else None


def occurrence_ms(task_id: str) -> int:
    """The occurrence time an id names (``periodic:<name>:v<n>:<ISO time>Z``), epoch ms."""
    stamp = task_id.rsplit(":v", 1)[1].split(":", 1)[1]
    return round(datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() * 1000)


def schedule_of(task_id: str) -> str:
    return task_id.split(":", 1)[1].rsplit(":v", 1)[0]


def run_rows(
    rows: int, probes: int, kind: str, window: float, daily: str = "interval"
) -> dict[str, Any]:
    load = MachineLoad()
    result: dict[str, Any] = {
        "rows": rows,
        "probes": probes,
        "daily": daily,
        "db": kind,
        "window_s": window,
    }
    with Resources() as res, database(kind) as spec:
        result["create_rows_s"] = round(create_rows(spec, rows, probes, daily), 1)
        server = res.redis()
        url = f"{server.url}/0"
        record = f"{server.url}/1"
        app = make_app(broker=url, store=url, record=record)
        client = redis.Redis.from_url(url, socket_timeout=None)
        recorder = redis.Redis.from_url(record, socket_timeout=None)
        res.callback(client.close)
        res.callback(recorder.close)
        keys = periodic_keys("zdelay")
        ping = PingProbe(url).start()
        res.callback(ping.stop)
        res.worker(app, pool="threads", concurrency=8)
        env = {"DJANGO_SETTINGS_MODULE": SETTINGS, "ZDELAY_TEST_BEAT_DB": spec}
        started = time.monotonic()
        companions = []
        for _ in range(2):
            process = CeleryProcess(
                app, ["zdelay", "-l", "INFO", "--beat", "-S", "django"], env=env
            )
            res.callback(process.stop)
            process.start()
            companions.append(process)
        for process in companions:
            process.wait_for_log(" started: ", timeout=120)
        wait_for(
            lambda: not _busy(lambda: int(client.hlen(keys.defs)) >= rows),
            timeout=900,
            what="rows stored",
        )
        result["stored_after_s"] = round(time.monotonic() - started, 1)
        # The first pass plans every schedule's first occurrence; ticks resume after it.
        wait_for(lambda: recorder.llen(TICKS_KEY) > 0, timeout=1800, what="a first tick")
        result["first_tick_after_s"] = round(time.monotonic() - started, 1)
        # Then the probes' ticks missed meanwhile, run once each (zdelay_missed="once").
        time.sleep(2 * PROBE_S)
        result["ticks_at_start"] = {
            "ran": int(recorder.llen(TICKS_KEY)),
            "due_about": probes * int((time.monotonic() - started) / PROBE_S),
        }
        result["ping_slowest_ms_start"] = ping.slowest(started, time.monotonic())

        # Steady serving: the probes' ticks over the window.
        recorder.delete(TICKS_KEY)
        cpu0 = [cpu_seconds(p.pid) for p in companions]
        window_start_ms = _redis_ms(client)
        steady_from = time.monotonic()
        time.sleep(window)
        steady_until = time.monotonic()
        window_end_ms = _redis_ms(client)
        cpu1 = [cpu_seconds(p.pid) for p in companions]
        # Ticks due in the window started by now, but for the last few seconds'.
        time.sleep(3)
        ticks = [json.loads(raw) for raw in recorder.lrange(TICKS_KEY, 0, -1)]
        due = [(tid, occurrence_ms(tid), started_ms) for tid, started_ms in ticks]
        timed = [(tid, at, st) for tid, at, st in due if window_start_ms <= at <= window_end_ms]
        lateness = [st - at for _, at, st in timed]
        per_probe = Counter(schedule_of(tid) for tid, _, _ in timed)
        doubled = sum(n - 1 for n in Counter(tid for tid, _, _ in timed).values() if n > 1)
        expected = probes * int((window_end_ms - window_start_ms) / 1000 / PROBE_S)
        result["steady"] = {
            "ticks": len(timed),
            "ticks_expected_about": expected,
            "probes_ticking": len(per_probe),
            "doubled": doubled,
            "early": sum(1 for x in lateness if x < 0),
            "lateness_ms": quantiles([float(x) for x in lateness]) if lateness else None,
            "companion_cpu_pct": [
                round((b - a) / (steady_until - steady_from) * 100, 2)
                for a, b in zip(cpu0, cpu1, strict=True)
            ],
            "companion_rss_mib": [round(rss_bytes(p.pid) / 2**20, 1) for p in companions],
            "redis_used_memory_mib": round(used_memory(client) / 2**20, 1),
            "ping_slowest_ms": ping.slowest(steady_from, steady_until),
        }

        # An edit of one daily row: how long until it ticks.
        name = f"day-{rows - 1}"
        edit_from = time.monotonic()
        edit_from_ms = _redis_ms(client)
        saved = edit_row(spec, name)
        found: dict[str, Any] = {}

        def ticked() -> bool:
            for raw in recorder.lrange(TICKS_KEY, 0, -1):
                tid, started_ms = json.loads(raw)
                if schedule_of(tid) == name:
                    found.update(id=tid, started_ms=started_ms)
                    return True
            return False

        wait_for(ticked, timeout=600, what="the edited row's first tick")
        edit_until_ms = _redis_ms(client)
        # The probes' ticks due meanwhile: every companion read all the rows again.
        time.sleep(3)
        during = [
            (tid, occurrence_ms(tid), started_ms)
            for tid, started_ms in (json.loads(r) for r in recorder.lrange(TICKS_KEY, 0, -1))
            if schedule_of(tid) != name
        ]
        during = [(t, at, st) for t, at, st in during if edit_from_ms <= at <= edit_until_ms]
        due_during = probes * int((edit_until_ms - edit_from_ms) / 1000 / PROBE_S)
        result["edit"] = {
            "first_tick_after_save_s": round(found["started_ms"] / 1000 - saved, 2),
            # Where that time went: each companion's store of the edit, the
            # occurrence it parked first (the schedule's next tick after it).
            "stored_after_save_s": [
                _logged_after(p.log(), f"changed: {name}", saved) for p in companions
            ],
            "first_occurrence_after_save_s": round(occurrence_ms(found["id"]) / 1000 - saved, 2),
            "ping_slowest_ms": ping.slowest(edit_from, time.monotonic()),
            "probe_ticks_meanwhile": len(during),
            "probe_ticks_due_about": due_during,
            "probe_lateness_max_ms": max((st - at for _, at, st in during), default=None),
        }
        result["companion_log_tail"] = [p.log()[-600:] for p in companions]
    result["machine"] = load.stop()
    return result


def _busy(call: Callable[[], Any]) -> bool:
    """Run *call*: True when Redis answered BUSY (a script held it past 5 s) or *call* said no."""
    try:
        return not call()
    except redis.exceptions.ResponseError as exc:
        if str(exc).startswith("BUSY"):
            return True
        raise


def _logged_after(log: str, text: str, since: float) -> float | None:
    """Seconds from *since* (epoch) to the first line of *log* with *text* logged after it."""
    for line in log.splitlines():
        if text in line and line.startswith("["):
            # "[2026-12-07 09:16:05,640: INFO/...": the companion's local time.
            at = datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if at >= since:
                return round(at - since, 2)
    return None


def _redis_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.beat_rows")
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--probes", type=int, default=50)
    parser.add_argument("--db", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--window", type=float, default=60.0)
    parser.add_argument(
        "--daily",
        choices=("interval", "crontab"),
        default="interval",
        help="the schedule of the rows that are not probes: every day, or 0 3 * * *",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    result = run_rows(args.rows, args.probes, args.db, args.window, args.daily)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
