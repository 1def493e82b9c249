"""The Redis store: parked entries, their leases while in flight, dead letters.

Every change is one Lua script (see ``lua/``), so each operation is atomic on
its shard. This class turns Python calls into those scripts and their replies
into values; it decides nothing about what to release.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from redis.commands.core import Script
from redis.exceptions import NoScriptError, WatchError

from ..bulk_limit import bulk_limit
from ..config import ZDelayConfig
from ..due_score import due_ms_of
from ..entry import TaskMessage, Template, TemplateLookup, decode_entry
from ..entry import template_id as entry_template_id
from ..errors import EntryError, StoreRefusedError
from ..schedule import Due
from .client import (
    StoreClient,
    close_client,
    is_cluster,
    make_client,
    sanitize_url,
    store_errors,
)
from .dead_reason import DeadReason
from .headers import KEY_HEADER
from .redis_keys import ShardKeys, held_set_key, lanes_key, shard_keys, shard_of
from .scripts import Scripts, script_commands

if TYPE_CHECKING:
    from .marks import Mark

__all__ = ["ClaimResult", "Claimed", "ParkRequest", "Parked", "Store"]

logger = logging.getLogger(__name__)

#: How long a park call is remembered, so a retry after a lost reply is a
#: no-op: longer than the producer's retries take (timeouts included).
PARK_MARKER_MS = 120_000
#: What park.lua, park_keyed.lua and reschedule.lua answer when the shard's
#: held sets changed since they were read.
_LANES_CHANGED = -2
#: Template records kept in memory by one Store (they never change: ids are
#: content hashes).
TEMPLATE_CACHE_SIZE = 4096

#: Starts the last argument of a script call that records history (see
#: lua/_history.lua): no task id, payload or reason starts with a NUL byte.
HISTORY_SENTINEL = "\0zdelay-history\0"
_REFUSED_IN_BY = re.compile("[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class _HistoryArgs:
    """What a script call appends to its KEYS and ARGV to record history (none: off)."""

    keys: list[str]
    args: list[str]


_NO_HISTORY = _HistoryArgs([], [])


@dataclass(frozen=True)
class ParkRequest:
    """One entry to park."""

    task_id: str
    due: Due
    payload: bytes
    #: kombu list key for the Redis handoff, when the broker is Redis.
    dest: str | None = None
    #: The template *payload* refers to, stored with it if the shard lacks it.
    template: Template | None = None
    #: Its key and tags, if any (park_keyed.lua writes them: see :meth:`Store.park`).
    mark: Mark | None = None
    #: The captured message this parks, for its ``after_task_publish`` once
    #: parked (:func:`celery_zdelay.capture.announce_parked`); the store ignores it.
    message: TaskMessage | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class Parked:
    """What :meth:`Store.park` did for one request."""

    #: The id of the entry parked for this request afterwards: its own, or
    #: (for a key already taken) the owner's.
    task_id: str
    #: That entry's due ms; None when it is no longer parked (released, running).
    due_ms: int | None
    #: Whether this call parked the request's own entry.
    parked: bool
    #: The id of the parked entry this request's ``replace`` or ``debounce``
    #: took out (it never runs: the caller reports it cancelled), or None.
    replaced: str | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Claimed:
    """An entry claimed for release through the generic path."""

    task_id: str
    #: The entry's due score: due_ms * 1024 + sequence.
    score: int
    #: ``None`` when the id was in the due set without a payload.
    payload: bytes | None

    @property
    def due_ms(self) -> int:
        return due_ms_of(self.score)


@dataclass
class ClaimResult:
    """What one claim (or handoff) call did on one shard."""

    #: Redis clock when the call ran.
    now_ms: int
    #: Claim token of :attr:`entries`, unique per claim (a per-shard
    #: counter): ack, unclaim, push or dead-letter them with it.
    token: int
    #: Due time of the earliest entry still parked, if any.
    next_due_ms: int | None
    #: Earliest lease expiry in the shard, if any entry is in flight.
    next_lease_ms: int | None
    #: Due ms of each entry moved straight into a broker queue (handoff only).
    handed_due_ms: list[int] = field(default_factory=list)
    #: Ids of the entries handed off, in the order of :attr:`handed_due_ms`
    #: (only when asked for: ``with_ids``).
    handed_ids: list[str] = field(default_factory=list)
    #: The handoff stopped at an entry naming a queue list it was not given.
    needs_dests: bool = False
    #: Entries leased for the generic path, in due order.
    entries: list[Claimed] = field(default_factory=list)
    #: Entries the handoff dead-lettered itself, with why.
    dead: list[tuple[str, DeadReason]] = field(default_factory=list)


class Store:
    """The store of one app configuration, on one Redis (or Redis Cluster)."""

    def __init__(self, config: ZDelayConfig, client: StoreClient | None = None) -> None:
        self.config = config
        self.url = config.redis_url
        self.client = client if client is not None else make_client(config)
        #: Whether the client is this store's own (its pool serves no one else).
        self._owns_client = client is None
        #: On a Redis Cluster each shard lives on its own node: calls on
        #: different shards cannot share a pipeline or a transaction.
        self.cluster = is_cluster(self.client)
        self.scripts = Scripts(self.client)
        self._keys = [shard_keys(config.key_prefix, s) for s in range(config.shards)]
        self._templates: dict[str, bytes] = {}
        self._bulk_limit: int | None = None
        #: Scripts whose every command this client's ACL user may run.
        self._allowed: set[str] = set()
        #: The held-set names last read per shard: what a reschedule passes
        #: first (the script asks for a fresh read when they changed).
        self._lanes_seen: dict[int, list[str]] = {}

    def close(self) -> None:
        """Close the connections to Redis (of a client given: its own, not its pool's)."""
        if self._owns_client:
            close_client(self.client)
        else:
            self.client.close()

    # -- keys -----------------------------------------------------------------

    def keys(self, shard: int) -> ShardKeys:
        """Return the key names of *shard*."""
        return self._keys[shard]

    def shard_of(self, task_id: str) -> int:
        """Return the shard that holds *task_id*."""
        return shard_of(task_id, self.config.shards)

    @property
    def shards(self) -> range:
        return range(self.config.shards)

    def history_args(self, shard: int, how: str = "", by: str | None = None) -> _HistoryArgs:
        """Return what a script call appends to its KEYS and ARGV to record history.

        Nothing when ``zdelay_history_seconds`` is 0: the script then
        records nothing and touches no key of it (see lua/_history.lua).
        *how* says which call it is (plain, keyed, bulk for a park; id,
        tag, matching, withdrawn for a cancel), *by* who made it (a
        companion's id for a release, the caller's ``by=`` for a cancel).
        """
        if not self.config.history_ms:
            return _NO_HISTORY
        # Who it was, as one field of a line: characters no name may hold
        # (tabs, newlines, NUL: they separate the record) are replaced.
        who = _REFUSED_IN_BY.sub("?", by or "")
        return _HistoryArgs([self._keys[shard].history], [f"{HISTORY_SENTINEL}{how}\0{who}"])

    # -- producers ------------------------------------------------------------

    def park(self, requests: Sequence[ParkRequest]) -> list[Parked]:
        """Park *requests* atomically per shard; return what was parked for each.

        The one way in for every park: plain ones run park.lua; a call in
        which any request has a key or tags runs park_keyed.lua (park.lua
        inside it, and the key and tag index in the same step), requests
        without a mark among them. Either way the same checks come first:
        sizes, then the ACL pre-check of the script (:meth:`ensure_allowed`).

        With several shards on one Redis server the whole call is one
        transaction: either every entry is parked or none is. On a Redis
        Cluster each shard's part is atomic on its own. An id parked again
        replaces its entry wherever it waits, held back by a pause or rate
        limit included (see park.lua).
        """
        marked = any(request.mark is not None for request in requests)
        script = "park_keyed" if marked else "park"
        by_shard: dict[int, list[int]]
        if len(requests) == 1:  # apply_delayed: one entry, one shard
            by_shard = {self.shard_of(requests[0].task_id): [0]}
        else:
            by_shard = defaultdict(list)
            for index, request in enumerate(requests):
                by_shard[self.shard_of(request.task_id)].append(index)
        with store_errors(self.url):
            self._check_sizes(requests)
            for shard in by_shard:  # once per Store: the first shard's key will do
                self.ensure_allowed(self._keys[shard].due, script)
                break
        if marked and self.config.signing_keys:
            self._drop_forged_owners(requests)
        with store_errors(self.url):
            if len(by_shard) == 1 or self.cluster:
                replies = [
                    self._park_on_shard(script, shard, [requests[i] for i in indexes])
                    for shard, indexes in by_shard.items()
                ]
            else:
                replies = self._park_on_shards(script, by_shard, requests)
        parked: list[Parked | None] = [None] * len(requests)
        for indexes, reply in zip(by_shard.values(), replies, strict=True):
            for index, done in zip(indexes, _parked(script, indexes, requests, reply), strict=True):
                parked[index] = done
        return cast("list[Parked]", parked)

    def ensure_allowed(self, key: str, *names: str) -> None:
        """Refuse to run scripts *names* whose commands this ACL user may not all run.

        Redis checks a script's commands one by one as it calls them: a
        refusal after the script's first write would leave that write done
        and report an error. Asked once per script and Store, before its
        first call (``allowed.lua``; Redis 7, older servers cannot tell).
        *key* is a key the scripts name, which EVALSHA checks anyway. Any
        registered script can be named (:func:`.scripts.script_commands`),
        the periodic ones included once their package is imported.
        """
        for name in names:
            if name in self._allowed:
                continue
            with store_errors(self.url):
                refused = self.scripts.allowed(
                    keys=[key], args=list(script_commands(name)), client=self.client
                )
            if refused:
                command = refused.decode() if isinstance(refused, bytes) else str(refused)
                raise StoreRefusedError(
                    f"The celery-zdelay store at {sanitize_url(self.url)} would refuse "
                    f"{command}, which {name}.lua runs: its ACL user lacks that command, and "
                    "the script did not start, so nothing was written. Give the user the ACL "
                    'rule of its role listed under "Redis ACL" in the deployment docs.'
                )
            self._allowed.add(name)

    def _check_sizes(self, requests: Sequence[ParkRequest]) -> None:
        """Refuse a payload the server would take for a broken connection.

        Redis closes the connection on a value over its proto-max-bulk-len:
        the caller would be told the store is unreachable, and retry in vain.
        """
        if self._bulk_limit is None:
            self._bulk_limit = bulk_limit(self.client)
        limit = self._bulk_limit
        for request in requests:
            template = request.template.record if request.template is not None else b""
            size = max(len(request.payload), len(template))
            if size > limit:
                raise StoreRefusedError(
                    f"The celery-zdelay store at {sanitize_url(self.url)} takes values of at "
                    f"most {limit} bytes (proto-max-bulk-len), and task {request.task_id} "
                    f"needs {size}; nothing was written. Pass large data by reference "
                    "(a file or object-store key), or raise proto-max-bulk-len"
                )

    def _drop_forged_owners(self, requests: Sequence[ParkRequest]) -> None:
        """With signing, forget key owners whose signed message does not carry the key.

        park_keyed.lua cannot check an HMAC: without this, anyone able to write
        to Redis could point a key at a signed entry parked under another key,
        and a ``replace`` call would cancel it (a ``keep`` call would return
        it). An owner is trusted only if its message, signed with a current
        key under its own id, names the key. An owner released and running
        (``until_finished``) has no message left to check and stays; one
        written as running while its id is parked is checked as parked, so a
        forged hold cannot make a ``keep`` call return a signed entry either.
        """
        for request in requests:
            key = request.mark.key if request.mark is not None else None
            if key is None:
                continue
            shard = self.shard_of(request.task_id)
            keys = self._keys[shard]
            with store_errors(self.url):
                value = self.client.hget(keys.marks, "k:" + key)
                if value is None:
                    continue
                owner, _, until = _text(value).partition("\n")
                payload = cast("bytes | None", self.client.hget(keys.msg, owner))
            if until and payload is None:
                continue
            try:
                message = decode_entry(
                    payload, self.config.signing_keys, self.templates(shard), entry_id=owner
                )
                trusted = message.headers.get(KEY_HEADER) == key
            except EntryError:
                trusted = False
            if not trusted:
                logger.warning(
                    "Key %r pointed at %s, whose signed message does not carry it: dropped "
                    "(someone else wrote into the store's index)",
                    key,
                    owner,
                    extra={"task_id": owner},
                )
                with store_errors(self.url):
                    self.ensure_allowed(keys.marks, "drop_key")
                    self.scripts.drop_key(keys=[keys.marks], args=[key, value])

    def _park_on_shard(self, script: str, shard: int, requests: Sequence[ParkRequest]) -> Any:
        """park.lua (or park_keyed.lua) on one shard, with the held sets last seen there.

        None at first: the first park of an id, the common case, reads no
        held set. The script answers ``[-2]``, having written nothing, when
        an id parked again (or a key's owner to move or answer) is held in
        a set not given: then they are read (one name per control: this ends).
        """
        lanes = self.known_lanes(shard)
        while True:
            reply = self._park_call(script, shard, requests, self.client, lanes)
            if not (len(reply) == 1 and int(reply[0]) == _LANES_CHANGED):
                return reply
            lanes = self.lanes(shard)

    def _park_on_shards(
        self, script: str, by_shard: dict[int, list[int]], requests: Sequence[ParkRequest]
    ) -> list[Any]:
        """park.lua (or park_keyed.lua) on several shards of one server, in one transaction.

        A failing call inside MULTI/EXEC does not undo the calls before it,
        so each call checks the keys of every shard in the batch before it
        writes: they all fail, or none does. A call told to read the held
        sets again could not be made again alone (the others' writes are
        done), so they are read first, under WATCH: a held set added before
        EXEC aborts the transaction, and it is tried again with them read anew.
        """
        prefix = self.config.key_prefix
        with self.client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(*(lanes_key(prefix, shard) for shard in by_shard))
                    lanes = {shard: self.lanes(shard) for shard in by_shard}
                    pipe.multi()
                    for shard, indexes in by_shard.items():
                        others = [s for s in by_shard if s != shard]
                        shard_requests = [requests[i] for i in indexes]
                        self._park_call(script, shard, shard_requests, pipe, lanes[shard], others)
                    return list(pipe.execute())
                except WatchError:
                    continue

    def _park_call(
        self,
        script: str,
        shard: int,
        requests: Sequence[ParkRequest],
        client: Any,
        lanes: Sequence[str],
        check_shards: Sequence[int] = (),
    ) -> Any:
        """Call *script* (park or park_keyed) on *shard*, given the held sets of *lanes*."""
        # Which call parks them, for their history.
        how = "bulk" if len(requests) > 1 else "keyed" if script == "park_keyed" else "plain"
        history = self.history_args(shard, how)
        if script == "park":
            keys, args = self.park_arguments(shard, requests, check_shards, lanes=lanes)
            return self.scripts.park(
                keys=[*keys, *history.keys], args=[*args, *history.args], client=client
            )
        # park_keyed.lua takes park.lua's arguments with no held set, then the
        # marks, then the held sets (see its header).
        keys, args = self.park_arguments(shard, requests, check_shards)
        prefix = self.config.key_prefix
        records = [request.mark.record() if request.mark else "-0\n" for request in requests]
        return self.scripts.park_keyed(
            keys=[*keys, *(held_set_key(prefix, shard, lane) for lane in lanes), *history.keys],
            args=[*args, *records, *lanes, len(lanes), len(requests), *history.args],
            client=client,
        )

    def park_arguments(
        self,
        shard: int,
        requests: Sequence[ParkRequest],
        check_shards: Sequence[int] = (),
        *,
        lanes: Sequence[str] = (),
    ) -> tuple[list[str], list[Any]]:
        """Return the KEYS and ARGV of ``park.lua`` parking *requests* on *shard*.

        The one place that lays them out (see park.lua), for this store's
        calls and for scripts run in front of park.lua (periodic
        ``park_once.lua``). The keys of *check_shards* are checked, not
        written; the held sets of *lanes* (control names) are given, for a
        held id parked again to leave its set.
        """
        keys = self._keys[shard]
        checked = [
            key
            for other in (self._keys[s] for s in check_shards)
            for key in (
                other.due,
                other.msg,
                other.lease,
                other.leased,
                other.dests,
                other.templates,
                other.marks,
                other.tagged,
            )
        ]
        templates = {r.template.id: r.template.record for r in requests if r.template}
        args: list[Any] = [keys.wake, PARK_MARKER_MS, len(templates), len(lanes), *lanes]
        for template in templates.items():
            args += template
        for request in requests:
            args += [
                request.task_id,
                request.due.mode,
                request.due.ms,
                request.payload,
                request.dest or "",
            ]
        park_keys = [
            keys.due,
            keys.msg,
            keys.lease,
            keys.leased,
            keys.dests,
            keys.marker(),
            keys.templates,
            lanes_key(self.config.key_prefix, shard),
            keys.marks,
            keys.tagged,
            *(held_set_key(self.config.key_prefix, shard, lane) for lane in lanes),
            *checked,
        ]
        return park_keys, args

    def cancel(
        self, task_ids: Iterable[str], *, how: str = "id", by: str | None = None
    ) -> list[bool]:
        """Cancel parked entries; return, per id, whether it was still parked.

        *how* and *by* go into their history: cancelled by ``"id"``, by
        ``"tag"``, by other filters (``"matching"``) or ``"withdrawn"`` (a
        periodic occurrence), and by whom.
        """
        ids = list(task_ids)
        by_shard: dict[int, list[int]] = defaultdict(list)
        for index, task_id in enumerate(ids):
            by_shard[self.shard_of(task_id)].append(index)
        found = [False] * len(ids)
        # cancel.lua checks before it writes: a refusal wrote nothing.
        with store_errors(self.url):
            for shard, indexes in by_shard.items():
                keys = self._keys[shard]
                self.ensure_allowed(keys.due, "cancel")
                history = self.history_args(shard, how, by)
                reply = self.scripts.cancel(
                    keys=[
                        keys.due,
                        keys.msg,
                        keys.templates,
                        keys.marks,
                        keys.tagged,
                        *history.keys,
                    ],
                    args=[*(ids[i] for i in indexes), *history.args],
                    client=self.client,
                )
                for index, flag in zip(indexes, reply, strict=True):
                    found[index] = bool(flag)
                missing = [i for i in indexes if not found[i]]
                if missing:
                    self._cancel_held(shard, ids, missing, found, history)
        return found

    def _cancel_held(
        self,
        shard: int,
        ids: list[str],
        indexes: list[int],
        found: list[bool],
        history: _HistoryArgs,
    ) -> None:
        """Cancel entries held back by a rate limit or pause (see store/control.py).

        cancel.lua works on any set scored like the due set: run on each
        held set of the shard, it cancels held entries the same way.
        """
        prefix = self.config.key_prefix
        keys = self._keys[shard]
        for lane in self.lanes(shard):
            # With the marks keys, as for the due set: a held entry's key and
            # tags go with it.
            reply = self.scripts.cancel(
                keys=[
                    held_set_key(prefix, shard, lane),
                    keys.msg,
                    keys.templates,
                    keys.marks,
                    keys.tagged,
                    *history.keys,
                ],
                args=[*(ids[i] for i in indexes), *history.args],
                client=self.client,
            )
            for index, flag in zip(indexes, reply, strict=True):
                found[index] = found[index] or bool(flag)
            indexes = [i for i in indexes if not found[i]]
            if not indexes:
                return

    def reschedule(self, task_id: str, due: Due) -> int | None:
        """Move a parked entry to *due*; return its new due ms, or None if not parked."""
        shard = self.shard_of(task_id)
        keys = self._keys[shard]
        prefix = self.config.key_prefix
        # reschedule.lua checks before it writes, and its wake-up after the
        # move cannot fail it: a refusal wrote nothing.
        with store_errors(self.url):
            self.ensure_allowed(keys.due, "reschedule")
            # A held entry is looked for in the held sets of the lanes last
            # seen (none at first): an entry in the due set, the common case,
            # needs no read of them. The script answers -2 when the shard has
            # a lane not given and the entry was not found: then they are read
            # (lanes come one per control name: this ends).
            lanes = self._lanes_seen.get(shard, [])
            history = self.history_args(shard)
            while True:
                reply = int(
                    self.scripts.reschedule(
                        keys=[
                            keys.due,
                            lanes_key(prefix, shard),
                            *(held_set_key(prefix, shard, lane) for lane in lanes),
                            *history.keys,
                        ],
                        args=[keys.wake, task_id, due.mode, due.ms, *lanes, *history.args],
                        client=self.client,
                    )
                )
                if reply != _LANES_CHANGED:
                    return None if reply < 0 else reply
                lanes = self.lanes(shard)

    def known_lanes(self, shard: int) -> list[str]:
        """Return the held-set names of *shard* last read by :meth:`lanes` (none before)."""
        return self._lanes_seen.get(shard, [])

    def lanes(self, shard: int) -> list[str]:
        """Return the names of the controls with a held set on *shard*, sorted."""
        with store_errors(self.url):
            names = self.client.smembers(lanes_key(self.config.key_prefix, shard))
        lanes = sorted(name.decode() if isinstance(name, bytes) else str(name) for name in names)
        self._lanes_seen[shard] = lanes
        return lanes

    # -- companions -----------------------------------------------------------

    def claim(self, shard: int, *, limit: int, lease_ms: int, advance_ms: int = 0) -> ClaimResult:
        """Recover expired leases, then lease up to *limit* due entries.

        *advance_ms* fast-forwards the clock for picking due entries; only
        tests use it (:mod:`celery_zdelay.testing`).
        """
        keys = self._keys[shard]
        self.ensure_allowed(keys.due, "recover", "claim")
        reply = self._after_recover(
            keys,
            limit,
            self.scripts.claim,
            [keys.due, keys.msg, keys.lease, keys.leased, keys.tags],
            [lease_ms, limit, advance_ms],
        )
        return claim_result(reply, offset=4)

    def handoff(
        self,
        shard: int,
        *,
        dests: Iterable[str],
        layout: str,
        limit: int,
        lease_ms: int,
        fresh: bool,
        advance_ms: int = 0,
        companion_id: str = "",
        with_ids: bool = False,
        held_dests: Iterable[str] = (),
        max_late_ms: int | None = None,
        ahead_ms: int = 0,
    ) -> ClaimResult:
        """Recover expired leases, then hand due entries off to the broker's lists.

        Entries that cannot be handed off are leased and returned, as by
        :meth:`claim`; entries whose queue list key holds another type are
        dead-lettered (:attr:`ClaimResult.dead`, reasons naming *companion_id*).
        With *with_ids* the ids handed off are returned too
        (:attr:`ClaimResult.handed_ids`), for the audit trail and periodic runs.
        Entries for the queue lists *held_dests* (paused or rate-limited
        queues) are leased instead, for the companion's gate, and so are
        entries released later than their ``max_late`` (else *max_late_ms*,
        None for no limit): stale, for the companion to deal with
        (:mod:`celery_zdelay.stale`). Entries due within *ahead_ms* are
        handed off too, their ``eta`` header set to their due time
        (``zdelay_release_ahead_seconds``; see handoff.lua).
        """
        keys = self._keys[shard]
        self.ensure_allowed(keys.due, "recover", "handoff")
        history = self.history_args(shard, _ahead_how(ahead_ms), by=companion_id)
        reply = self._after_recover(
            keys,
            limit,
            self.scripts.handoff,
            [
                keys.due,
                keys.msg,
                keys.lease,
                keys.leased,
                keys.tags,
                keys.templates,
                keys.dead,
                keys.dead_msg,
                *dests,
                keys.marks,
                keys.tagged,
                *history.keys,
            ],
            [
                lease_ms,
                limit,
                layout,
                keys.tag_prefix,
                "1" if fresh else "0",
                advance_ms,
                companion_id,
                "1" if with_ids else "0",
                "\n".join(held_dests),
                "" if max_late_ms is None else max_late_ms,
                ahead_ms,
                *history.args,
            ],
        )
        n_leased, n_dead = int(reply[5]), int(reply[6])
        end = 7 + 3 * n_leased
        result = claim_result(reply[:end], offset=7)
        result.dead = [
            (reply[i].decode(), DeadReason.from_json(reply[i + 1]))
            for i in range(end, end + 2 * n_dead, 2)
        ]
        end += 2 * n_dead
        if with_ids:
            result.handed_ids = [task_id.decode() for task_id in reply[end:-1]]
        # Scores as Redis prints them ("1.8393728123812342e+18"): due_ms * 1024 + sequence.
        scores = reply[-1].split(b",") if reply[-1] else []
        result.handed_due_ms = [due_ms_of(float(score)) for score in scores]
        result.needs_dests = bool(int(reply[4]))
        return result

    def _after_recover(
        self, keys: ShardKeys, limit: int, script: Script, script_keys: list[Any], args: list[Any]
    ) -> Any:
        """Recover the shard's expired leases, then run *script*: one round trip."""
        recover_keys = [keys.lease, keys.leased, keys.due]
        with store_errors(self.url):
            if self.cluster:
                self.scripts.recover(keys=recover_keys, args=[limit], client=self.client)
                return script(keys=script_keys, args=args, client=self.client)
            calls = [(self.scripts.recover, recover_keys, [limit]), (script, script_keys, args)]
            return self._run_pipelined(calls)[1]

    def _run_pipelined(self, calls: list[tuple[Script, list[Any], list[Any]]]) -> list[Any]:
        """Run script *calls* (script, keys, args) in one round trip, by EVALSHA.

        redis-py's pipeline asks ``SCRIPT EXISTS`` before every execute that
        holds a script, a round trip of its own on every claim. Instead, a
        call that Redis answers ``NOSCRIPT`` (restarted, flushed, failed
        over: the script never started) is made again on its own, which
        loads the script; the others ran, once.
        """
        with self.client.pipeline(transaction=False) as pipe:
            for script, keys, args in calls:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            replies = list(pipe.execute(raise_on_error=False))
        for index, reply in enumerate(replies):
            if isinstance(reply, NoScriptError):
                script, keys, args = calls[index]
                replies[index] = script(keys=keys, args=args, client=self.client)
            elif isinstance(reply, Exception):
                raise reply
        return replies

    def push(
        self,
        shard: int,
        token: int,
        routes: Sequence[tuple[str, str, bytes]],
        *,
        by: str = "",
        ahead_ms: int = 0,
    ) -> tuple[list[str], list[tuple[str, str]]]:
        """Push claimed entries into broker lists: *routes* are (id, list key, envelope).

        The envelope is the message as the companion read (and verified) it,
        up to the delivery tag's opening quote: push.lua pushes these bytes,
        never what the store holds by then. Returns the ids pushed and the
        (id, reason) of those refused (their list key holds another type);
        an id this claim no longer owns is in neither. *by* (the companion's
        id) is recorded in their history as who released them, *ahead_ms*
        as the most ms ahead of due they may be released (see :meth:`handoff`).
        """
        if not routes:
            return [], []
        keys = self._keys[shard]
        history = self.history_args(shard, _ahead_how(ahead_ms), by=by)
        dests = sorted({dest for _, dest, _ in routes})
        index = {dest: i + 1 for i, dest in enumerate(dests)}
        args: list[Any] = [token, keys.tag_prefix]
        for task_id, dest, head in routes:
            args += [task_id, index[dest], head]
        # push.lua finds marks and tagged last among its keys, and reads
        # ARGV in triples: the history's go after (taken off first).
        self.ensure_allowed(keys.due, "push")
        with store_errors(self.url):
            pushed, refused = self.scripts.push(
                keys=[
                    keys.lease,
                    keys.leased,
                    keys.msg,
                    keys.tags,
                    keys.templates,
                    *dests,
                    keys.marks,
                    keys.tagged,
                    *history.keys,
                ],
                args=[*args, *history.args],
                client=self.client,
            )
        return [task_id.decode() for task_id in pushed], [
            (refused[i].decode(), refused[i + 1].decode()) for i in range(0, len(refused), 2)
        ]

    def templates(self, shard: int) -> TemplateLookup:
        """Return the template lookup of *shard*, for reading its payloads.

        Pass it to :func:`~celery_zdelay.entry.decode_entry` or
        :func:`~celery_zdelay.entry.entry_headers`. Records are cached: a
        template id is the hash of its content, so a record never changes,
        and a record in Redis that does not hash to its id (rewritten by
        someone else) counts as missing.
        """

        def lookup(template_id: str) -> bytes | None:
            record = self._templates.get(template_id)
            if record is None:
                with store_errors(self.url):
                    stored = self.client.hget(self._keys[shard].templates, template_id)
                if not isinstance(stored, bytes) or entry_template_id(stored) != template_id:
                    return None
                if len(self._templates) >= TEMPLATE_CACHE_SIZE:
                    self._templates.clear()
                record = self._templates[template_id] = stored
            return record

        return lookup

    def dests(self, shard: int) -> list[str]:
        """Return the broker list keys parked entries of *shard* name."""
        with store_errors(self.url):
            members = self.client.smembers(self._keys[shard].dests)
        return sorted(m.decode() if isinstance(m, bytes) else m for m in members)

    def ack(
        self, shard: int, token: int, task_ids: Sequence[str], *, by: str = "", ahead_ms: int = 0
    ) -> int:
        """Forget released entries this claim still owns; return how many.

        *by* (the companion's id) is recorded in their history as who released
        them, *ahead_ms* as the most ms ahead of due they may be released.
        """
        if not task_ids:
            return 0
        keys = self._keys[shard]
        history = self.history_args(shard, _ahead_how(ahead_ms), by=by)
        self.ensure_allowed(keys.due, "ack")
        with store_errors(self.url):
            return int(
                self.scripts.ack(
                    keys=[
                        keys.lease,
                        keys.leased,
                        keys.msg,
                        keys.templates,
                        keys.marks,
                        keys.tagged,
                        *history.keys,
                    ],
                    args=[token, *task_ids, *history.args],
                    client=self.client,
                )
            )

    def unclaim(self, shard: int, token: int, task_ids: Sequence[str]) -> int:
        """Make claimed entries due again at their original time."""
        if not task_ids:
            return 0
        keys = self._keys[shard]
        self.ensure_allowed(keys.due, "unclaim")
        with store_errors(self.url):
            return int(
                self.scripts.unclaim(
                    keys=[keys.lease, keys.leased, keys.due],
                    args=[token, *task_ids],
                    client=self.client,
                )
            )

    def dead_letter(self, shard: int, token: int, reasons: Sequence[tuple[str, DeadReason]]) -> int:
        """Move claimed entries to the dead-letter set with their reasons."""
        if not reasons:
            return 0
        keys = self._keys[shard]
        history = self.history_args(shard)
        args: list[Any] = [token]
        for task_id, reason in reasons:
            args += [task_id, reason.to_json()]
        args += history.args
        self.ensure_allowed(keys.due, "deadletter")
        with store_errors(self.url):
            return int(
                self.scripts.deadletter(
                    keys=[
                        keys.lease,
                        keys.leased,
                        keys.msg,
                        keys.dead,
                        keys.dead_msg,
                        keys.marks,
                        keys.tagged,
                        *history.keys,
                    ],
                    args=args,
                    client=self.client,
                )
            )

    def drop_stale(
        self, shard: int, token: int, task_ids: Sequence[str], *, by: str | None = None
    ) -> list[str]:
        """Cancel claimed entries that went stale, if this claim still owns them.

        Lease -> gone in one script (``drop_stale.lua``): with their payload,
        template count, key and tags; their history says cancelled, reason
        ``stale``, by *by*. Returns the ids cancelled.
        """
        if not task_ids:
            return []
        keys = self._keys[shard]
        self.ensure_allowed(keys.due, "drop_stale")
        history = self.history_args(shard, "stale", by)
        with store_errors(self.url):
            dropped = self.scripts.drop_stale(
                keys=[
                    keys.lease,
                    keys.leased,
                    keys.msg,
                    keys.templates,
                    keys.marks,
                    keys.tagged,
                    *history.keys,
                ],
                args=[token, *task_ids, *history.args],
                client=self.client,
            )
        return [_text(task_id) for task_id in dropped]

    def purge_dead(self, shard: int, task_ids: Sequence[str]) -> int:
        """Delete dead-lettered entries of *shard* for good; return how many were dead.

        One script: the entry, its message and its template's count go together.
        """
        if not task_ids:
            return 0
        keys = self._keys[shard]
        self.ensure_allowed(keys.due, "purge")
        history = self.history_args(shard)
        with store_errors(self.url):
            return int(
                self.scripts.purge(
                    keys=[keys.dead, keys.dead_msg, keys.templates, keys.marks, *history.keys],
                    args=[*task_ids, *history.args],
                    client=self.client,
                )
            )

    def own(self, shard: int, companion_id: str, action: str, *, lease_ms: int) -> bool:
        """Acquire, renew or release the ownership lease of *shard*.

        Returns whether *companion_id* owns the shard afterwards.
        """
        keys = self._keys[shard]
        self.ensure_allowed(keys.due, "own")
        with store_errors(self.url):
            owned = self.scripts.own(
                keys=[keys.owner], args=[companion_id, action, lease_ms], client=self.client
            )
        return bool(owned)

    def owner(self, shard: int) -> str | None:
        """Return the id of the companion owning *shard*, if any."""
        with store_errors(self.url):
            owner = self.client.get(self._keys[shard].owner)
        return owner.decode() if isinstance(owner, bytes) else owner

    def time_ms(self) -> int:
        """Return the Redis server's clock in milliseconds."""
        with store_errors(self.url):
            seconds, micros = self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000


def _parked(
    script: str, indexes: Sequence[int], requests: Sequence[ParkRequest], reply: Sequence[Any]
) -> list[Parked]:
    """Read one shard's reply to *script* for the requests at *indexes*.

    park.lua answers each entry's due ms; park_keyed.lua three values per
    entry (id parked for it, its due ms or -1, 1 if parked now), then the
    id each one's replace or debounce took out (see their headers).
    """
    if script == "park":
        return [
            Parked(requests[index].task_id, int(ms), True)
            for index, ms in zip(indexes, reply, strict=True)
        ]
    n = len(indexes)
    found = []
    for i in range(n):
        task_id, due_ms, flag = reply[3 * i : 3 * i + 3]
        took_out = reply[3 * n + i] if len(reply) > 3 * n else ""
        found.append(
            Parked(
                task_id=_text(task_id),
                due_ms=None if int(due_ms) < 0 else int(due_ms),
                parked=bool(int(flag)),
                replaced=_text(took_out) or None,
            )
        )
    return found


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def claim_result(reply: Sequence[Any], *, offset: int) -> ClaimResult:
    entries = [
        Claimed(
            task_id=reply[i].decode(),
            score=int(reply[i + 1]),
            payload=reply[i + 2],
        )
        for i in range(offset, len(reply), 3)
    ]
    next_due, next_lease = int(reply[2]), int(reply[3])
    return ClaimResult(
        now_ms=int(reply[0]),
        token=int(reply[1]),
        next_due_ms=None if next_due < 0 else next_due,
        next_lease_ms=None if next_lease < 0 else next_lease,
        entries=entries,
    )


def _ahead_how(ahead_ms: int) -> str:
    """The *how* of a release's history: the most ms ahead of due it releases ("": none).

    _history.lua records how late each release was, down to minus this.
    """
    return str(ahead_ms) if ahead_ms > 0 else ""
