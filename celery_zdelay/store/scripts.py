"""The store's Lua scripts, one ``.lua`` file per operation, loaded once."""

from __future__ import annotations

from functools import cache
from importlib import resources

from redis.commands.core import Script

from .client import StoreClient

__all__ = ["SCRIPT_NAMES", "Scripts", "script_source"]

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
    "own",
)


#: Scripts that read entries, loaded with the shared reader ``_expand.lua`` in front.
_READERS = ("handoff",)


@cache
def script_source(name: str) -> str:
    """Return the Lua source of script *name*.

    Every script gets the checks of ``_guard.lua`` in front (they run before
    its first write); readers of entries also get ``_expand.lua``.
    """
    source = _lua_file(name)
    if name in _READERS:
        source = _lua_file("_expand") + source
    return _lua_file("_guard") + source


def _lua_file(name: str) -> str:
    return resources.files(__package__).joinpath("lua").joinpath(f"{name}.lua").read_text()


class Scripts:
    """The scripts registered on one client (EVALSHA, loaded on first use)."""

    def __init__(self, client: StoreClient) -> None:
        for name in SCRIPT_NAMES:
            setattr(self, name, client.register_script(script_source(name)))

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
    own: Script
