"""Every Lua script of the package: what each is made of, declared once, and built one way.

A script is one ``.lua`` file per operation (its body) with the libraries it
calls loaded in front of it (its includes), all of it after ``_guard.lua``
and under one ``pcall`` (see :func:`build_source`). Each script says its
includes in its :class:`ScriptSpec`, here for the store's scripts and beside
their own files for the periodic ones (``celery_zdelay/periodic/store.py``)
and the testing fast-forward (``celery_zdelay/testing/fastforward.py``),
which declare them with these types: the store imports nothing of theirs.
:func:`build_source` is the one place that puts Lua together; :class:`Scripts`
loads a set of specs on a client.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from importlib import resources

from redis.commands.core import Script

from .client import StoreClient

__all__ = [
    "EXPAND",
    "GUARD",
    "HISTORY",
    "MARKS",
    "STORE_SCRIPTS",
    "TRANSITIONS",
    "WHERE",
    "LuaFile",
    "ScriptSpec",
    "Scripts",
    "build_source",
    "register",
    "registered_scripts",
    "script_commands",
    "script_source",
    "spec",
    "store_lua",
]

#: The package whose ``lua/`` folder holds the store's scripts.
STORE_PACKAGE = __package__ or "celery_zdelay.store"


@dataclass(frozen=True)
class LuaFile:
    """One ``.lua`` file of a package: a script's body, or a library loaded in front of one."""

    #: The package that holds it, e.g. ``celery_zdelay.store``.
    package: str
    #: Its path inside the package, e.g. ``lua/park.lua``.
    path: str

    @property
    def name(self) -> str:
        """The file name, e.g. ``park.lua``."""
        return self.path.rpartition("/")[2]

    def read(self) -> str:
        """Return the file's text."""
        return _read(self.package, self.path)


def store_lua(name: str) -> LuaFile:
    """Return the store's file ``lua/<name>.lua``."""
    return LuaFile(STORE_PACKAGE, f"lua/{name}.lua")


@dataclass(frozen=True)
class ScriptSpec:
    """One script: its body and the libraries it calls, each named once.

    *calls* and *leads_into* make one script of two, so that two steps are
    one atomic step: the other script's body runs inside this one, and its
    includes come with it (they are not declared again).
    """

    #: The name the store, :func:`script_commands` and ``ensure_allowed`` know it by.
    name: str
    #: The script's own file.
    body: LuaFile
    #: Libraries loaded in front of the body, in this order (after ``_guard.lua``).
    includes: tuple[LuaFile, ...] = ()
    #: A script whose body this one calls as the local function ``zdelay_<its name>()``,
    #: defined in front of this one's body (park_keyed.lua runs park.lua so).
    calls: ScriptSpec | None = None
    #: A script whose body runs right after this one's, as one script
    #: (periodic park_once.lua runs in front of park.lua).
    leads_into: ScriptSpec | None = None
    #: Whether it runs as every store script does: after ``_guard.lua``, its
    #: errors returned as error replies (False: the file as it is).
    guarded: bool = True

    def all_includes(self) -> tuple[LuaFile, ...]:
        """Every library loaded in front of the body, once each, in load order.

        Those of the scripts it runs inside come first, then its own.
        """
        found: list[LuaFile] = []
        for inner in (self.calls, self.leads_into):
            if inner is not None:
                found += inner.all_includes()
        found += self.includes
        # Every script that moves an entry records its history (_history.lua,
        # called by the transitions): loaded in front of the transitions.
        if TRANSITIONS in found and HISTORY not in found:
            found.insert(found.index(TRANSITIONS), HISTORY)
        return tuple(dict.fromkeys(found))

    def files(self) -> tuple[LuaFile, ...]:
        """Every file its source is built from: guard, includes, bodies."""
        bodies: list[LuaFile] = []
        for inner in (self.calls, self.leads_into):
            if inner is not None:
                bodies += inner.files()
        guard = (GUARD,) if self.guarded else ()
        return tuple(dict.fromkeys([*guard, *self.all_includes(), *bodies, self.body]))


