"""Security: signed entries, no deserialization in the companion, TLS and ACL
users, passwords kept out of logs, key prefixes isolating apps."""

from __future__ import annotations

import json
import os
import pickle
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery

import celery_zdelay
from celery_zdelay.companion import Companion
from celery_zdelay.entry import TaskMessage, encode_entry
from celery_zdelay.parking import store_for
from celery_zdelay.schedule import Due
from celery_zdelay.store import ParkRequest
from celery_zdelay.testing import RedisServer
from tests.conftest import AppFactory
from tests.helpers import Runs
from tests.servers import LocalTLSRedis
from tests.support.deadletters import dead_reasons
from tests.support.keys import SHARD0

pytestmark = pytest.mark.timeout(90)

KEY = "k" * 32
OLD_KEY = "o" * 32
DEAD = SHARD0.dead


def _release(app: Celery) -> Companion:
    with Companion(app) as companion:
        companion.release_due()
    return companion


def test_signed_entries_are_verified_then_handed_off_atomically(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = make_test_app(conf={"zdelay_signing_key": KEY})
    ids = {app.tasks["tests.record"].apply_delayed((i,), countdown=0).id for i in range(20)}
    payload = redis_client.hget(SHARD0.msg, next(iter(ids)))
    assert payload is not None
    assert b'"s":"' in payload.split(b"\n")[0]

    with Companion(app) as companion:
        report = companion.release_due()

    assert report.handed_off == 20
    assert report.published == 0
    released = {json.loads(raw)["headers"]["id"] for raw in redis_client.lrange("celery", 0, -1)}
    assert released == ids


def test_unsigned_and_tampered_entries_are_dead_lettered_never_published(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    unsigned_app = make_test_app()
    unsigned = unsigned_app.tasks["tests.record"].apply_delayed(("forged",), countdown=0)
    app = make_test_app(conf={"zdelay_signing_key": KEY})
    tampered = app.tasks["tests.record"].apply_delayed(("genuine",), countdown=0)
    payload = redis_client.hget(SHARD0.msg, tampered.id)
    assert payload is not None
    redis_client.hset(SHARD0.msg, tampered.id, payload.replace(b"W1s", b"W1t", 1))
    good = app.tasks["tests.record"].apply_delayed(("kept",), countdown=0)

    _release(app)

    reasons = dead_reasons(redis_client)
    assert reasons[unsigned.id].startswith("unsigned entry")
    assert reasons[tampered.id].startswith("bad signature")
    (raw,) = redis_client.lrange("celery", 0, -1)
    assert json.loads(raw)["headers"]["id"] == good.id


def test_an_old_key_verifies_until_it_is_removed_from_the_list(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    old = make_test_app(conf={"zdelay_signing_key": OLD_KEY})
    first = old.tasks["tests.record"].apply_delayed((1,), countdown=0)
    second = old.tasks["tests.record"].apply_delayed((2,), countdown=0)
    rotating = make_test_app(conf={"zdelay_signing_key": [KEY, OLD_KEY]})
    celery_zdelay.reschedule(second.id, countdown=3600, app=rotating)

    _release(rotating)
    assert redis_client.llen("celery") == 1

    rotated = make_test_app(conf={"zdelay_signing_key": [KEY]})
    celery_zdelay.reschedule(second.id, countdown=0, app=rotated)
    _release(rotated)
    reasons = dead_reasons(redis_client)
    assert set(reasons) == {second.id}
    assert reasons[second.id].startswith("bad signature")
    assert json.loads(redis_client.lindex("celery", 0))["headers"]["id"] == first.id


class _Bomb:
    """Unpickling this writes a file: proof that something unpickled it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (Path.write_text, (Path(self.path), "unpickled!"))  # type: ignore[return-value]


@pytest.fixture
def bomb_path() -> Iterator[Path]:
    path = Path(tempfile.gettempdir()) / f"zdelay-bomb-{os.getpid()}"
    path.unlink(missing_ok=True)
    yield path
    path.unlink(missing_ok=True)


def _park_bomb(app: Celery, path: Path, task_id: str) -> None:
    message = TaskMessage(
        body=pickle.dumps(((_Bomb(str(path)),), {}, {})),
        content_type="application/x-python-serialize",
        content_encoding="binary",
        headers={"lang": "py", "task": "tests.record", "id": task_id, "eta": None},
        properties={"correlation_id": task_id, "delivery_mode": 2},
        priority=0,
        exchange="",
        routing_key="celery",
    )
    payload, template = encode_entry(message, dest="celery", layout=_layout(app))
    store_for(app).park([ParkRequest(task_id, Due("r", 0), payload, "celery", template)])


def _layout(app: Celery) -> str:
    from celery_zdelay.app_state import producing as _parking

    layout = _parking(app).layout
    assert layout is not None
    return layout.fingerprint


@pytest.mark.parametrize("path", ["handoff", "generic"])
def test_the_companion_never_unpickles_what_it_releases(
    make_test_app: AppFactory, redis_server: RedisServer, bomb_path: Path, path: str
) -> None:
    broker = None if path == "handoff" else f"{redis_server.url}/3"
    app = make_test_app(broker=broker)
    # Sanity check: the bomb does go off when unpickled.
    pickle.loads(pickle.dumps(_Bomb(str(bomb_path))))
    assert bomb_path.exists()
    bomb_path.unlink()

    _park_bomb(app, bomb_path, "bomb-1")
    companion = _release(app)

    assert companion.totals.released == 1
    assert not bomb_path.exists()


def test_with_signing_a_forged_pickle_is_dead_lettered(
    make_test_app: AppFactory, redis_client: redis.Redis, bomb_path: Path
) -> None:
    app = make_test_app(conf={"zdelay_signing_key": KEY})
    _park_bomb(app, bomb_path, "bomb-2")
    _release(app)
    assert dead_reasons(redis_client)["bomb-2"].startswith("unsigned entry")
    assert redis_client.llen("celery") == 0
    assert not bomb_path.exists()


def test_tls_and_an_acl_user_work_and_the_password_stays_out_of_the_logs(
    make_test_app: AppFactory, worker, companion, runs: Runs
) -> None:
    with LocalTLSRedis() as tls:
        app = make_test_app(conf={"zdelay_redis_url": tls.url})
        process = companion(app)
        worker(app)
        results = [app.tasks["tests.record"].apply_delayed((i,), countdown=0.1) for i in range(10)]
        runs.wait_for_count(10)
        assert set(runs.ids()) == {r.id for r in results}
        log = process.log()
        assert f"rediss://{tls.username}:**@127.0.0.1:{tls.port}" in log
        assert tls.password not in log
        with tls.admin() as admin:
            assert admin.zcard(SHARD0.due) == 0


def test_a_wrong_acl_password_is_a_clear_error_without_the_password(
    make_test_app: AppFactory,
) -> None:
    with LocalTLSRedis() as tls:
        url = tls.url.replace(tls.password, "wrong-pass")
        app = make_test_app(conf={"zdelay_redis_url": url})
        with pytest.raises(celery_zdelay.StoreUnavailableError) as caught:
            app.tasks["tests.record"].apply_delayed((1,), countdown=1)
        assert "wrong-pass" not in str(caught.value)
        assert f"rediss://{tls.username}:**@127.0.0.1:{tls.port}" in str(caught.value)


def test_key_prefixes_isolate_two_apps_on_one_redis(
    make_test_app: AppFactory, redis_client: redis.Redis
) -> None:
    orders = make_test_app(conf={"zdelay_key_prefix": "orders"})
    billing = make_test_app(conf={"zdelay_key_prefix": "billing"})
    parked = orders.tasks["tests.record"].apply_delayed(("order",), countdown=0)

    assert celery_zdelay.cancel(parked.id, app=billing) is False
    assert celery_zdelay.reschedule(parked.id, countdown=5, app=billing) is False
    with Companion(billing) as companion:
        assert companion.release_due().released == 0
    assert redis_client.zcard("{orders:0}:due") == 1
    with Companion(orders) as companion:
        assert companion.release_due().released == 1
