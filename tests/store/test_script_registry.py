"""Every Lua script is declared once and built one way; every park is checked the same way.

The registry (``celery_zdelay/store/scripts.py``) names each script's body
and the libraries it includes; :func:`build_source` is the only place Lua is
put together. Given the whole package imported (the periodic scripts and the
testing fast-forward register theirs beside their files):

- every ``.lua`` file of the package is a registered script's body or an
  include some registered script declares, and every library function a
  script calls comes from an include it declares;
- every registered script compiles on a real Redis, and its source holds
  each of its files exactly once;
- a keyed park goes through :meth:`Store.park` like a plain one, so an ACL
  user lacking a command park_keyed.lua runs is refused before anything is
  written, with the command named (as a plain park always was).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

import celery_zdelay.periodic.store
import celery_zdelay.redis_plus
import celery_zdelay.testing.fastforward
from celery_zdelay.config import get_config
from celery_zdelay.errors import StoreRefusedError
from celery_zdelay.periodic.store import PeriodicStore
from celery_zdelay.schedule import Due
from celery_zdelay.store import ParkRequest, Store
from celery_zdelay.store.scripts import (
    GUARD,
    LuaFile,
    ScriptSpec,
    register,
    registered_scripts,
    script_commands,
    script_source,
    spec,
    store_lua,
)
from celery_zdelay.testing import RedisServer
from tests.conftest import AppFactory
from tests.support.clock import redis_ms
from tests.support.store import PAYLOAD, acl_users, marked_request

pytestmark = pytest.mark.timeout(60)

# Where the package under test lives: the checkout, or site-packages when
# the tests run against the installed wheel (tox).
ROOT = Path(celery_zdelay.__file__).resolve().parent.parent
PASSWORD = "s3cret-registry"
HOUR = 3_600_000

# Imported for the scripts they register (the store knows nothing of them).
assert celery_zdelay.periodic.store.PERIODIC_SCRIPTS
assert celery_zdelay.testing.fastforward.SHIFT


def _path(lua: LuaFile) -> str:
    return "/".join([*lua.package.split("."), lua.path])


def _functions(lua: LuaFile) -> set[str]:
    return set(re.findall(r"^local function (\w+)", lua.read(), flags=re.MULTILINE))


def _bodies(script: ScriptSpec) -> list[LuaFile]:
    found = [script.body]
    for inner in (script.calls, script.leads_into):
        if inner is not None:
            found += _bodies(inner)
    return found


# -- declared once ----------------------------------------------------------------------


def test_every_lua_file_is_a_registered_script_or_an_include_one_declares() -> None:
    # Breaks if: a .lua file is added and loaded by hand (or left unused),
    # or a spec names a file that is not there.
    on_disk = {p.relative_to(ROOT).as_posix() for p in (ROOT / "celery_zdelay").rglob("*.lua")}
    declared = {_path(lua) for script in registered_scripts() for lua in script.files()}

    assert declared == on_disk


def test_includes_are_libraries_and_bodies_are_scripts() -> None:
    # A library (its name starts with "_") only defines functions: run as a
    # script of its own it would do nothing. A body is never loaded in front
    # of another script as a library.
    for script in registered_scripts():
        assert not script.body.name.startswith("_"), script.name
        assert script.body.name == f"{script.name}.lua", script.name
        for lua in script.all_includes():
            assert lua.name.startswith("_"), (script.name, lua.name)


def test_every_library_function_a_script_calls_comes_from_an_include_it_declares() -> None:
    # Breaks if: a script starts calling zdelay_where (say) without WHERE in
    # its includes: Lua would find no such function, at run time, on the
    # path that calls it.
    libraries = {lua for script in registered_scripts() for lua in (*script.all_includes(), GUARD)}
    defined_in = {name: lua for lua in libraries for name in _functions(lua)}
    assert len(defined_in) == sum(len(_functions(lua)) for lua in libraries)  # one definer each
    for script in registered_scripts():
        loaded = set(script.all_includes()) | ({GUARD} if script.guarded else set())
        for body in _bodies(script):
            called = set(re.findall(r"\b(\w+)\(", body.read())) & set(defined_in)
            missing = {name for name in called if defined_in[name] not in loaded}
            assert missing == set(), (script.name, body.name, missing)


def test_a_name_is_one_script() -> None:
    park = spec("park")
    assert register(park) == (park,)  # the same spec again: a module imported twice

    with pytest.raises(ValueError, match="two Lua scripts are named 'park'"):
        register(ScriptSpec("park", store_lua("claim")))


def test_a_keyed_park_runs_park_lua_inside_it_with_its_includes_once() -> None:
    source = script_source("park_keyed")
    park = store_lua("park").read()

    assert source.count("local function zdelay_park()\n" + park + "\nend\n") == 1
    assert source.index(park) < source.index(store_lua("park_keyed").read())
    assert set(script_commands("park")) <= set(script_commands("park_keyed"))


# -- built one way -----------------------------------------------------------------------


def test_every_registered_script_compiles_and_holds_each_of_its_files_once(
    redis_client: redis.Redis,
) -> None:
    # Breaks if: the builder leaves an include out, loads one twice (a
    # script that declares one its inner script has already), or builds
    # Lua that does not compile.
    names = [script.name for script in registered_scripts()]
    assert {"park", "park_keyed", "take_tokens", "define", "park_once", "shift"} <= set(names)
    for script in registered_scripts():
        source = script_source(script.name)
        sha = redis_client.script_load(source)
        assert sha == hashlib.sha1(source.encode()).hexdigest()
        assert redis_client.script_exists(sha) == [True]
        for lua in script.files():
            assert source.count(lua.read()) == 1, (script.name, lua.name)
        assert (GUARD in script.files()) is script.guarded


# -- one park path -------------------------------------------------------------------------


@pytest.fixture
def acl_store(
    redis_server: RedisServer, make_test_app: AppFactory
) -> Iterator[Callable[..., Store]]:
    """Make a Store whose client logs in as an ACL user of the session's Redis with *rules*."""
    stores: list[Store] = []
    with acl_users(redis_server, PASSWORD) as new_user:

        def make(*rules: str) -> Store:
            url = f"redis://{new_user(*rules)}:{PASSWORD}@127.0.0.1:{redis_server.port}/0"
            stores.append(Store(get_config(make_test_app(conf={"zdelay_redis_url": url}))))
            return stores[-1]

        yield make
        for store in stores:
            store.close()