#: Loaded in front of every guarded script: the checks each calls before its first write.
GUARD = store_lua("_guard")
#: The key and tag index that leaves with an entry (see store/marks.py).
MARKS = store_lua("_marks")
#: Where an id is now: due, held or in flight.
WHERE = store_lua("_where")
#: The entry reader of the handoff.
EXPAND = store_lua("_expand")
#: The transitions of an entry's state: the only writers of the state keys.
TRANSITIONS = store_lua("_transitions")
#: A task id's history, recorded by the transitions (loaded in front of them).
HISTORY = store_lua("_history")


def _store_script(
    name: str, *includes: LuaFile, calls: ScriptSpec | None = None, guarded: bool = True
) -> ScriptSpec:
    return ScriptSpec(name, store_lua(name), includes, calls=calls, guarded=guarded)


# Every script that moves an entry includes TRANSITIONS: each move is a
# transition written once there, the key and tag index and the template
# counts with it (tests/store/test_transitions_only.py holds the scripts to
# that). Scripts that remove or replace entries include MARKS too, for the
# plan of the index writes (read before the first write). Scripts that ask
# where an id is include WHERE: one answer for all, so none misses a state.
_PARK = _store_script("park", MARKS, WHERE, TRANSITIONS)

#: The store's scripts, one per operation.
STORE_SCRIPTS: tuple[ScriptSpec, ...] = (
    _PARK,
    # park.lua runs inside as a function: a keyed park is one script, one step.
    _store_script("park_keyed", MARKS, WHERE, TRANSITIONS, calls=_PARK),
    # In front of park.lua, in the same script: a message zdelay adopt took
    # from a broker queue is remembered in the step that parks it.
    ScriptSpec("adopt_once", store_lua("adopt_once"), leads_into=_PARK),
    _store_script("claim", TRANSITIONS),
    _store_script("handoff", MARKS, EXPAND, TRANSITIONS),
    _store_script("push", MARKS, TRANSITIONS),
    _store_script("ack", MARKS, TRANSITIONS),
    _store_script("unclaim", TRANSITIONS),
    _store_script("recover", TRANSITIONS),
    _store_script("deadletter", MARKS, TRANSITIONS),
    _store_script("drop_stale", MARKS, TRANSITIONS),
    _store_script("cancel", MARKS, TRANSITIONS),
    _store_script("reschedule", TRANSITIONS),
    _store_script("requeue", MARKS, WHERE, TRANSITIONS),
    _store_script("purge", TRANSITIONS),
    _store_script("own"),
    _store_script("finish_key", MARKS, WHERE, TRANSITIONS),
    _store_script("start_run", MARKS, TRANSITIONS),
    _store_script("drop_key", TRANSITIONS),
    _store_script("take_tokens"),
    _store_script("take_slots"),
    _store_script("hold", TRANSITIONS),
    _store_script("forget_lane", TRANSITIONS),
    # Deletes expired history records (the companion's sweep).
    _store_script("history_sweep"),
    # Asked before a script first runs: it must run whatever the user lacks.
    _store_script("allowed", guarded=False),
)

_registry: dict[str, ScriptSpec] = {}


def register(*specs: ScriptSpec) -> tuple[ScriptSpec, ...]:
    """Register *specs* under their names, and return them.

    A name is one script: registering another spec under a registered name
    raises ValueError (the same spec again is fine, as a module reloaded).
    """
    for item in specs:
        known = _registry.get(item.name)
        if known is not None and known != item:
            raise ValueError(f"two Lua scripts are named {item.name!r}: {known} and {item}")
        _registry[item.name] = item
    return specs


register(*STORE_SCRIPTS)


def spec(name: str) -> ScriptSpec:
    """Return the registered script *name*; raise KeyError when none is."""
    try:
        return _registry[name]
    except KeyError:
        raise KeyError(f"no Lua script is registered as {name!r}") from None


def registered_scripts() -> tuple[ScriptSpec, ...]:
    """Every script registered so far (those of a package once it is imported)."""
    return tuple(_registry.values())


@cache
def script_source(name: str) -> str:
    """Return the Lua source of the registered script *name* (see :func:`build_source`)."""
    return build_source(spec(name))


