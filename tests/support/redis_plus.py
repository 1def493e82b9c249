"""celery-redis-plus for the tests: its Python 3.13 virtualenv, and tasks sent through it.

celery-redis-plus needs Python 3.13; the virtualenv is the one the peers
benchmark makes (:func:`benchmarks.peers.competitor_python`, pinned there),
made on first use. Without Python 3.13 or the package, a test fails in CI
and skips elsewhere (:func:`tests.helpers.unavailable`).
"""

from __future__ import annotations

import fcntl
import json
import subprocess
import time
from functools import cache
from pathlib import Path
from typing import Any

from benchmarks.peers import cache_dir, competitor_python
from tests.helpers import unavailable

__all__ = ["hand_over", "redis_plus_python", "send"]

SENDER = Path(__file__).with_name("redis_plus_send.py")


@cache
def _python() -> tuple[str | None, str]:
    # pytest-xdist workers share the virtualenv: one makes it, the others wait.
    cache_dir().mkdir(parents=True, exist_ok=True)
    with (cache_dir() / "peers-py3.13.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return competitor_python("redis-plus")


def redis_plus_python() -> str:
    """The Python 3.13 of a virtualenv with celery-redis-plus."""
    python, why = _python()
    if python is None:
        unavailable(f"celery-redis-plus is not available: {why}")
    return python


def send(broker_url: str, specs: list[dict[str, Any]]) -> list[str]:
    """Send ``tests.record`` tasks through celery-redis-plus (see redis_plus_send.py); their ids."""
    done = subprocess.run(
        [redis_plus_python(), str(SENDER), broker_url, json.dumps(specs)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return list(json.loads(done.stdout))


@cache
def _their_script(name: str) -> str:
    """The text of one of celery-redis-plus's own Lua scripts, from its installed package."""
    code = (
        "import celery_redis_plus, pathlib; print(pathlib.Path(celery_redis_plus.__file__).parent)"
    )
    found = subprocess.run(
        [redis_plus_python(), "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    return (Path(found.stdout.strip()) / f"transport_{name}.lua").read_text()


def hand_over(client: Any, queue: str, *, up_to_s: float) -> Any:
    """Do what a worker of celery-redis-plus does with its delayed messages, by its own scripts.

    Its sweep moves those due by *up_to_s* (epoch s) into the queue set, and
    its consumer pops the first, holding it for 300 s; returns that delivery
    tag (None: nothing to pop).
    """
    sweep = client.register_script(_their_script("enqueue_due_messages"))
    sweep(
        keys=[f"messages_index:{queue}"],
        args=[up_to_s, 1000, 300, 10**13, "message:", "", "queue:", -1, 10],
    )
    pop = client.register_script(_their_script("consume_message"))
    popped = pop(
        keys=[f"queue:{queue}"],
        args=["", "message:", time.time() + 300, "messages_index:", queue, "0"],
    )
    return None if popped is None else popped[1]
