"""What the rate limit and pause tests share: a tap on the Redis broker's queue lists."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import redis
from celery import Celery

import celery_zdelay
from tests.helpers import wait_for
from tests.support.clock import redis_ms


@dataclass(frozen=True)
class Arrival:
    """One message seen in a broker queue list."""

    queue: str
    task_id: str
    #: Redis clock (ms) just after the message was taken from the list.
    redis_ms: int
    #: time.monotonic() at the same moment.
    at: float


class BrokerTap:
    """Takes every message out of some Redis broker queue lists as it arrives, with the time.

    Stands in for the workers: what the companions released, when, in which
    order, measured at the broker. BRPOP takes the oldest pushed first, so
    the arrivals are in release order.
    """

    def __init__(self, client: redis.Redis, *queues: str) -> None:
        self.client = client
        self.queues = list(queues)
        self.arrivals: list[Arrival] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> BrokerTap:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            popped = self.client.brpop(self.queues, timeout=0.2)
            if popped is None:
                continue
            key, raw = popped
            at = time.monotonic()
            arrival = Arrival(
                queue=key.decode(),
                task_id=json.loads(raw)["headers"]["id"],
                redis_ms=redis_ms(self.client),
                at=at,
            )
            with self._lock:
                self.arrivals.append(arrival)

    def of(self, queue: str) -> list[Arrival]:
        with self._lock:
            return [a for a in self.arrivals if a.queue == queue]

    def wait_for(self, queue: str, count: int, *, timeout: float) -> list[Arrival]:
        wait_for(
            lambda: len(self.of(queue)) >= count,
            timeout=timeout,
            message=lambda: f"{count} messages in {queue} (have {len(self.of(queue))})",
        )
        return self.of(queue)


def as_released(app: Celery, arrivals: list[Arrival]) -> list[Arrival]:
    """*arrivals* timed by when the store released each, in that order.

    The time is the ``released`` event of the task's history (the Redis
    clock, written by the script that released it); ``at`` is then that time
    in seconds. The tap's own times are when this process took each message
    out: a test process busy parking (one GIL, a loaded machine) takes them
    late and in bunches, which reads as a burst no limit granted.
    """
    timed = []
    for arrival in arrivals:
        released = [
            event.at
            for event in celery_zdelay.history(arrival.task_id, app=app)
            if event.event == "released"
        ]
        assert released, f"{arrival.task_id} has no released event in its history"
        ms = round(released[-1].timestamp() * 1000)
        timed.append(Arrival(arrival.queue, arrival.task_id, redis_ms=ms, at=ms / 1000))
    return sorted(timed, key=lambda arrival: arrival.at)


def most_in_any_window(arrivals: list[Arrival], seconds: float) -> int:
    """Return the most arrivals within any *seconds*-long window."""
    times = sorted(a.at for a in arrivals)
    most, start = 0, 0
    for end, t in enumerate(times):
        while t - times[start] > seconds:
            start += 1
        most = max(most, end - start + 1)
    return most


def largest_overtake_s(arrivals: list[Arrival], due_ms: dict[str, int]) -> float:
    """Return how long, at most, an entry arrived after one due later than it (0: in due order)."""
    worst = 0.0
    for a in arrivals:
        later = [b.at for b in arrivals if due_ms[b.task_id] > due_ms[a.task_id]]
        if later:
            worst = max(worst, a.at - min(later))
    return worst
