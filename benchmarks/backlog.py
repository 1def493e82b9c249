"""What the benchmarks of a large store share: sizes, a burst in front of the backlog, id counts.

The backlog itself is :class:`benchmarks.scale._Filler`'s: copies of a park
request ``apply_delayed_many`` made, due 30 to 180 days ahead, one in ten with
a key and two tags, parked by the store's own bulk park.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

import redis

from .common import now_ms, spread
from .infra import MachineLoad

#: Parked months ahead behind every measurement; ``--sizes`` adds 10,000,000.
SIZES_FULL = (0, 100_000, 1_000_000)
SIZES_QUICK = (0, 10_000)


#: A burst's due time is this many times the seconds its park should take ahead
#: (its rate from the last burst parked, or the calibration), plus two seconds.
MARGIN_FACTOR = 1.5
#: A park must end this long before the due time for the release to count.
READY_MS = 300


def park_burst(filler: Any, n: int, due_ms: int) -> tuple[list[str], float]:
    """Park *n* copies of the filler's plain request due at *due_ms*; their ids and seconds."""
    ids: list[str] = []
    began = time.perf_counter()
    for chunk in filler.requests(n, marked=False, due_ms=lambda seq: due_ms):
        filler.store.park(chunk)
        ids += [request.task_id for request in chunk]
    seconds = time.perf_counter() - began
    if n >= 1_000:
        filler.burst_rate = n / seconds
    return ids, seconds


def calibrate(filler: Any, app: Any, n: int = 5_000) -> float:
    """Park *n* a day ahead and cancel them: the park rate the first burst's margin needs."""
    from celery_zdelay.steering import cancel_ids

    ids, seconds = park_burst(filler, n, now_ms() + 86_400_000)
    cancel_ids(ids, app=app)
    return n / seconds


def park_due_at_once(filler: Any, n: int) -> dict[str, Any]:
    """Park *n* due at one instant, set :data:`MARGIN_FACTOR` times the park's time ahead.

    Under a load spike the park may still end past the due time: the burst is
    released all the same, and ``valid`` is False (its release time does not count).
    """
    rate = min(filler.rate, getattr(filler, "burst_rate", filler.rate))
    margin_s = 2.0 + MARGIN_FACTOR * n / max(rate, 200)
    due = now_ms() + int(margin_s * 1000)
    ids, park_s = park_burst(filler, n, due)
    return {"ids": ids, "due": due, "park_s": park_s, "valid": now_ms() <= due - READY_MS}


def ids_in_list(client: redis.Redis, queue: str) -> list[str]:
    """The task id of every message in kombu's Redis list *queue* (protocol 2 headers)."""
    ids = []
    total = int(client.llen(queue))
    for start in range(0, total, 10_000):
        for raw in client.lrange(queue, start, start + 9_999):
            ids.append(str(json.loads(raw)["headers"]["id"]))
    return ids


def count_ids(expected: Iterable[str], seen: Iterable[str]) -> dict[str, int]:
    """Every expected id against what arrived: how many missing, doubled, unexpected."""
    wanted = set(expected)
    counts = Counter(seen)
    return {
        "expected": len(wanted),
        "delivered": sum(counts.values()),
        "missing": len(wanted - counts.keys()),
        "duplicates": sum(c - 1 for task_id, c in counts.items() if c > 1 and task_id in wanted),
        "unexpected": sum(c for task_id, c in counts.items() if task_id not in wanted),
    }


def summary(values: list[float]) -> dict[str, Any]:
    """Median of the rounds with min-max (:func:`benchmarks.common.spread`)."""
    return spread(values, digits=3)


def cell(stats: dict[str, Any] | None, fmt: str = ".2f") -> str:
    """``median [min-max]`` of a :func:`summary`, for the tables."""
    if not stats:
        return "-"
    return f"{stats['median']:{fmt}} [{stats['min']:{fmt}}-{stats['max']:{fmt}}]"


def parse_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part.replace("_", "")) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a comma-separated list of counts, not {text!r}"
        ) from None
    if list(sizes) != sorted(set(sizes)) or not sizes or sizes[0] < 0:
        raise argparse.ArgumentTypeError(f"sizes must be distinct and ascending, not {text!r}")
    return sizes


class LoadRecord:
    """The load average before and after a benchmark, and the CPU share busy between."""

    def __init__(self) -> None:
        self._load = MachineLoad()

    def stop(self) -> dict[str, Any]:
        out = self._load.stop()
        out["note"] = (
            "2 cores shared with other work (test suites of other developers): "
            "figures move with the load"
        )
        return out
