"""Per-key rate limits: exactness per key and fairness between keys, measured at the broker.

Three real ``celery zdelay`` processes share one private Redis (broker =
store, 4 shards). Ten limit keys (``tenant:0`` .. ``tenant:9``) fall due at
one instant, ``tenant:0`` holding 90 % of the backlog (1,800 tasks, the nine
others 22 each). A thread takes every message out of the queue list as it
arrives (BRPOP, the oldest first) and notes when, and under which key
(the message's ``zdelay_limit_key`` header).

Two runs:

- ``limited``: ``{"limit_key:tenant:*": "20/s"}`` (burst 20), for
  ``seconds``: per key, the most released in any 1 s and 5 s span against
  ``burst + rate x T``, the rate achieved after the burst, and when each of
  the nine small keys was done (after the first release of the run);
- ``turns``: a per-key limit too generous to hold anyone back
  (100,000/s each), so that only the companions' release passes spread the
  keys: how far into the drain (tasks released, seconds) the last task of
  the nine small keys came, against the 1,998 of the whole backlog; with
  3 companions and with 1 (``turns_one_companion``). Turns are taken per
  companion, over the shards it owns: with several, the order at the
  broker also depends on which companion gets the CPU first;
- ``queue_turns``: no per-key limit, but a limit of the queue,
  ``{"queue:<queue>": "200/s"}`` (burst 200), one bucket for all the keys:
  the same drain figures, the turns now between the keys' lanes under the
  queue's limit (issue 36). Drained in due order, the nine small keys'
  last task would come at release 1,998, after all of ``tenant:0``'s.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import redis

from .common import Sizes, eta_for, now_ms
from .infra import MachineLoad, Resources
from .proj import DEFAULT_QUEUE, make_app

GLOB = "limit_key:tenant:*"
KEYS = 10
BIG = 1_800
SMALL = 22
RATE = 20


def run_fairness(sizes: Sizes) -> dict[str, Any]:
    """Both runs (see the module docstring); ``seconds`` from the lateness size."""
    seconds = max(10.0, sizes.lateness_seconds)
    return {
        "keys": KEYS,
        "backlog": {"tenant:0": BIG, "each other": SMALL},
        "companions": 3,
        "shards": 4,
        "limited": _run({"rate": f"{RATE}/s", "burst": RATE}, seconds=seconds, drain=False),
        "turns": _run({"rate": "100000/s", "burst": 100_000}, seconds=60.0, drain=True),
        "turns_one_companion": _run(
            {"rate": "100000/s", "burst": 100_000}, seconds=60.0, drain=True, companions=1
        ),
        "queue_turns": _run(
            {"rate": "200/s", "burst": 200},
            seconds=60.0,
            drain=True,
            control=f"queue:{DEFAULT_QUEUE}",
        ),
    }


def _run(
    limit: dict[str, Any],
    *,
    seconds: float,
    drain: bool,
    companions: int = 3,
    settle_s: float = 0.0,
    control: str = GLOB,
) -> dict[str, Any]:
    total = BIG + SMALL * (KEYS - 1)
    with Resources() as res:
        server = res.redis()
        url = f"{server.url}/0"
        conf = {"zdelay_shards": 4, "zdelay_rate_limits": {control: limit}}
        app = make_app(broker=url, store=url, conf=conf)
        res.callback(app.close)
        for _ in range(companions):
            res.companion(app)
        client = redis.Redis.from_url(url)
        res.callback(client.close)
        arrivals: list[tuple[float, str]] = []
        stop = threading.Event()

        def tap() -> None:
            while not stop.is_set():
                popped = client.brpop([DEFAULT_QUEUE], timeout=0.2)
                if popped is not None:
                    key = json.loads(popped[1])["headers"].get("zdelay_limit_key", "?")
                    arrivals.append((time.monotonic(), key))

        thread = threading.Thread(target=tap, daemon=True)
        thread.start()
        # (*settle_s*: time for the companions to share the shards out first)
        time.sleep(settle_s)
        noop = app.tasks["bench.noop"]
        due = now_ms() + 5_000
        for tenant in range(KEYS):
            n = BIG if tenant == 0 else SMALL
            noop.apply_delayed_many(
                [(seq, due) for seq in range(n)], eta=eta_for(due), limit_key=f"tenant:{tenant}"
            )
        if now_ms() >= due:
            stop.set()
            thread.join(timeout=5)
            return {"error": "parking took longer than the margin before the due time"}
        load = MachineLoad()
        deadline = time.monotonic() + (seconds * 3 + 30 if drain else 5 + seconds)
        while time.monotonic() < deadline and (len(arrivals) < total if drain else True):
            time.sleep(0.1)
        machine = load.stop()
        stop.set()
        thread.join(timeout=5)
    if not arrivals:
        return {"error": "nothing arrived", "machine": machine}
    first = arrivals[0][0]
    small = [(i, t) for i, (t, key) in enumerate(arrivals) if key != "tenant:0"]
    result: dict[str, Any] = {
        "control": control,
        "limit": limit,
        "companions": companions,
        "arrived": len(arrivals),
        "machine": machine,
    }
    if not drain:
        per_key = {}
        for tenant in range(KEYS):
            times = [t for t, key in arrivals if key == f"tenant:{tenant}"]
            per_key[f"tenant:{tenant}"] = {
                "arrived": len(times),
                "most_in_1s": _most_in(times, 1.0),
                "most_in_5s": _most_in(times, 5.0),
                "done_after_s": round(times[-1] - first, 3) if times else None,
            }
        big = [t for t, key in arrivals if key == "tenant:0"]
        after = [t for t in big if t >= big[0] + 1.0]
        result.update(
            {
                "bound_1s": RATE + RATE * 1,
                "bound_5s": RATE + RATE * 5,
                "big_rate_after_burst_per_s": (
                    round(len(after) / (big[-1] - big[0] - 1.0), 2) if len(after) > 1 else None
                ),
                "small_all_done_after_s": round(max(t for _, t in small) - first, 3)
                if len(small) == SMALL * (KEYS - 1)
                else None,
                "per_key": per_key,
            }
        )
    else:
        last_small_index, last_small_t = max(small) if small else (None, None)
        result.update(
            {
                "drain_s": round(arrivals[-1][0] - first, 3),
                "small_last_at_release": None if last_small_index is None else last_small_index + 1,
                "small_last_after_s": None
                if last_small_t is None
                else round(last_small_t - first, 3),
                "total": total,
            }
        )
    return result


def _most_in(times: list[float], seconds: float) -> int:
    most, lo = 0, 0
    for hi, t in enumerate(times):
        while t - times[lo] > seconds:
            lo += 1
        most = max(most, hi - lo + 1)
    return most
