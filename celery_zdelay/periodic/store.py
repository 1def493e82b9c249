"""Where periodic schedules live in Redis: definitions, pointers, pause state.

Every key shares the hash tag ``{<prefix>:periodic}``, so each script here
runs in one slot of a Redis Cluster. Occurrences themselves are ordinary
parked entries on their own shards; :meth:`PeriodicStore.park_once` parks
one only the first time anybody parks it (``park_once.lua`` in front of
the store's ``park.lua``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from ..store import ParkRequest, Store
from ..store.client import store_errors
from ..store.redis_keys import held_set_key, lanes_key, periodic_keys
from ..store.scripts import TRANSITIONS, LuaFile, Scripts, ScriptSpec, register, spec
from .definition import Definition, schedule_name
from .recent import Recent

__all__ = [
    "COUNTERS",
    "PERIODIC_SCRIPTS",
    "WAITING_DUE",
    "WAITING_HELD",
    "PeriodicStore",
    "Pointer",
    "Snapshot",
    "next_visit_ms",
]

#: Where an occurrence waits (see :meth:`PeriodicStore.waiting_among`).
WAITING_DUE = "due"
WAITING_HELD = "held"

#: The kind ``define.lua`` names an occurrence it took back by (beside
#: "new", "changed", "removed", "relabelled" schedules).
WITHDRAWN = "withdrawn"
#: Ticks counted per schedule: ``missed`` (due while no companion or broker
#: served it, left out by ``zdelay_missed``), ``skipped_overlap`` (released
#: while the previous run was unfinished, skipped by ``zdelay_overlap``),
#: ``late`` (released more than :data:`LATE_MS` after its time).
COUNTERS = ("missed", "skipped_overlap", "late")
#: A tick released later than this after its time (its jitter offset
#: included) counts as run late.
LATE_MS = 1_000

#: Definitions a pass keeps decoded (:meth:`PeriodicStore.view`): about
#: 18 MB (a crontab row's took 1.8 KB); others are decoded again when
#: visited (once per occurrence).
DEFINITIONS_KEPT = 10_000
#: Ids of parked occurrences are remembered this long after their time, so
#: a change, removal or pause can still cancel them.
REMEMBER_PARKED_MS = 60_000
#: How long ``park_once`` remembers an occurrence it parked (ms since it was
#: parked): no occurrence is parked twice within this time, so a companion
#: that stalls between reading a pointer and parking what follows it (GC,
#: swap, a frozen VM) for less than this cannot run a tick again.
TICK_MEMORY_MS = 3_600_000
#: Names per ``revisit.lua`` call when the visits zset is built again (a
#: call then costs Redis about a millisecond), and per ``defer.lua`` call.
REVISIT_BATCH = 500


@dataclass(frozen=True)
class Pointer:
    """Where one schedule stands: its version and what was parked last."""

    version: int
    #: Newest occurrence parked (or, before the first, the anchor time).
    ms: int
    #: (occurrence ms, id) of occurrences parked lately.
    parked: list[tuple[int, str]]
    #: Whether *ms* is itself an occurrence still to run (a tick that was
    #: due and waiting when the definition changed runs under the new one).
    inclusive: bool = False
    #: Occurrences parked under this definition so far (for ``zdelay_max_runs``).
    runs: int = 0
    #: Put off until then by a planner (``defer.lua``): its next occurrence,
    #: :attr:`next_ms`, was further ahead than it parks.
    wake_ms: int | None = None
    next_ms: int | None = None

    @classmethod
    def from_json(cls, raw: str | bytes) -> Pointer:
        """Read a stored pointer; raise ValueError (or KeyError, TypeError) if it cannot be.

        Whatever else wrote the field: :meth:`PeriodicStore.snapshot` leaves
        out a pointer it cannot read, as the scripts do (``_pointer.lua``).
        """
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError(f"a pointer is a JSON object, not {raw!r}")
        ids = data.get("ids")
        if isinstance(ids, list) and not all(isinstance(p, list) and len(p) >= 2 for p in ids):
            raise ValueError(f"a pointer lists [ms, id] pairs, not {ids!r}")
        parked = [(int(p[0]), str(p[1])) for p in ids] if isinstance(ids, list) else []
        return cls(
            version=int(data["v"]),
            ms=int(data["ms"]),
            parked=parked,
            inclusive=data.get("incl") is True,
            runs=int(data.get("n") or 0),
            wake_ms=_ms_or_none(data.get("wake")),
            next_ms=_ms_or_none(data.get("next")),
        )


def _ms_or_none(value: Any) -> int | None:
    """A stored time as the scripts read it (a JSON number), else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    return None