def build_source(script: ScriptSpec, *, body: str | None = None) -> str:
    """Return the Lua source of *script*: guard, includes, body, under one ``pcall``.

    The one place that puts Lua together. *body*, when given, stands in for
    the text of the script's own file, with the same includes (for the
    benchmarks, which measure an older or a partial body).
    """
    source = "".join(lib.read() for lib in script.all_includes()) + _body(script, body)
    if not script.guarded:
        return source
    return _PCALL_HEAD + GUARD.read() + source + _PCALL_TAIL


def _body(script: ScriptSpec, text: str | None = None) -> str:
    own = script.body.read() if text is None else text
    if script.calls is not None:
        inner = script.calls
        own = f"local function zdelay_{inner.name}()\n{_body(inner)}\nend\n{own}"
    if script.leads_into is not None:
        own += _body(script.leads_into)
    return own


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

    Read from its source (bodies of inner scripts included), so the list
    cannot fall behind the script: the commands of its bodies, and of each
    library function they call, directly or through another (a library such
    as ``_transitions.lua`` holds every script's moves, and a script runs
    only those it calls), and what a library runs as it loads.
    ``redis.pcall`` (the best-effort wake-up) is left out: a refusal there
    fails nothing.
    """
    script = spec(name)
    libraries: dict[str, str] = {}
    # What a library runs as it loads, before its functions (_history.lua
    # takes its arguments off there), runs on every call.
    preambles: list[str] = []
    for lua in script.files():
        if lua.name.startswith("_"):
            text = lua.read()
            libraries.update(_library_functions(text))
            preamble = re.split(r"^local function ", text, maxsplit=1, flags=re.MULTILINE)[0]
            preambles.append(preamble)
    texts = [*preambles, _body(script)]
    seen: set[str] = set()
    found: list[str] = []
    while texts:
        text = texts.pop(0)
        found += _COMMAND.findall(text)
        for called in re.findall(r"\b(zdelay_\w+|periodic_\w+)\(", text):
            if called in libraries and called not in seen:
                seen.add(called)
                texts.append(libraries[called])
    # In the order they appear in the source, once each.
    source = script_source(name)
    wanted = set(found)
    ordered = _COMMAND.findall(source)
    return tuple(dict.fromkeys(command for command in ordered if command in wanted))


# A command a script runs: named in its redis.call, or handed to
# zdelay_t_each (_transitions.lua), which runs it on up to 1000 ids at a time.
_COMMAND = re.compile(r"(?:redis\.call|zdelay_t_each)\('([A-Z]+)'")


def _library_functions(text: str) -> dict[str, str]:
    """Each ``local function`` of a library, by name: its text up to the next one."""
    parts = re.split(r"^local function (\w+)", text, flags=re.MULTILINE)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


@cache
def _read(package: str, path: str) -> str:
    return resources.files(package).joinpath(path).read_text()


class Scripts:
    """Scripts registered on one client (EVALSHA, loaded into Redis on first use).

    The store's own are attributes (``scripts.park``); any registered script
    is ``scripts["define"]`` once loaded with *specs*.
    """

    def __init__(self, client: StoreClient, specs: Iterable[ScriptSpec] = STORE_SCRIPTS) -> None:
        self._loaded: dict[str, Script] = {}
        for item in specs:
            script = client.register_script(script_source(register(item)[0].name))
            self._loaded[item.name] = script
            setattr(self, item.name, script)

    def __getitem__(self, name: str) -> Script:
        return self._loaded[name]

    park: Script
    park_keyed: Script
    adopt_once: Script
    claim: Script
    handoff: Script
    push: Script
    ack: Script
    unclaim: Script
    recover: Script
    deadletter: Script
    drop_stale: Script
    cancel: Script
    reschedule: Script
    requeue: Script
    purge: Script
    own: Script
    finish_key: Script
    start_run: Script
    drop_key: Script
    take_tokens: Script
    take_slots: Script
    hold: Script
    forget_lane: Script
    history_sweep: Script
    #: Asks which command of a script the user may not run (``allowed.lua``).
    allowed: Script
