"""Send tasks through celery-redis-plus, run in its own Python 3.13 virtualenv.

``python3.13 redis_plus_send.py BROKER_URL SPECS_JSON`` sends one task per
spec (``{"args": [...], "countdown": s, "sent_ago": s}``) with Celery's
``send_task`` on celery-redis-plus's transport and prints their ids as JSON.
``sent_ago`` publishes as celery-redis-plus would have that many seconds
earlier (its transport's clock set back, Celery's not): a countdown of 5 s
sent "70 s ago" waits in its delayed set as one sent then with a countdown
of 75 s, due in 5 s. Imports nothing of the tests or of celery-zdelay.
"""

from __future__ import annotations

import json
import sys
import time

import celery_redis_plus.signals  # noqa: F401  (copies the eta into the message's properties)
from celery import Celery
from celery_redis_plus import transport


def main() -> None:
    url, specs = sys.argv[1], json.loads(sys.argv[2])
    app = Celery("redis_plus_send", broker=url)
    app.conf.broker_transport = "celery_redis_plus.transport:Transport"
    ids = []
    with app.producer_or_acquire() as producer:
        for spec in specs:
            ago = float(spec.get("sent_ago", 0))
            transport.time = lambda ago=ago: time.time() - ago  # type: ignore[misc]
            result = app.send_task(
                "tests.record",
                args=spec["args"],
                countdown=spec.get("countdown"),
                producer=producer,
            )
            ids.append(result.id)
    print(json.dumps(ids))


if __name__ == "__main__":
    main()