def next_visit_ms(pointer: Pointer | None, last_run_ms: int) -> float:
    """The score a schedule has in the visits zset (``periodic_next_visit`` in ``_pointer.lua``).

    Its pointer's ms, or the earliest occurrence parked after *last_run_ms*
    (the last run recorded), if earlier; when none is parked after it, the
    time a planner put its next look off to (:attr:`Pointer.wake_ms`), if
    later. Infinity without a pointer.
    """
    if pointer is None:
        return math.inf
    waiting = [ms for ms, _ in pointer.parked if ms > last_run_ms]
    at = min([pointer.ms, *waiting])
    if not waiting and pointer.wake_ms is not None and pointer.wake_ms > at:
        return pointer.wake_ms
    return at


@dataclass
class Snapshot:
    """What a reader needs of the schedules: all, or those due (see ``PeriodicStore.view``)."""

    now_ms: int
    definitions: dict[str, Definition] = field(default_factory=dict)
    #: Stored definitions that could not be read: name -> error.
    unreadable: dict[str, str] = field(default_factory=dict)
    pointers: dict[str, Pointer] = field(default_factory=dict)
    paused: set[str] = field(default_factory=set)
    to_cancel: list[str] = field(default_factory=list)
    #: The stored configuration: hash, written_by, written_ms.
    meta: dict[str, str] = field(default_factory=dict)
    #: name -> (occurrence ms, lateness ms) of the last occurrence released.
    runs: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: name -> task id of the last occurrence released.
    last_ids: dict[str, str] = field(default_factory=dict)
    #: name -> {counter: ticks} (see :data:`COUNTERS`).
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    #: name -> [(occurrence ms, id)] of occurrences found held back by a
    #: pause or a rate limit (see :meth:`PeriodicStore.note_held`).
    held: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    #: name -> score in the visits zset, of the schedules a planner pass
    #: looks at (:meth:`PeriodicStore.view`; empty from :meth:`PeriodicStore.snapshot`).
    visits: dict[str, float] = field(default_factory=dict)


def _lua(name: str) -> LuaFile:
    return LuaFile(__package__ or "celery_zdelay.periodic", f"lua/{name}.lua")


#: Reading a schedule's pointer, and taking its occurrences back from the shards.
_POINTER, _WITHDRAW = _lua("_pointer"), _lua("_withdraw")

#: The periodic scripts (declared with the store's registry: see store/scripts.py).
PERIODIC_SCRIPTS = register(
    ScriptSpec("define", _lua("define"), (_POINTER, TRANSITIONS, _WITHDRAW)),
    ScriptSpec("advance", _lua("advance"), (_POINTER,)),
    ScriptSpec("pause", _lua("pause"), (_POINTER, TRANSITIONS, _WITHDRAW)),
    # In front of the store's park.lua, in the same script: checked and
    # remembered in the step that parks.
    ScriptSpec("park_once", _lua("park_once"), leads_into=spec("park")),
    ScriptSpec("record_runs", _lua("record_runs"), (_POINTER,)),
    ScriptSpec("revisit", _lua("revisit"), (_POINTER,)),
    ScriptSpec("defer", _lua("defer"), (_POINTER,)),
)


