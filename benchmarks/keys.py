"""Keys and tags: what they cost when used, and that they cost nothing when not.

``python -m benchmarks.keys [--quick] [--base COMMIT]`` runs on one private
Redis (broker = store, so releases take the atomic handoff), in one process,
and prints one JSON document:

- ``memory``: Redis ``used_memory`` per parked task, N tasks parked without
  keys or tags, then (after a flush) N tasks with one key and two tags each;
- ``release``: tasks released per second by the handoff (an in-process
  companion's ``release_due`` until the due set is empty), plain tasks and
  keyed-and-tagged ones, alternating, best of *rounds*;
- ``unmarked_before_after``: the release rate of the same plain tasks by
  ``handoff.lua`` as it is and as it was at *base* (``git show``: the script
  without the key and tag cleanup; the other scripts it runs are the
  same), alternating in the same run, best of *rounds*. Parking an
  unmarked task runs the unchanged ``park.lua``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

from celery_zdelay.companion import Companion
from celery_zdelay.parking import store_for
from celery_zdelay.store.scripts import build_source, spec

from .infra import ROOT, Resources, used_memory

#: Tasks parked per apply_delayed_many call.
_CHUNK = 1000


def _park(app: Any, n: int, *, countdown: float, marked: bool, round_no: int = 0) -> None:
    noop = app.tasks["bench.noop"]
    for start in range(0, n, _CHUNK):
        calls = [(seq, 0) for seq in range(start, min(start + _CHUNK, n))]
        if marked:
            keys = [f"job:{round_no}:{seq}" for seq, _ in calls]
            noop.apply_delayed_many(calls, countdown=countdown, keys=keys, tags=["t:a", "t:b"])
        else:
            noop.apply_delayed_many(calls, countdown=countdown)


def _release_rate(app: Any, n: int) -> float:
    """Seconds-based rate at which an in-process companion empties the due set."""
    store = store_for(app)
    due = store.keys(0).due
    with Companion(app) as companion:
        started = time.perf_counter()
        released = 0
        while released < n:
            released += companion.release_due().released
        elapsed = time.perf_counter() - started
    if store.client.zcard(due):
        raise RuntimeError("entries left after the release")
    return n / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.keys")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--base", default="HEAD~1", help="commit whose handoff.lua is 'before'")
    options = parser.parse_args(argv)
    n = 5_000 if options.quick else 50_000
    rounds = 3 if options.quick else 5
    base_body = subprocess.run(
        ["git", "show", f"{options.base}:celery_zdelay/store/lua/handoff.lua"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    with Resources() as res:
        _, app, client = res.redis_app()
        store = store_for(app)

        memory: dict[str, int] = {}
        for label, marked in (("plain", False), ("one_key_two_tags", True)):
            client.flushall()
            before = used_memory(client)
            _park(app, n, countdown=3600, marked=marked)
            memory[label] = round((used_memory(client) - before) / n)
        client.flushall()

        rates: dict[str, list[float]] = {"plain": [], "one_key_two_tags": []}
        for round_no in range(rounds):
            for label, marked in (("plain", False), ("one_key_two_tags", True)):
                _park(app, n, countdown=0, marked=marked, round_no=round_no)
                rates[label].append(_release_rate(app, n))
                client.delete("celery")

        new_handoff = store.scripts.handoff
        old_handoff = client.register_script(build_source(spec("handoff"), body=base_body))
        before_after: dict[str, list[float]] = {"before": [], "after": []}
        for _ in range(rounds):
            for label, script in (("before", old_handoff), ("after", new_handoff)):
                store.scripts.handoff = script
                _park(app, n, countdown=0, marked=False)
                before_after[label].append(_release_rate(app, n))
                client.delete("celery")
        store.scripts.handoff = new_handoff

    def summary(values: list[float]) -> dict[str, float]:
        return {"best": round(max(values)), "median": round(statistics.median(values))}

    document = {
        "n": n,
        "rounds": rounds,
        "base": options.base,
        "memory_bytes_per_task": memory,
        "release_tasks_per_s": {label: summary(v) for label, v in rates.items()},
        "unmarked_before_after_tasks_per_s": {
            label: summary(v) for label, v in before_after.items()
        },
    }
    json.dump(document, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
