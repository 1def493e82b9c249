"""A producer process of the soak test: parks, cancels and reschedules for a while.

``python -m tests.soak_producer SECONDS SEED OUTPUT.json`` with the test app's
environment (see tests.project.app_env); writes what it did to OUTPUT.json.
"""

from __future__ import annotations

import json
import random
import sys
import time

import celery_zdelay
from tests.project import app_from_env, close_app

#: Tasks parked per second by each producer, at most. Without a cap the load
#: would grow with the machine's speed and outrun the test's two solo workers
#: on a loaded machine; the soak is about accounting for every id, not speed.
PARK_RATE = 80


def main(seconds: float, seed: int, output: str) -> None:
    app = app_from_env()
    record = app.tasks["tests.record"]
    rng = random.Random(seed)
    parked: list[str] = []
    cancelled: list[str] = []
    rescheduled = 0
    deadline = time.monotonic() + seconds
    n = 0
    started = time.monotonic()
    while time.monotonic() < deadline:
        if len(parked) > PARK_RATE * (time.monotonic() - started):
            time.sleep(0.01)  # pacing, not synchronisation
            continue
        roll = rng.random()
        if roll < 0.6:
            task_id = f"s{seed}-{n}"
            n += 1
            record.apply_delayed((task_id,), task_id=task_id, countdown=rng.uniform(0.05, 4))
            parked.append(task_id)
        elif roll < 0.7:
            with celery_zdelay.batch(app):
                for _ in range(rng.randint(10, 100)):
                    task_id = f"s{seed}-{n}"
                    n += 1
                    record.apply_delayed((task_id,), task_id=task_id, countdown=rng.uniform(0.5, 6))
                    parked.append(task_id)
        elif roll < 0.85 and parked:
            task_id = rng.choice(parked[-500:])
            if celery_zdelay.cancel(task_id, app=app):
                cancelled.append(task_id)
        elif parked:
            task_id = rng.choice(parked[-500:])
            if celery_zdelay.reschedule(task_id, countdown=rng.uniform(0, 3), app=app):
                rescheduled += 1
    with open(output, "w") as out:
        json.dump({"parked": parked, "cancelled": cancelled, "rescheduled": rescheduled}, out)
    close_app(app)


if __name__ == "__main__":
    main(float(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
