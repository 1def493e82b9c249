"""Given every Lua script of the package, the state keys are written only by the transitions.

An entry's state (due, held, in flight, dead, and the key and tag index and
template counts that go with it) changes only inside the functions of
``celery_zdelay/store/lua/_transitions.lua``: each move written once, used
by every script that makes it. A script that writes a state key itself is
where the next defect of issue 33's kind would be (a move that forgets a
state another feature added), so this test reads every registered script's
files and fails on any write command outside the library, except the
writes listed below, each on a key that is not an entry's state, with why.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import celery_zdelay.periodic.store
import celery_zdelay.redis_plus
import celery_zdelay.testing.fastforward
from celery_zdelay.store.scripts import TRANSITIONS, LuaFile, registered_scripts, script_commands

pytestmark = pytest.mark.timeout(60)

# Imported for the scripts they register (the store knows nothing of them).
assert celery_zdelay.periodic.store.PERIODIC_SCRIPTS
assert celery_zdelay.testing.fastforward.SHIFT

#: Every Redis command that writes (of those a script could use on a key).
WRITES = frozenset(
    {
        "APPEND",
        "DECR",
        "DECRBY",
        "DEL",
        "EXPIRE",
        "GETDEL",
        "GETSET",
        "HDEL",
        "HINCRBY",
        "HINCRBYFLOAT",
        "HMSET",
        "HSET",
        "HSETNX",
        "INCR",
        "INCRBY",
        "LINSERT",
        "LMOVE",
        "LPOP",
        "LPUSH",
        "LREM",
        "LSET",
        "LTRIM",
        "PERSIST",
        "PEXPIRE",
        "PEXPIREAT",
        "PSETEX",
        "RENAME",
        "RPOP",
        "RPUSH",
        "SADD",
        "SET",
        "SETEX",
        "SETNX",
        "SINTERSTORE",
        "SMOVE",
        "SPOP",
        "SREM",
        "SUNIONSTORE",
        "UNLINK",
        "ZADD",
        "ZINCRBY",
        "ZPOPMAX",
        "ZPOPMIN",
        "ZREM",
        "ZREMRANGEBYLEX",
        "ZREMRANGEBYRANK",
        "ZREMRANGEBYSCORE",
        "ZUNIONSTORE",
    }
)

_COUNTER = "the tags counter: claim tokens and delivery tags, no entry's state"
_BROKER = "a kombu queue list: the message leaves the store here (its entry's move is a transition)"
_PERIODIC = "the periodic schedule's own record, not a parked entry's"
_ADOPTED = (
    "the broker messages zdelay adopt parked, remembered so a redelivered one is not parked again"
)
_HISTORY = "a task id's history: a record of its transitions, written by them, never read by one"

#: (file, command, the key as the script names it) -> why it is no entry's state.
_REDIS_PLUS = "celery-redis-plus's keys in the broker's Redis (zdelay adopt --redis-plus)"
ALLOWED: dict[tuple[str, str, str], str] = {
    ("park.lua", "SADD", "dests"): "the handoff's destination set: where entries may go",
    ("park.lua", "SET", "marker"): "the call marker that makes a retried park a no-op",
    ("park_keyed.lua", "SET", "kmarker"): "the call marker of a keyed park (its answer)",
    ("claim.lua", "INCR", "tags"): _COUNTER,
    ("handoff.lua", "INCRBY", "tags"): _COUNTER,
    ("handoff.lua", "INCR", "tags"): _COUNTER,
    ("handoff.lua", "LPUSH", "dest"): _BROKER,
    ("push.lua", "INCRBY", "tags"): _COUNTER,
    ("push.lua", "LPUSH", "item[1]"): _BROKER,
    ("own.lua", "SET", "owner"): "a shard's ownership lease, held by a companion",
    ("own.lua", "DEL", "owner"): "a shard's ownership lease, given up",
    ("take_tokens.lua", "HSET", "bucket"): "a rate limit's token bucket",
    ("take_tokens.lua", "PEXPIRE", "bucket"): "a rate limit's token bucket",
    ("take_slots.lua", "ZREMRANGEBYSCORE", "slots"): "a concurrency control's slots",
    ("take_slots.lua", "ZADD", "slots"): "a concurrency control's slots",
    ("take_slots.lua", "PEXPIREAT", "slots"): "a concurrency control's slots",
    ("define.lua", "HSET", "meta"): _PERIODIC,
    ("define.lua", "HINCRBY", "meta"): _PERIODIC,
    ("define.lua", "SADD", "cancel"): "the periodic cancel set: ids every companion cancels "
    "where they are held (through cancel.lua)",
    ("define.lua", "HDEL", "defs"): _PERIODIC,
    ("define.lua", "HDEL", "pointers"): _PERIODIC,
    ("define.lua", "SREM", "paused"): _PERIODIC,
    ("define.lua", "HINCRBY", "versions"): _PERIODIC,
    ("define.lua", "HSET", "defs"): _PERIODIC,
    ("define.lua", "HSET", "pointers"): _PERIODIC,
    ("define.lua", "SADD", "superseded"): _PERIODIC,
    ("define.lua", "SREM", "superseded"): _PERIODIC,
    ("advance.lua", "HINCRBY", "counts"): _PERIODIC,
    ("advance.lua", "ZADD", "missed_ids"): _PERIODIC,
    ("advance.lua", "ZREMRANGEBYRANK", "missed_ids"): _PERIODIC,
    ("advance.lua", "HSET", "pointers"): _PERIODIC,
    ("pause.lua", "SADD", "paused"): _PERIODIC,
    ("pause.lua", "SADD", "cancel"): "the periodic cancel set (see define.lua)",
    ("pause.lua", "SREM", "paused"): _PERIODIC,
    ("pause.lua", "HINCRBY", "versions"): _PERIODIC,
    ("pause.lua", "HSET", "pointers"): _PERIODIC,
    ("park_once.lua", "ZREMRANGEBYSCORE", "once_ticks"): "the ticks a schedule parked (periodic)",
    ("park_once.lua", "ZADD", "once_ticks"): "the ticks a schedule parked (periodic)",
    ("park_once.lua", "HSET", "once_pointers"): _PERIODIC,
    ("record_runs.lua", "HSET", "runs"): _PERIODIC,
    ("adopt_once.lua", "ZREMRANGEBYSCORE", "adopt_set"): _ADOPTED,
    ("adopt_once.lua", "ZADD", "adopt_set"): _ADOPTED,
    # The planner's index of when each schedule is next worth a look
    # (periodic/lua/_pointer.lua): schedules, not entries.
    ("define.lua", "ZADD", "visits"): _PERIODIC,
    ("define.lua", "ZREM", "visits"): _PERIODIC,
    ("advance.lua", "ZADD", "visits"): _PERIODIC,
    ("pause.lua", "ZADD", "visits"): _PERIODIC,
    ("pause.lua", "ZREM", "visits"): _PERIODIC,
    ("record_runs.lua", "ZADD", "visits"): _PERIODIC,
    ("revisit.lua", "HSET", "pointers"): _PERIODIC,
    ("revisit.lua", "ZADD", "visits"): _PERIODIC,
    ("revisit.lua", "ZREM", "visits"): _PERIODIC,
    ("defer.lua", "HSET", "pointers"): _PERIODIC,
    ("defer.lua", "ZADD", "visits"): _PERIODIC,
    # A task id's history (lua/_history.lua, called by the transitions):
    # what happened to an id, kept after it is gone; no entry's state.
    ("_history.lua", "HSET", "hist"): _HISTORY,
    ("history_sweep.lua", "HDEL", "hist"): _HISTORY,
    # zdelay adopt --redis-plus: celery-redis-plus's own keys in the broker's
    # Redis, a message taken out once its copy is parked; no entry of the store.
    ("redis_plus_take.lua", "ZREM", "KEYS[1]"): _REDIS_PLUS,
    ("redis_plus_take.lua", "ZREM", "KEYS[2]"): _REDIS_PLUS,
    ("redis_plus_take.lua", "DEL", "KEYS[3]"): _REDIS_PLUS,
    ("shift.lua", "ZADD", "due"): "celery_zdelay.testing's fast-forward, in tests only: every "
    "due score moves earlier at once, nothing changes state",
    ("shift.lua", "HSET", "marks"): "celery_zdelay.testing's fast-forward, in tests only: a "
    "debounce's burst start (its record's f field) moves earlier with the due times; no key, "
    "tag or state changes",
}

_CALL = re.compile(r"redis\.p?call\(\s*('([A-Z]+)'|[^,)]*)\s*(?:,\s*([^,)]+))?")


def _files() -> list[LuaFile]:
    found: dict[LuaFile, None] = {}
    for script in registered_scripts():
        for lua in script.files():
            found[lua] = None
    return list(found)


def _writes(lua: LuaFile) -> list[tuple[str, str, str]]:
    """(file, command, first key) of each redis.call that writes (or names no command)."""
    found = []
    for match in _CALL.finditer(lua.read()):
        command = match.group(2) or f"<{match.group(1).strip()}>"
        if command in WRITES or command.startswith("<"):
            found.append((lua.name, command, (match.group(3) or "").strip()))
    return found


def test_no_script_writes_an_entry_state_outside_the_transitions() -> None:
    # Breaks if: a script gets back a ZREM of the due set or an HDEL of the
    # msg hash (say, cancel.lua removing an entry itself, missing the held
    # sets or the marks), or calls redis.call with a command in a variable.
    outside = [write for lua in _files() if lua != TRANSITIONS for write in _writes(lua)]
    unexplained = sorted(set(outside) - set(ALLOWED))

    assert unexplained == []


def test_every_allowed_write_is_still_there() -> None:
    # An allow-list entry whose write is gone would let the same write come
    # back unseen: the list holds exactly what the scripts do.
    outside = {write for lua in _files() if lua != TRANSITIONS for write in _writes(lua)}

    assert set(ALLOWED) - outside == set()


def test_the_library_writes_the_state_and_every_transition_is_used() -> None:
    # The library is where the writes are, and each transition of it is
    # called by some script: a transition no script uses is one a script
    # makes on its own.
    library = TRANSITIONS.read()
    functions = re.findall(r"^local function (zdelay_t_\w+)", library, flags=re.MULTILINE)
    bodies = "".join(lua.read() for lua in _files() if lua != TRANSITIONS)

    assert {command for _, command, _ in _writes(TRANSITIONS)} >= {
        "ZADD",
        "ZREM",
        "HDEL",
        "HSET",
        "HSETNX",
        "SADD",
        "SREM",
        "ZREMRANGEBYRANK",
    }
    unused = [
        name
        for name in functions
        if name != "zdelay_t_each" and not re.search(rf"\b{name}\(", bodies)
    ]
    assert unused == []


def test_every_transition_is_named_in_the_table_of_the_docs() -> None:
    # docs/how-it-works.rst names each transition, so a new one is documented.
    docs = (Path(__file__).resolve().parents[2] / "docs" / "how-it-works.rst").read_text()
    functions = re.findall(
        r"^local function (zdelay_t_\w+)", TRANSITIONS.read(), flags=re.MULTILINE
    )
    missing = [name for name in functions if name != "zdelay_t_each" and name not in docs]

    assert missing == []


def test_the_acl_pre_check_names_the_commands_of_the_transitions_a_script_calls() -> None:
    # Breaks if: script_commands misses a command a transition hands to
    # zdelay_t_each (ack's ZREM of the lease: a user without ZREM would be
    # let through the pre-check and refused halfway), or counts those of a
    # transition the script never calls (park does not claim).
    assert {"ZREM", "HDEL", "HSET"} <= set(script_commands("ack"))
    assert {"ZREM", "HDEL", "LPUSH"} <= set(script_commands("push"))
    assert {"ZREMRANGEBYRANK", "ZADD", "HDEL", "LPUSH"} <= set(script_commands("handoff"))
    assert "ZREMRANGEBYRANK" not in script_commands("park")
    assert "SREM" not in script_commands("hold")
