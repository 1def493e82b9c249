"""A held set is forgotten only once empty; the ACL pre-check names the first refused command.

Pins the lines of ``store/lua/forget_lane.lua`` and ``store/lua/allowed.lua``
(see docs/mutation.rst) on a private Redis, no worker or companion.

``forget_lane``: :meth:`ControlStore.forget_lane` takes a control's name
out of the shard's lanes set when its held set is empty, and only then (one
entry held keeps it), leaving the other controls named; a key of another
type refuses it before it writes.

``allowed``: asked as an ACL user (Redis 7), it answers the first command
of the list, in order, that the user may not run on the key it is given,
and ``""`` when the user may run them all; :meth:`Store.ensure_allowed`
refuses the script with that command's name before it runs.

The scripts' replies are read as their headers document them too (1 and
0, ``""``), where the store's methods turn them into a bool or a refusal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import redis
from celery import Celery

from celery_zdelay.config import get_config
from celery_zdelay.errors import StoreRefusedError
from celery_zdelay.parking import store_for
from celery_zdelay.store import Store
from celery_zdelay.store.control import ControlStore
from celery_zdelay.store.redis_keys import held_set_key, lanes_key
from celery_zdelay.store.scripts import Scripts
from celery_zdelay.testing import RedisServer
from tests.conftest import AppFactory
from tests.support.keys import PREFIX, refused_while_written_over
from tests.support.store import acl_users, claim_parked

pytestmark = pytest.mark.timeout(60)

CONTROL = "queue:emails"
OTHER = "queue:reports"
HELD = held_set_key(PREFIX, 0, CONTROL)
LANES = lanes_key(PREFIX, 0)
PASSWORD = "s3cret-forget-allowed"


# -- forget_lane.lua ----------------------------------------------------------------------


def _forget_reply(control: ControlStore) -> object:
    """forget_lane.lua's reply itself (:meth:`ControlStore.forget_lane` makes it a bool)."""
    return control._forget(keys=[HELD, LANES], args=[CONTROL], client=control.store.client)


def test_an_empty_held_set_is_forgotten_and_the_other_controls_stay_named(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Breaks if: redis.call('SREM', KEYS[2], ARGV[1]) is deleted, `return 1`
    # deleted or made 2, `> 0` made `>= 0`, or KEYS[1], KEYS[2] or ARGV[1]
    # is read one further.
    control = ControlStore(store_for(app))
    token, _ = claim_parked(app, ["a"])
    assert control.hold(0, token, CONTROL, ["a"]) == 1
    redis_client.sadd(LANES, OTHER)
    # The held entry is released: its set is empty (and gone)
    assert control.claim_held(0, CONTROL, limit=10, lease_ms=60_000).entries
    assert not redis_client.exists(HELD)

    assert _forget_reply(control) == 1

    assert redis_client.smembers(LANES) == {OTHER.encode()}
    assert control.forget_lane(0, CONTROL) is True
    assert redis_client.smembers(LANES) == {OTHER.encode()}


def test_a_held_set_with_one_entry_left_is_not_forgotten(
    app: Celery, redis_client: redis.Redis
) -> None:
    # Breaks if: `> 0` is made `> 1`, or the `return 0` made 1.
    control = ControlStore(store_for(app))
    token, _ = claim_parked(app, ["a"])
    assert control.hold(0, token, CONTROL, ["a"]) == 1

    assert _forget_reply(control) == 0
    assert control.forget_lane(0, CONTROL) is False

    assert redis_client.smembers(LANES) == {CONTROL.encode()}
    assert [m.decode() for m in redis_client.zrange(HELD, 0, -1)] == ["a"]


@pytest.mark.parametrize(("key", "kind"), [(HELD, "zset"), (LANES, "set")], ids=["held", "lanes"])
def test_a_key_of_another_type_refuses_forget_before_writing(
    app: Celery, redis_client: redis.Redis, key: str, kind: str
) -> None:
    # Breaks if: zdelay_expect(KEYS[1], 'zset', KEYS[2], 'set') is deleted.
    redis_client.sadd(LANES, CONTROL, OTHER)
    control = ControlStore(store_for(app))

    with refused_while_written_over(redis_client, key, kind):
        control.forget_lane(0, CONTROL)

    if key == HELD:
        assert redis_client.smembers(LANES) == {CONTROL.encode(), OTHER.encode()}


# -- allowed.lua -------------------------------------------------------------------------


@pytest.fixture
def acl_user(redis_server: RedisServer) -> Iterator[Callable[..., redis.Redis]]:
    """Make an ACL user of the session's Redis from rules; return a client logged in as it."""
    clients: list[redis.Redis] = []
    with acl_users(redis_server, PASSWORD) as new_user:

        def make(*rules: str) -> redis.Redis:
            client = redis.Redis(
                port=redis_server.port, username=new_user(*rules), password=PASSWORD
            )
            clients.append(client)
            return client

        yield make
        for client in clients:
            client.close()


@pytest.mark.redis7  # ACL DRYRUN
def test_allowed_names_the_first_refused_command_in_the_scripts_order(
    acl_user: Callable[..., redis.Redis],
) -> None:
    # Breaks if: the first line's `not` is dropped (always ""), the loop
    # starts at 2, the loop's `not` is dropped (names an allowed command), or
    # KEYS[1] is read as KEYS[2] (no key: the check fails). EVALSHA itself
    # refuses a key the user may not touch, so the key given is always one
    # it may.
    user = acl_user("~{zdelay:0}*", "+@all", "-set", "-hset")
    allowed = Scripts(user).allowed

    assert allowed(keys=["{zdelay:0}:due"], args=["GET", "SET", "HSET"]) == b"SET"
    assert allowed(keys=["{zdelay:0}:due"], args=["HSET", "GET", "SET"]) == b"HSET"


def test_allowed_answers_empty_when_every_command_is_allowed(
    acl_user: Callable[..., redis.Redis],
) -> None:
    # Breaks if: the last `return ''` is deleted (nil), or the loop's `not`
    # dropped.
    allowed = Scripts(acl_user("~*", "+@all", "-set")).allowed

    assert allowed(keys=["{zdelay:0}:due"], args=["GET", "ZADD", "HGET"]) == b""
    assert allowed(keys=["{zdelay:0}:due"], args=[]) == b""


@pytest.mark.redis7  # ACL DRYRUN
def test_a_user_denied_a_command_is_refused_the_script_naming_it_before_it_runs(
    acl_user: Callable[..., redis.Redis], make_test_app: AppFactory, redis_server: RedisServer
) -> None:
    user = acl_user("~*", "+@all", "-zrangebyscore")
    kwargs = user.get_connection_kwargs()
    url = f"redis://{kwargs['username']}:{PASSWORD}@127.0.0.1:{redis_server.port}/0"
    store = Store(get_config(make_test_app(conf={"zdelay_redis_url": url})))
    try:
        due = store.keys(0).due
        store.ensure_allowed(due, "park")  # park.lua runs no ZRANGEBYSCORE
        with pytest.raises(StoreRefusedError, match=r"refuse ZRANGEBYSCORE, which claim\.lua runs"):
            store.ensure_allowed(due, "claim")
    finally:
        store.close()