@pytest.mark.redis7  # ACL DRYRUN
def test_a_keyed_park_by_a_user_denied_a_command_it_runs_is_refused_before_it_writes(
    acl_store: Callable[..., Store], redis_server: RedisServer
) -> None:
    # Given a user who may run everything park_keyed.lua runs but ZADD,
    # which it first runs after its first write (park.lua's call marker)
    store = acl_store("~*", "+@all", "-zadd")
    truth = redis_server.client(0)
    at = redis_ms(truth) + HOUR

    # When it parks a task with a key and a tag
    with pytest.raises(StoreRefusedError) as refused:
        store.park([marked_request("keyed", at, "k", "replace", ("t",))])

    # Then the error names the command and the script, and nothing was written
    assert "refuse ZADD, which park_keyed.lua runs" in str(refused.value)
    assert "nothing was written" in str(refused.value)
    assert truth.keys("*") == []
    truth.close()


@pytest.mark.redis7  # ACL DRYRUN
def test_the_keyed_park_is_checked_as_its_own_script_even_after_plain_parks_passed(
    acl_store: Callable[..., Store], redis_server: RedisServer
) -> None:
    # Given a user allowed what both parks run, who parked plainly before
    # (park.lua checked, once per Store)
    store = acl_store("~*", "+@all")
    truth = redis_server.client(0)
    at = redis_ms(truth) + HOUR
    (plain,) = store.park([ParkRequest("plain", Due("a", at), PAYLOAD)])
    assert plain.parked
    assert store._allowed == {"park"}

    # When it parks with a key
    (keyed,) = store.park([marked_request("keyed", at, "k", "keep")])

    # Then park_keyed.lua was checked too before it ran: a pass for park.lua
    # says nothing of another script
    assert keyed.parked
    assert store._allowed == {"park", "park_keyed"}
    truth.close()


@pytest.mark.redis7  # ACL DRYRUN
def test_a_periodic_occurrence_by_a_user_denied_a_command_is_refused_before_its_tick(
    acl_store: Callable[..., Store], redis_server: RedisServer
) -> None:
    # Given a companion user denied SET, which park.lua runs after
    # park_once.lua wrote the tick (an occurrence ticked but not parked is
    # never parked again)
    periodic = PeriodicStore(acl_store("~*", "+@all", "-set"))
    truth = redis_server.client(0)
    at = redis_ms(truth) + HOUR

    # When it parks an occurrence
    with pytest.raises(StoreRefusedError) as refused:
        periodic.park_once(ParkRequest("occurrence", Due("a", at), PAYLOAD), occurrence_ms=at)

    # Then park_once.lua was refused before it ran: no tick, no entry
    assert "refuse SET, which park_once.lua runs" in str(refused.value)
    assert truth.keys("*") == []
    truth.close()
