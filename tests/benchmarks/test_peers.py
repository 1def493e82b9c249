"""The peers benchmark's new parts: rounds, restarts, the private RabbitMQ node.

Cheap checks of ``benchmarks/peers.py`` (no Python 3.13 needed): the round
order and the medians the comparison table prints, a real restart run of
celery-zdelay on a Redis broker that must count every task (none lost with
an append-only file, all lost without one, which proves the count sees a
loss), and a private RabbitMQ node that keeps a persistent message across
its restart.
"""

from __future__ import annotations

import dataclasses
import sys

import kombu
import kombu.exceptions
import pytest

from benchmarks.infra import Resources
from benchmarks.peers import (
    QUICK,
    System,
    restart_rows,
    rotated,
    run_waiting,
    summarise_rounds,
)
from benchmarks.rabbitmq_node import RabbitMQNode

pytestmark = pytest.mark.timeout(240)

#: A restart run small enough for a test: 20 tasks due 10-12 s out.
TINY = dataclasses.replace(
    QUICK, wait_n=20, wait_lead_s=10.0, wait_window_s=2.0, restart_at_s=3.0, wait_cap_s=8.0
)


def _round(p50: float, burst: float, started: int = 10) -> dict[str, object]:
    return {
        "lateness_ms": {"p50": p50, "p99": p50 * 10, "max": p50 * 20},
        "burst_n": 10,
        "burst_started": started,
        "burst_last_s": burst,
        "early": 0,
        "not_run": 0,
        "doubled": 0,
    }


def test_each_round_starts_one_system_further_on() -> None:
    names = ["a", "b", "c"]
    assert [rotated(names, r) for r in range(4)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]


def test_rounds_give_the_median_and_its_spread() -> None:
    # The faulty single run of record was one round 10x off: the median ignores it.
    summary = summarise_rounds([_round(1.0, 2.0), _round(11_600.0, 16.0), _round(1.2, 3.0)])
    assert summary["lateness_p50_ms"] == {"median": 1.2, "min": 1.0, "max": 11_600.0, "n": 3}
    assert summary["burst_last_s"] == {"median": 3.0, "min": 2.0, "max": 16.0, "n": 3}


def test_a_round_whose_burst_did_not_all_start_gives_no_burst_time() -> None:
    summary = summarise_rounds([_round(1.0, 2.0), _round(1.0, 9.0, started=4)])
    assert summary["burst_last_s"] == {"median": 2.0, "min": 2.0, "max": 2.0, "n": 1}
    assert summary["burst_whole_rounds"] == 1


#: kombu before 5.4 has a worker that can stop consuming from a Redis broker
#: after reconnecting to it (celery/kombu#2007, fixed in 5.4.0); the
#: oldest-floor env (kombu 5.3.0) does so on most runs of this test.
KOMBU_WORKER_STALLS_AFTER_REDIS_RESTART = tuple(
    int(part) for part in kombu.__version__.split(".")[:2]
) < (5, 4)


@pytest.mark.parametrize(("durable", "lost"), [(True, 0), (False, TINY.wait_n)])
def test_a_broker_restart_counts_every_task(durable: bool, lost: int) -> None:
    # Given tasks parked in celery-zdelay's store, the Redis broker's own database
    with Resources() as res:
        system = System(res, "zdelay-redis", sys.executable, TINY, durable=durable)
        # When that Redis restarts while they wait
        found = run_waiting(system, TINY, "broker")
    # Then with its append-only file none is lost or doubled; without it all are lost
    assert found["restarted_at_s"] < TINY.wait_lead_s
    assert found["doubled"] == 0
    if durable and KOMBU_WORKER_STALLS_AFTER_REDIS_RESTART:
        # (kombu's stalled worker leaves released tasks in the broker's queue:
        # not run, but not lost either)
        assert found["lost"] == found["waiting_after"]["kombu_queue_list"]
    else:
        assert found["lost"] == lost


def test_a_private_rabbitmq_node_keeps_a_persistent_message_across_a_restart() -> None:
    node = RabbitMQNode()
    try:
        node.start()
        queue = "zbench-kept"  # a durable queue and direct exchange of that name
        with kombu.Connection(node.url) as conn:
            conn.SimpleQueue(queue).put({"kept": 1}, delivery_mode=2)  # persistent
        node.restart()
        with kombu.Connection(node.url) as conn:
            message = conn.SimpleQueue(queue).get(timeout=10)
            assert message.payload == {"kept": 1}
            message.ack()
    finally:
        node.stop()
    # The node is gone: nothing answers on its port
    gone = kombu.Connection(node.url, connect_timeout=2)
    with gone, pytest.raises(kombu.exceptions.OperationalError):
        gone.ensure_connection(max_retries=1)


def test_the_restart_table_says_what_each_restart_and_flower_did() -> None:
    seen = {"of": 4, "listed": 3, "with_eta": 3, "states": {"PENDING": 3}}
    done = {"of": 4, "listed": 4, "with_eta": 0, "states": {"SUCCESS": 4}}
    restarts = {
        "none": {
            "n": 4,
            "lost": 0,
            "doubled": 0,
            "early": 0,
            "waiting_before": {"zdelay_store": 4, "kombu_queue_list": 0},
            "flower_before": seen,
            "flower_after": done,
        },
        "broker": {"n": 4, "lost": 4, "doubled": 0, "early": 0},
        "worker": {"n": 4, "lost": 0, "doubled": 1, "early": 2},
        "companion": {"error": "BenchmarkError: it broke"},
    }
    result = {"systems": {"zdelay-redis": {"label": "zdelay", "restarts": restarts}}}
    header, row = restart_rows(result)
    cells = dict(zip(header, row, strict=True))
    assert cells["where they waited"] == "zdelay_store 4"
    assert cells["no restart: not run / doubled"] == "0 / 0 of 4"
    assert cells["broker: not run / doubled"] == "4 / 0 of 4"
    assert cells["store: not run / doubled"] == "—"
    assert cells["worker: not run / doubled"] == "0 / 1 of 4 (2 early)"
    assert cells["companion: not run / doubled"] == "not measured: BenchmarkError: it broke"
    assert cells["in Flower (no restart): waiting, with ETA / run"] == "3 of 4 / yes"
