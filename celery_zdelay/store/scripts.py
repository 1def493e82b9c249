"""The store's Lua scripts, one ``.lua`` file per operation, loaded once."""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

from redis.commands.core import Script

from .client import StoreClient

__all__ = [
    "SCRIPT_NAMES",
    "Scripts",
    "guarded",
    "reader_source",
    "script_commands",
    "script_source",
]

#: Every operation of the store that runs as a script.
SCRIPT_NAMES = (
    "park",
    "claim",
    "handoff",
    "push",
    "ack",
    "unclaim",
    "recover",
    "deadletter",
    "cancel",
    "reschedule",
    "requeue",
    "purge",
    "own",
)


#: Scripts that read entries, loaded with the shared reader ``_expand.lua`` in front.
_READERS = ("handoff",)
#: Scripts that remove or replace entries, loaded with ``_marks.lua`` in
#: front: an entry's key and tags leave in the script that removes it, and
#: those of an id parked again (park.lua) in the script that parks it.
_MARKED = ("park", "handoff", "push", "ack", "deadletter", "cancel", "requeue")
#: Scripts that ask where an id is now (due, held, in flight), loaded with
#: ``_where.lua`` in front: one answer for all, so none misses a state.
_LOCATING = ("park", "requeue")


@cache
def script_source(name: str, before: str = "") -> str:
    """Return the Lua source of script *name*, with the Lua *before* run in front of it.

    Every script gets the checks of ``_guard.lua`` in front (they run before
    its first write); readers of entries also get ``_expand.lua``, scripts
    that remove or replace entries ``_marks.lua``, and those that ask where an id is
    ``_where.lua``.
    """
    if name in _LOCATING:
        before = _lua_file("_where") + before
    if name in _MARKED:
        before = _lua_file("_marks") + before
    if name in _READERS:
        return reader_source(_lua_file(name), before)
    return guarded(before + _lua_file(name))


def reader_source(body: str, before: str = "") -> str:
    """Return Lua *body* with the entry reader ``_expand.lua`` in front, as handoff.lua runs.

    Also for measuring the reader alone (``python -m benchmarks --only limit``).
    """
    return guarded(before + _lua_file("_expand") + body)


def guarded(source: str) -> str:
    """Return Lua *source* as every store script runs: after ``_guard.lua``, errors as replies.

    For scripts kept elsewhere (the periodic ones): they call the same
    checks before their first write.
    """
    return _PCALL_HEAD + _lua_file("_guard") + source + _PCALL_TAIL


# The whole script runs under pcall and returns its error as an error reply:
# Redis 6.2 cannot raise a table ({err = ...} became "attempt to concatenate
# a table value"), and raises a failed redis.call as "ERR Error running
# script ... WRONGTYPE ...". Either way the client now gets the same reply,
# with the same first word, on Redis 6.2, Redis 7 and Valkey.
_PCALL_HEAD = "local zdelay_ok, zdelay_result = pcall(function()\n"
_PCALL_TAIL = """
end)
if zdelay_ok then return zdelay_result end
if type(zdelay_result) == 'table' then return zdelay_result end
return redis.error_reply(tostring(zdelay_result))
"""


@cache
def script_commands(name: str) -> tuple[str, ...]:
    """Return the commands script *name* may call with ``redis.call``, in order, once each.

    Read from its source (checks and readers included), so the list cannot
    fall behind the script. ``redis.pcall`` (the best-effort wake-up) is
    left out: a refusal there fails nothing.
    """
    found = re.findall(r"redis\.call\('([A-Z]+)'", script_source(name))
    return tuple(dict.fromkeys(found))


def _lua_file(name: str) -> str:
    return resources.files(__package__).joinpath("lua").joinpath(f"{name}.lua").read_text()


class Scripts:
    """The scripts registered on one client (EVALSHA, loaded on first use)."""

    def __init__(self, client: StoreClient) -> None:
        for name in SCRIPT_NAMES:
            setattr(self, name, client.register_script(script_source(name)))
        self.allowed = client.register_script(_lua_file("allowed"))

    park: Script
    claim: Script
    handoff: Script
    push: Script
    ack: Script
    unclaim: Script
    recover: Script
    deadletter: Script
    cancel: Script
    reschedule: Script
    requeue: Script
    purge: Script
    own: Script
    #: Asks which command of a script the user may not run (``allowed.lua``).
    allowed: Script