class PeriodicStore:
    """The periodic schedules of one store.

    *on_withdrawn* is called with the ids of the occurrences a change, a
    removal or a pause took back before they ran (in the script that makes
    the change, or later from the cancel set), once each: their owner
    records them as every cancel is (``REVOKED``, ``task-revoked``, the
    audit line; :func:`celery_zdelay.steering.announce_cancelled`).
    """

    def __init__(
        self, store: Store, *, on_withdrawn: Callable[[list[str]], None] | None = None
    ) -> None:
        self.store = store
        self.on_withdrawn = on_withdrawn
        self.keys = periodic_keys(store.config.key_prefix)
        # Each runs after the store's checks (_guard.lua), which it calls
        # before its first write.
        scripts = Scripts(store.client, PERIODIC_SCRIPTS)
        self._define = scripts["define"]
        self._advance = scripts["advance"]
        self._pause = scripts["pause"]
        self._park_once = scripts["park_once"]
        self._record_runs = scripts["record_runs"]
        self._revisit = scripts["revisit"]
        self._defer = scripts["defer"]
        #: name -> (stored body, its Definition) of the DEFINITIONS_KEPT read
        #: last: a body read again soon is not decoded again.
        self._decoded: Recent[str, tuple[bytes, Definition]] = Recent(DEFINITIONS_KEPT)
        #: The configuration last stored or found stored (see :meth:`store_config`).
        self._stored_config: _StoredConfig | None = None
        #: See :data:`TICK_MEMORY_MS`.
        self.tick_memory_ms = TICK_MEMORY_MS
        #: See :data:`REMEMBER_PARKED_MS`.
        self.remember_parked_ms = REMEMBER_PARKED_MS

    def _shard_keys(self) -> list[str]:
        """The keys a change withdraws occurrences from, in the same script (see _withdraw.lua).

        None on a Redis Cluster: its shards are other slots than the
        schedules', so the change lists them in the cancel set and the
        caller cancels them on each shard before it returns.
        """
        if self.store.cluster:
            return []
        keys: list[str] = []
        for shard in self.store.shards:
            k = self.store.keys(shard)
            keys += [k.due, k.msg, k.lease, k.leased, k.templates]
        return keys

    # -- reading ------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """Read definitions, pointers, pause state and pending cancels at once."""
        k = self.keys
        with store_errors(self.store.url):
            with self.store.client.pipeline(transaction=False) as pipe:
                pipe.hgetall(k.defs)
                pipe.hgetall(k.pointers)
                pipe.smembers(k.paused)
                pipe.smembers(k.cancel)
                pipe.hgetall(k.meta)
                pipe.hgetall(k.runs)
                pipe.hgetall(k.counts)
                pipe.zrange(k.held, 0, -1, withscores=True)
                defs, pointers, paused, cancel, meta, runs, counts, held = pipe.execute()
            seconds, micros = self.store.client.time()
        snap = Snapshot(now_ms=int(seconds) * 1000 + int(micros) // 1000)
        for raw_name, body in defs.items():
            name = _text(raw_name)
            try:
                snap.definitions[name] = Definition.from_body(name, body)
            except (ValueError, KeyError, TypeError) as exc:
                snap.unreadable[name] = repr(exc)
        for raw_name, raw in pointers.items():
            try:
                snap.pointers[_text(raw_name)] = Pointer.from_json(raw)
            except (ValueError, KeyError, TypeError):
                continue
        snap.paused = {_text(n) for n in paused}
        snap.to_cancel = sorted(_text(i) for i in cancel)
        snap.meta = {_text(a): _text(b) for a, b in meta.items()}
        for raw_name, raw in runs.items():
            _read_run(snap, _text(raw_name), raw)
        for raw_member, ms in held:
            name, _, task_id = _text(raw_member).partition("\n")
            snap.held.setdefault(name, []).append((int(ms), task_id))
        for raw_field, raw_count in counts.items():
            name, _, counter = _text(raw_field).partition("\n")
            try:
                snap.counts.setdefault(name, {})[counter] = int(raw_count)
            except ValueError:
                continue
        return snap

    def stored_name(self, name: str) -> str | None:
        """Return the name of the stored schedule *name* designates, or None.

        *name* is a schedule's own name, or the name people know it by (a
        django-celery-beat row's name in the admin, "Every ten seconds"),
        which designates the schedule its spaces become
        (:func:`~.definition.schedule_name`: ``Every_ten_seconds``) when
        that one is stored under it. One round trip, whatever is stored.
        """
        candidate = schedule_name(name)
        with store_errors(self.store.url):
            own, other = self.store.client.hmget(self.keys.defs, [name, candidate])
        if own is not None:
            return name
        if other is None or candidate == name:
            return None
        try:
            shown = Definition.from_body(candidate, other).display_name
        except (ValueError, KeyError, TypeError):
            return None
        # Spaces as typed or pasted: the same words are the same name.
        return candidate if shown is not None and shown.split() == name.split() else None

    def overview(self, first: int) -> tuple[int, int, list[str]]:
        """How many schedules are stored and paused, and the names of the *first* to run.

        Three small reads whatever is stored: ``HLEN`` of the definitions,
        ``SCARD`` of the paused set, and the head of the visits zset (the
        schedules not paused, soonest visit first). What ``zdelay status``
        shows of a store with more schedules than it lists.
        """
        k = self.keys
        with store_errors(self.store.url), self.store.client.pipeline(transaction=False) as pipe:
            pipe.hlen(k.defs)
            pipe.scard(k.paused)
            pipe.zrange(k.visits, 0, max(first, 1) - 1)
            stored, paused, names = pipe.execute()
        return int(stored), int(paused), [_text(n) for n in names][:first]

    def snapshot_of(self, names: Sequence[str]) -> Snapshot:
        """Read what :meth:`snapshot` reads, for the schedules *names* only.

        Costs what it reads (``HMGET`` and one ``SISMEMBER`` per name), not
        what is stored. Names not stored are left out.
        """
        k = self.keys
        fields = [f"{name}\n{counter}" for name in names for counter in COUNTERS]
        with store_errors(self.store.url):
            seconds, micros = self.store.client.time()
            if not names:
                return Snapshot(now_ms=int(seconds) * 1000 + int(micros) // 1000)
            with self.store.client.pipeline(transaction=False) as pipe:
                pipe.hmget(k.defs, names)
                pipe.hmget(k.pointers, names)
                pipe.hmget(k.runs, names)
                pipe.hmget(k.counts, fields)
                for name in names:
                    pipe.sismember(k.paused, name)
                defs, pointers, runs, counts, *paused = pipe.execute()
        snap = Snapshot(now_ms=int(seconds) * 1000 + int(micros) // 1000)
        self._read_schedules(snap, names, defs, pointers, runs, paused)
        for field_name, raw_count in zip(fields, counts, strict=True):
            name, _, counter = field_name.partition("\n")
            if raw_count is not None and name in snap.definitions:
                with contextlib.suppress(ValueError):
                    snap.counts.setdefault(name, {})[counter] = int(raw_count)
        return snap

    def view(self, horizon_ms: int) -> Snapshot:
        """Read what one planner pass needs: the schedules due, not every schedule.

        Those whose score in the visits zset is at most now + *horizon_ms*
        (a pointer to plan from, or an occurrence parked and not recorded
        as run), and those with occurrences held back (the held zset, read
        whole: it holds what a pause or a rate limit holds, not every
        schedule). Their definitions, pointers, runs and pause state are
        read in one transaction, so a definition and its pointer are of
        one version. Costs what is due and held, whatever else is stored.
        ``counts`` are not read (nothing plans from them).
        """
        k = self.keys
        client = self.store.client
        with store_errors(self.store.url):
            seconds, micros = client.time()
            now_ms = int(seconds) * 1000 + int(micros) // 1000
            with client.pipeline(transaction=False) as pipe:
                pipe.zrangebyscore(k.visits, "-inf", now_ms + horizon_ms, withscores=True)
                pipe.smembers(k.cancel)
                pipe.hmget(k.meta, _META_FIELDS)
                pipe.zrange(k.held, 0, -1, withscores=True)
                visits, cancel, meta, held = pipe.execute()
            snap = Snapshot(now_ms=now_ms)
            snap.visits = {_text(name): float(score) for name, score in visits}
            snap.to_cancel = sorted(_text(i) for i in cancel)
            snap.meta = {f: _text(v) for f, v in zip(_META_FIELDS, meta, strict=True) if v}
            for raw_member, ms in held:
                name, _, task_id = _text(raw_member).partition("\n")
                snap.held.setdefault(name, []).append((int(ms), task_id))
            names = sorted(set(snap.visits) | set(snap.held))
            if not names:
                return snap
            # A transaction, so a definition and its pointer are of one
            # version (not on a Redis Cluster store: redis-py before 6 refuses
            # one there, and a pass reads them as it did before, apart).
            with client.pipeline(transaction=not self.store.cluster) as pipe:
                pipe.hmget(k.defs, names)
                pipe.hmget(k.pointers, names)
                pipe.hmget(k.runs, names)
                for name in names:
                    pipe.sismember(k.paused, name)
                defs, pointers, runs, *paused = pipe.execute()
        self._read_schedules(snap, names, defs, pointers, runs, paused)
        return snap

    def _read_schedules(
        self,
        snap: Snapshot,
        names: Sequence[str],
        defs: Sequence[Any],
        pointers: Sequence[Any],
        runs: Sequence[Any],
        paused: Sequence[Any],
    ) -> None:
        """Add what was read of each of *names* (the replies of HMGET and SISMEMBER) to *snap*."""
        for name, body, pointer, run, is_paused in zip(
            names, defs, pointers, runs, paused, strict=True
        ):
            if is_paused:
                snap.paused.add(name)
            if body is None:
                self._decoded.pop(name)
            else:
                self._read_definition(snap, name, body)
            if pointer is not None:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    snap.pointers[name] = Pointer.from_json(pointer)
            if run is not None:
                _read_run(snap, name, run)

    def _read_definition(self, snap: Snapshot, name: str, body: bytes | str) -> None:
        raw = body.encode() if isinstance(body, str) else body
        cached = self._decoded.get(name)
        if cached is not None and cached[0] == raw:
            snap.definitions[name] = cached[1]
            return
        try:
            definition = Definition.from_body(name, raw)
        except (ValueError, KeyError, TypeError) as exc:
            snap.unreadable[name] = repr(exc)
            return
        self._decoded.put(name, (raw, definition))
        snap.definitions[name] = definition

    def visits_complete(self) -> bool:
        """Whether the visits zset holds as many names as there are schedules not paused.

        Three counts. Not so when the store was written by a release without
        the zset, or something removed it: :meth:`revisit_all` builds it.
        """
        k = self.keys
        client = self.store.client
        with (
            store_errors(self.store.url),
            client.pipeline(transaction=not self.store.cluster) as pipe,
        ):
            pipe.zcard(k.visits)
            pipe.hlen(k.defs)
            pipe.scard(k.paused)
            visits, defs, paused = pipe.execute()
        return int(visits) == int(defs) - int(paused)

    def revisit_all(self) -> int:
        """Put every schedule in the visits zset as its state says; return how many are in it.

        Reads every name once (``HKEYS``), then ``revisit.lua`` in batches
        of :data:`REVISIT_BATCH`: for a starting companion whose store lacks
        the zset, not for a pass.
        """
        k = self.keys
        with store_errors(self.store.url):
            seconds, micros = self.store.client.time()
            now_ms = int(seconds) * 1000 + int(micros) // 1000
            names = {_text(n) for n in self.store.client.hkeys(k.defs)}
            names |= {_text(n) for n in self.store.client.zrange(k.visits, 0, -1)}
        ordered = sorted(names)
        listed = 0
        for at in range(0, len(ordered), REVISIT_BATCH):
            listed += self.revisit(ordered[at : at + REVISIT_BATCH], now_ms)
        return listed

    def revisit(self, names: Sequence[str], now_ms: int) -> int:
        """Score *names* in the visits zset from their stored state (``revisit.lua``)."""
        if not names:
            return 0
        k = self.keys
        with store_errors(self.store.url):
            return int(
                self._revisit(
                    keys=[k.defs, k.pointers, k.paused, k.runs, k.visits],
                    args=[now_ms - self.remember_parked_ms, *names],
                )
            )

    def defer(self, plans: Sequence[tuple[str, Pointer, int, int]]) -> int:
        """Put off the next look at schedules: (name, pointer read, wake ms, next ms) each.

        ``defer.lua``, in batches of :data:`REVISIT_BATCH`: one whose pointer
        is no longer the one read (changed, advanced, paused, removed) is
        left as it is. Returns how many were put off.
        """
        k = self.keys
        done = 0
        with store_errors(self.store.url):
            for at in range(0, len(plans), REVISIT_BATCH):
                args: list[Any] = []
                for name, pointer, wake_ms, next_ms in plans[at : at + REVISIT_BATCH]:
                    args += [name, pointer.version, pointer.ms, wake_ms, next_ms]
                done += int(self._defer(keys=[k.pointers, k.runs, k.visits], args=args))
        return done

    # -- definitions ----------------------------------------------------------

    def store_config(
        self,
        definitions: Sequence[Definition],
        config_hash: str,
        *,
        writer: str,
        force: bool,
        keep: Mapping[str, str] | None = None,
        withdraw: Mapping[str, str] | None = None,
        since: Mapping[str, int | str] | None = None,
        made: int | None = None,
        reading: int = 1,
        incremental: bool = False,
    ) -> tuple[str, list[tuple[str, str]]]:
        """Store a ``beat_schedule``; return ("same"|"older"|"done", [(kind, name), ...]).

        Each kind is "new", "changed", "removed" or "relabelled" (only its
        display name or source differ: stored with its version and what it
        parked as they are, see ``define.lua``). *keep* and *withdraw*
        map the entries this process cannot serve to why (stored for
        ``periodic list`` and ``status --check``, see :meth:`unserved`):
        what is stored under a name in *keep* stays as it is (its task
        module may import in another companion); under a name in
        *withdraw*, it is removed (a database row every companion reads
        alike). *since* maps names to the last time they ran elsewhere
        (celery beat): an entry stored for the first time goes on from
        then, not from now; ``"=<ms>"`` does so for a changed entry too.
        *made* is when the source made this configuration (django-celery-beat's
        change marker, epoch microseconds): it is then stored unless one made
        later is, whatever either holds; without it (a ``beat_schedule``) a
        configuration replaced once is refused (see ``define.lua``).
        *reading* says how this release reads the source (with *made*): rows
        read at the same time by a release reading them otherwise (a later
        *reading*) are stored over an earlier release's, never the other
        way round.

        *incremental* sends only what changed since the configuration this
        store stored or found stored last (``define.lua``'s "diff" mode: its
        Redis time grows with the changes, not the entries), and the whole
        configuration when that one is no longer stored as it was left
        ("stale"), or none was (the first store, a *force*). The result is
        the same either way.
        """
        since = since or {}
        # (name, definition or marker, since or reason): a name may have a
        # definition and a reason both (a row another row's name is taken by).
        triples: list[tuple[str, str, str]] = [
            (d.name, d.body(), str(since.get(d.name, ""))) for d in definitions
        ]
        for marker, unserved in (("", keep), ("!", withdraw)):
            triples += [(name, marker, reason) for name, reason in (unserved or {}).items()]
        head: list[Any] = [
            config_hash,
            "1" if force else "0",
            writer,
            "" if made is None else made,
            "" if made is None else reading,
        ]
        seen, self._stored_config = self._stored_config, None
        by_name: dict[str, list[tuple[str, str, str]]] = {}
        for triple in triples:
            by_name.setdefault(triple[0], []).append(triple)
        sent = _StoredConfig.of(config_hash, by_name) if incremental else None
        reply: tuple[str, list[tuple[str, str]]] | None = None
        if sent is not None and seen is not None and not force:
            reply = self._define_call(["diff", *head, seen.hash, *seen.changes_to(sent, by_name)])
        if reply is None or reply[0] == _STALE:
            reply = self._define_call(["config", *head, *(p for t in triples for p in t)])
        if reply[0] in ("done", "same"):
            # Stored as it is now: what the next change is made against.
            self._stored_config = sent
        return reply

    def unserved(self) -> dict[str, str]:
        """Name -> why, of the entries of the stored configuration that no companion serves."""
        with store_errors(self.store.url):
            raw = self.store.client.hget(self.keys.meta, "unserved")
        return _unserved(raw)

    def put(self, definition: Definition, *, writer: str) -> bool:
        """Add or replace one definition; return whether it changed."""
        _, changed = self._define_call(
            ["put", "", "0", writer, "", "", definition.name, definition.body(), ""]
        )
        return bool(changed)

    def drop(self, names: Iterable[str]) -> list[str]:
        """Remove definitions (their parked occurrences are withdrawn); return those removed."""
        _, changed = self._define_call(["drop", "", "0", "", "", "", *names])
        return [name for _, name in changed]

    def _define_call(self, args: list[Any]) -> tuple[str, list[tuple[str, str]]]:
        k = self.keys
        with store_errors(self.store.url):
            reply = self._define(
                keys=[
                    k.defs,
                    k.versions,
                    k.pointers,
                    k.paused,
                    k.cancel,
                    k.meta,
                    k.superseded,
                    k.visits,
                    *self._shard_keys(),
                ],
                args=args,
            )
        status, *rest = [_text(part) for part in reply]
        if status == "done":
            pairs = list(zip(rest[::2], rest[1::2], strict=True))
            # The occurrences the script took back from the due sets (see define.lua).
            self._withdrawn([task_id for kind, task_id in pairs if kind == WITHDRAWN])
            self.cancel_listed()
            return status, [(kind, name) for kind, name in pairs if kind != WITHDRAWN]
        return status, [("", name) for name in rest]

    def set_paused(self, name: str, paused: bool) -> int:
        """Pause or resume *name*: 1 done, 0 no such schedule, 2 already so."""
        k = self.keys
        with store_errors(self.store.url):
            done, *withdrawn = self._pause(
                keys=[
                    k.defs,
                    k.pointers,
                    k.paused,
                    k.cancel,
                    k.versions,
                    k.visits,
                    *self._shard_keys(),
                ],
                args=["pause" if paused else "resume", name],
            )
        self._withdrawn([_text(task_id) for task_id in withdrawn])
        self.cancel_listed()
        return int(done)

    def cancel_listed(self) -> list[str]:
        """Cancel the occurrences listed in the cancel set on their shards; return those cancelled.

        A change lists what its script could not take back itself: on a
        Redis Cluster store every occurrence (the shards are other slots),
        elsewhere those it did not find parked or leased, which may be held
        back by a pause or a rate limit. The caller of a change runs this
        before it returns, and every companion on its next pass.
        """
        with store_errors(self.store.url):
            ids = sorted(_text(i) for i in self.store.client.smembers(self.keys.cancel))
        if not ids:
            return []
        found = self.withdraw(ids)
        self.forget_cancelled(ids)
        return [i for i, was in zip(ids, found, strict=True) if was]

    def withdraw(self, task_ids: Sequence[str]) -> list[bool]:
        """Cancel occurrences their schedule no longer wants; return which were parked.

        Those found are reported to :attr:`on_withdrawn`. (The missed
        policy's are not: they are missed, and ``periodic backfill`` may
        run them yet.)
        """
        found = self.store.cancel(task_ids, how="withdrawn")
        self._withdrawn([t for t, was in zip(task_ids, found, strict=True) if was])
        return found

    def _withdrawn(self, task_ids: list[str]) -> None:
        if task_ids and self.on_withdrawn is not None:
            self.on_withdrawn(task_ids)

    # -- occurrences ----------------------------------------------------------

    def park_once(self, request: ParkRequest, *, occurrence_ms: int) -> bool:
        """Park one occurrence unless it was parked before; return whether it was parked now.

        *occurrence_ms* is its time in its schedule (its due time is that,
        plus the schedule's jitter offset): listed with its id in the
        schedule's pointer as it is parked, so that a change or a pause
        takes it back from then on (``park_once.lua``).
        """
        store = self.store
        shard = store.shard_of(request.task_id)
        keys, args = store.park_arguments(shard, [request])
        keys = [*keys, store.keys(shard).ticks]
        if not store.cluster:
            # Refused atomically once its version is replaced or paused.
            keys += [self.keys.pointers, self.keys.paused]
        # Checked as Store.park checks its scripts: a command refused after
        # the tick is written would leave an occurrence ticked, never parked.
        store.ensure_allowed(keys[0], "park_once")
        # Its history says parked by the schedule (lua/_history.lua takes
        # these off before park_once.lua reads its arguments).
        history = store.history_args(shard, "periodic")
        with store_errors(store.url):
            reply = self._park_once(
                keys=[*keys, *history.keys],
                args=[*args, occurrence_ms, self.tick_memory_ms, *history.args],
            )
        return bool(reply)

    def parked_among(self, task_ids: Sequence[str]) -> set[str]:
        """Return which of *task_ids* are still parked (waiting in a due set)."""
        return {t for t, where in self.waiting_among(task_ids).items() if where == WAITING_DUE}

    def waiting_among(self, task_ids: Sequence[str]) -> dict[str, str]:
        """Return which of *task_ids* wait to be released, and where.

        :data:`WAITING_DUE`: parked in a due set; :data:`WAITING_HELD`: due,
        and held back by a pause or a rate limit (a held set of its shard).
        Neither: released, in flight, withdrawn or never parked.
        """
        store = self.store
        ids = list(task_ids)
        if not ids:
            return {}
        lanes = self._lanes_of(ids)
        with store_errors(store.url), store.client.pipeline(transaction=False) as pipe:
            for task_id in ids:
                shard = store.shard_of(task_id)
                pipe.zscore(store.keys(shard).due, task_id)
                for lane in lanes[shard]:
                    pipe.zscore(held_set_key(store.config.key_prefix, shard, lane), task_id)
            found = pipe.execute()
        waiting: dict[str, str] = {}
        at = 0
        for task_id in ids:
            scores = found[at : at + 1 + len(lanes[store.shard_of(task_id)])]
            at += len(scores)
            if scores[0] is not None:
                waiting[task_id] = WAITING_DUE
            elif any(score is not None for score in scores[1:]):
                waiting[task_id] = WAITING_HELD
        return waiting

    def _lanes_of(self, task_ids: Sequence[str]) -> dict[int, list[str]]:
        """The names of the held sets of the shards of *task_ids* (one round trip)."""
        store = self.store
        shards = sorted({store.shard_of(t) for t in task_ids})
        with store_errors(store.url), store.client.pipeline(transaction=False) as pipe:
            for shard in shards:
                pipe.smembers(lanes_key(store.config.key_prefix, shard))
            found = pipe.execute()
        return {
            shard: sorted(_text(n) for n in names)
            for shard, names in zip(shards, found, strict=True)
        }

    def released_among(self, occurrences: Sequence[tuple[str, str]]) -> set[str]:
        """Return which of (name, id) occurrences were released: gone from their shard.

        Gone means neither parked, held back (by a pause or a rate limit: it
        has not run), in flight (leased), dead-lettered, nor withdrawn by
        the missed policy (remembered as missed): only released is left.
        """
        store = self.store
        if not occurrences:
            return set()
        lanes = self._lanes_of([task_id for _, task_id in occurrences])
        places: list[int] = []
        with store_errors(store.url), store.client.pipeline(transaction=False) as pipe:
            for name, task_id in occurrences:
                shard = store.shard_of(task_id)
                keys = store.keys(shard)
                where = [keys.due, keys.lease, keys.dead, self.keys.missed_prefix + name]
                where += [
                    held_set_key(store.config.key_prefix, shard, lane) for lane in lanes[shard]
                ]
                for key in where:
                    pipe.zscore(key, task_id)
                places.append(len(where))
            found = pipe.execute()
        released: set[str] = set()
        at = 0
        for (_, task_id), count in zip(occurrences, places, strict=True):
            if all(score is None for score in found[at : at + count]):
                released.add(task_id)
            at += count
        return released

    def note_held(self, name: str, held: Mapping[str, int], *, forget: Iterable[str] = ()) -> None:
        """Remember occurrences of *name* found held back (id -> ms); forget *forget*.

        A pause can hold an occurrence longer than its schedule's pointer
        remembers it (:data:`REMEMBER_PARKED_MS`): the missed policy still
        counts it in the gap (see ``PeriodicServer._sort_out_missed``).
        """
        gone = [f"{name}\n{task_id}" for task_id in forget]
        with store_errors(self.store.url):
            if held:
                self.store.client.zadd(
                    self.keys.held, {f"{name}\n{task_id}": ms for task_id, ms in held.items()}
                )
            if gone:
                self.store.client.zrem(self.keys.held, *gone)

    def advance(
        self,
        name: str,
        version: int,
        pointer_ms: int,
        parked: Sequence[tuple[int, str]],
        now_ms: int,
        *,
        missed: int = 0,
        missed_ids: Sequence[tuple[int, str]] = (),
    ) -> str:
        """Record what was parked: "done", or "paused" / "changed" (or removed) meanwhile.

        *missed* occurrences the missed policy left out count once, for
        whoever moves the pointer past them; *missed_ids* (ms, id) of them
        are remembered for :meth:`claim_missed`.
        """
        k = self.keys
        args: list[Any] = [name, version, pointer_ms, now_ms - self.remember_parked_ms, missed]
        args.append(len(missed_ids))
        for ms, task_id in [*missed_ids, *parked]:
            args += [ms, task_id]
        keys = [k.pointers, k.paused, k.counts, k.missed_prefix + name, k.runs, k.visits]
        with store_errors(self.store.url):
            reply = int(self._advance(keys=keys, args=args))
        return {1: "done", 0: "paused"}.get(reply, "changed")

    def record_runs(self, runs: dict[str, str]) -> list[str]:
        """Store name -> JSON of the last occurrence released (see :class:`Snapshot`).

        Only over an older one: returns the names recorded now, so a run two
        companions record (``record_runs.lua``) counts once.
        """
        args: list[str] = []
        for name, record in runs.items():
            args += [name, record]
        with store_errors(self.store.url):
            recorded = self._record_runs(
                keys=[self.keys.runs, self.keys.pointers, self.keys.visits], args=args
            )
        return [_text(name) for name in recorded]

    def count(self, name: str, counter: str, ticks: int = 1) -> None:
        """Add *ticks* to *counter* (one of :data:`COUNTERS`) of schedule *name*."""
        if ticks > 0:
            with store_errors(self.store.url):
                self.store.client.hincrby(self.keys.counts, f"{name}\n{counter}", ticks)

    def note_missed(self, name: str, missed_ids: Sequence[tuple[int, str]]) -> None:
        """Remember (ms, id) of occurrences of *name* that did not run, for :meth:`claim_missed`."""
        if missed_ids:
            with store_errors(self.store.url):
                self.store.client.zadd(
                    self.keys.missed_prefix + name, {task_id: ms for ms, task_id in missed_ids}
                )

    def missed_between(self, name: str, since_ms: int, until_ms: int) -> list[tuple[int, str]]:
        """Return (ms, id) of the remembered missed occurrences of *name* in the window."""
        with store_errors(self.store.url):
            found = self.store.client.zrangebyscore(
                self.keys.missed_prefix + name, since_ms, until_ms, withscores=True
            )
        return [(int(ms), _text(task_id)) for task_id, ms in cast("list[Any]", found)]

    def claim_missed(self, name: str, task_id: str) -> bool:
        """Take a missed occurrence to run it now; True for one caller only, ever."""
        with store_errors(self.store.url):
            return bool(self.store.client.zrem(self.keys.missed_prefix + name, task_id))

    def forget_cancelled(self, task_ids: Sequence[str]) -> None:
        if task_ids:
            with store_errors(self.store.url):
                self.store.client.srem(self.keys.cancel, *task_ids)


#: What ``define.lua`` answers a "diff" made against a configuration no
#: longer stored as it was left.
_STALE = "stale"


@dataclass(frozen=True)
class _StoredConfig:
    """A configuration as stored: its hash, and a digest of each name's triples."""

    hash: str
    #: name -> digest of its definition and reason (not of *since*: a
    #: definition stored as it was is no change, whatever its since).
    digests: dict[str, bytes]

    @classmethod
    def of(
        cls, config_hash: str, by_name: Mapping[str, list[tuple[str, str, str]]]
    ) -> _StoredConfig:
        return cls(config_hash, {name: _digest(triples) for name, triples in by_name.items()})

    def changes_to(
        self, new: _StoredConfig, by_name: Mapping[str, list[tuple[str, str, str]]]
    ) -> list[str]:
        """The "diff" triples that make this configuration *new* (see ``define.lua``)."""
        changes = [
            triple
            for name, digest in new.digests.items()
            if self.digests.get(name) != digest
            for triple in by_name[name]
        ]
        changes += [(name, "-", "") for name in self.digests if name not in new.digests]
        return [part for triple in changes for part in triple]


def _digest(triples: list[tuple[str, str, str]]) -> bytes:
    """What is compared of a name's triples: its definition, its marker and reason."""
    digest = hashlib.blake2b(digest_size=16)
    for _, second, third in triples:
        digest.update((second if second not in ("", "!") else f"{second}\0{third}").encode())
        digest.update(b"\1")
    return digest.digest()


#: The fields of the meta hash a pass reads (not "unserved": it lists every bad entry).
_META_FIELDS = ("hash", "written_by", "written_ms", "made")


def _read_run(snap: Snapshot, name: str, raw: str | bytes) -> None:
    """Add one stored run record to *snap* (left out when it cannot be read)."""
    try:
        run = json.loads(raw)
        snap.runs[name] = (int(run["ms"]), int(run["lateness_ms"]))
        if isinstance(run.get("id"), str):
            snap.last_ids[name] = run["id"]
    except (ValueError, KeyError, TypeError):
        return


def _unserved(raw: Any) -> dict[str, str]:
    """The stored reasons of the unserved entries (none when unreadable)."""
    try:
        found = json.loads(_text(raw)) if raw else {}
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
