"""Soak: 60 s of mixed parking, cancelling, rescheduling and releasing from
several processes, against a 3-master Redis Cluster with 4 companions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from celery_zdelay.parking import store_for
from celery_zdelay.testing import RedisServer
from tests.conftest import AppFactory
from tests.helpers import ROOT, Runs, wait_for
from tests.project import app_env
from tests.servers import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

SOAK_SECONDS = float(os.environ.get("ZDELAY_SOAK_SECONDS", "60"))
PRODUCERS = 3
SHARDS = 12


def test_a_minute_of_mixed_load_on_a_cluster_accounts_for_every_task(
    make_test_app: AppFactory,
    cluster: LocalCluster,
    broker_server: RedisServer,
    worker,
    companion,
    runs: Runs,
) -> None:
    app = make_test_app(
        broker=f"{broker_server.url}/0",
        conf={
            "zdelay_redis_url": cluster.url,
            "zdelay_shards": SHARDS,
            "zdelay_shard_leases": True,
            "task_ignore_result": True,
        },
    )
    for _ in range(4):
        companion(app)
    worker(app)
    worker(app)

    # Given producers parking, cancelling and rescheduling for a minute
    outputs = [Path(tempfile.mkstemp(suffix=".json")[1]) for _ in range(PRODUCERS)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), **app_env(app)}
    producers = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.soak_producer", str(SOAK_SECONDS), str(seed), str(out)],
            cwd=ROOT,
            env=env,
        )
        for seed, out in enumerate(outputs)
    ]
    for producer in producers:
        assert producer.wait(timeout=SOAK_SECONDS + 120) == 0
    done = [json.loads(out.read_text()) for out in outputs]
    for out in outputs:
        out.unlink()
    parked = {task_id for d in done for task_id in d["parked"]}
    cancelled = {task_id for d in done for task_id in d["cancelled"]}
    assert len(parked) > 5000
    assert cancelled
    assert sum(d["rescheduled"] for d in done) > 0

    # Then every parked and not cancelled task runs exactly once
    expected = parked - cancelled
    runs.wait_for_ids(expected, stall_timeout=120)
    ran = runs.ids()
    assert set(ran) == expected
    assert runs.duplicates() == {}

    # And nothing is left behind in any shard
    store = store_for(app)

    def empty() -> bool:
        client = store.client
        return all(
            client.zcard(keys.due) == client.zcard(keys.lease) == 0
            and client.hlen(keys.msg) == client.hlen(keys.leased) == 0
            for keys in (store.keys(s) for s in store.shards)
        )

    wait_for(empty, timeout=30, message="every shard empty")
