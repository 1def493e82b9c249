"""The release pass: claim what is due, hand it off or publish it, settle the rest.

On each shard the pass claims due entries in bounded batches (handoff.lua
straight into a Redis broker, or claim.lua into a lease), publishes what was
leased, acknowledges what the broker accepted, gives back what it did not,
holds what a rate limit, pause or concurrency control holds (taking a
concurrency slot for each entry it publishes), and dead-letters what can
never be published. An entry claimed later than its ``max_late`` is stale
(:mod:`celery_zdelay.stale`): dead-lettered, dropped or published and
counted, as ``zdelay_on_stale`` says. With ``zdelay_release_ahead_seconds``
an entry is claimed up to that long before it is due and published with
its ``eta`` header set to its due time: the worker's ETA timer holds it
until then, so the task never starts early, and the hop from companion to
worker happens before the due time instead of after it. What it did goes into a
:class:`PassReport` and out as signals (:mod:`celery_zdelay.signals`), which
the metrics and the audit log receive.
The loop around it (sleeping, backoff, heartbeats) is :mod:`.loop`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import signals
from ..bulk_limit import too_large
from ..config import ZDelayConfig
from ..entry import TaskMessage, decode_entry, entry_max_late_ms, eta_text, with_eta
from ..errors import EntryError
from ..periodic.server import PeriodicServer
from ..rates import LIMIT_KEY, RateLimit
from ..stale import MAX_LATE_LOWEST_SECONDS, STALE_REASON, exempt, is_stale
from ..steering import announce_cancelled
from ..store import Claimed, ClaimResult, Store
from ..store.control import (
    concurrency_lane,
    free_slots,
    hold_reason,
    is_key_lane,
    slot_of_lane,
)
from ..store.dead_reason import DeadReason
from .gate import ALL_LIMITS, MIN_THROTTLE_SECONDS, Gate
from .handoff import Handoff, detect_handoff
from .publish import Publisher

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["PassReport", "ReleasePass"]

logger = logging.getLogger(__name__)

#: What each zdelay_on_stale outcome did, as the log says it.
_STALE_DONE = {
    "dead": "dead-lettered (celery -A proj zdelay dead requeue puts them back)",
    "drop": "dropped (cancelled)",
    "run": "published anyway",
}

#: How far past the Redis clock's estimate a periodic occurrence makes the
#: handoff name what it moves: covers the estimate's error (the time between
#: the claim that read the clock and the next).
OCCURRENCE_MARGIN_MS = 5_000


@dataclass
class PassReport:
    """What one :meth:`Companion.release_due` pass did."""

    handed_off: int = 0
    published: int = 0
    dead_lettered: int = 0
    #: Entries given back because the broker did not accept them.
    returned: int = 0
    #: Lateness (release time minus due time) of each released entry, in ms.
    lateness_ms: list[int] = field(default_factory=list)
    #: Id of each released entry, in the order of :attr:`lateness_ms`; None
    #: where the handoff moved it without naming it (see :meth:`ReleasePass.claim`).
    task_ids: list[str | None] = field(default_factory=list)
    #: When the next due time or lease expiry comes, on ``time.perf_counter()``;
    #: None when idle.
    next_event_at: float | None = None
    #: The broker or store failed during the pass.
    failed: bool = False
    #: Entries held back by a rate limit or a pause, per control name.
    held: dict[str, int] = field(default_factory=dict)
    #: Stale entries (released past their ``max_late``), per outcome:
    #: ``"dead"``, ``"drop"`` or ``"run"`` (see :mod:`celery_zdelay.stale`).
    stale: dict[str, int] = field(default_factory=dict)

    @property
    def released(self) -> int:
        return self.handed_off + self.published


def _note_event_at(report: PassReport, at: float) -> None:
    """Keep the earliest next event of *report* (``time.perf_counter()``)."""
    if report.next_event_at is None or at < report.next_event_at:
        report.next_event_at = at


class ReleasePass:
    """Releases the due entries of some shards: one call of :meth:`release` per pass."""

    def __init__(
        self,
        app: Celery,
        *,
        config: ZDelayConfig,
        store: Store,
        publisher: Publisher,
        gate: Gate,
        periodic: PeriodicServer | None,
        companion_id: str,
        stopping: threading.Event,
        send: Callable[..., None],
    ) -> None:
        self.app = app
        self.config = config
        self.store = store
        self.publisher = publisher
        self.gate = gate
        self.periodic = periodic
        self.id = companion_id
        self.batch_size = self.config.batch_size
        self.lease_ms = self.config.lease_ms
        #: zdelay_release_ahead_seconds in ms, and as this pass applies it
        #: (none in a pass that fast-forwards time for tests).
        self.ahead_ms = self.config.release_ahead_ms
        self._ahead_ms = self.ahead_ms
        #: Stops a pass after the batch in hand (the companion's stop request).
        self._stopping = stopping
        #: Sends a signal on the companion's behalf (its sender), never raising.
        self._send = send
        self._handoff: Handoff | None = None
        self._handoff_known = False
        self.handoff_state = "unknown"
        #: (Redis time in ms, perf_counter) at the last claim: the Redis clock
        #: without asking it, between claims.
        self._redis_clock: tuple[int, float] | None = None
        #: Routes (exchange, routing key) whose generic-path choice was logged.
        self._generic_routes: set[tuple[str, str]] = set()
        #: Per group of lanes served in turns (a control's bucket, or
        #: LIMIT_KEY for per-key limits), the lane that released first in its
        #: last pass: the next pass starts after it.
        self._turns: dict[str, str] = {}

    def release(self, shards: Sequence[int], report: PassReport, advance_ms: int = 0) -> None:
        """Release every entry due now on *shards*, into *report*.

        *advance_ms* also releases entries due that many ms from now; it is
        for tests that fast-forward time (:mod:`celery_zdelay.testing`).
        Store errors propagate (celery-zdelay's own, see
        :func:`celery_zdelay.store.client.translate`): the caller decides to wait.
        """
        if not self._handoff_known:
            self.detect_handoff()
        # A fast-forwarded pass releases what it picks now, eta-less: an eta
        # would make a worker wait for the real due time.
        self._ahead_ms = 0 if advance_ms else self.ahead_ms
        self.gate.refresh(shards)
        for shard in shards:
            self._release_shard(shard, report, advance_ms)
            if report.failed:
                break
        if self.gate.watching and not report.failed:
            self._release_held(shards, report)

    def _release_shard(self, shard: int, report: PassReport, advance_ms: int = 0) -> None:
        fresh = False
        while True:
            started = time.perf_counter()
            result = self.claim(shard, fresh=fresh, advance_ms=advance_ms)
            claimed_at = time.perf_counter()
            self._redis_clock = (result.now_ms, claimed_at)
            claim_s = claimed_at - started
            claimed = len(result.entries) + len(result.handed_due_ms)
            if result.handed_due_ms:
                lateness = [result.now_ms - due for due in result.handed_due_ms]
                self._count_released(shard, "handoff", report, result.handed_ids, lateness)
            if result.dead:
                self._report_dead(shard, report, result.dead)
            if result.entries:
                self._release_leased(shard, result, report, claimed_at)
            if claimed:
                logger.debug(
                    "Shard %d: claimed %d in %.2f ms (%d handed off, %d leased)",
                    shard,
                    claimed,
                    claim_s * 1000,
                    len(result.handed_due_ms),
                    len(result.entries),
                )
                self._send(signals.batch_claimed, shard=shard, claimed=claimed, seconds=claim_s)
            if report.failed or self._stopping.is_set():
                break
            if result.needs_dests and not fresh:
                # The call stopped at an entry for a queue list parked since
                # the list of them was read: read it again and go on from there
                # (what the call released or leased before it is dealt with).
                fresh = True
                continue
            fresh = False
            if claimed < self.batch_size:
                break
        self._note_next_event(result, report, started)

    def claim(self, shard: int, *, fresh: bool, advance_ms: int = 0) -> ClaimResult:
        """Claim one batch of *shard*'s due entries: handed off where it may be, else leased."""
        # With signing on, every entry is leased and verified in Python first
        # (then pushed atomically by push.lua): handoff.lua cannot check an
        # HMAC, so it must not see entries before they are verified.
        # With a limit or pause on a queue, handoff.lua leases that queue's
        # entries for the gate and hands the others off; with one on a task
        # name (which handoff.lua does not read) every entry is leased.
        gate = self.gate
        if self._handoff is not None and not self.config.signing_keys and not gate.by_task:
            held_dests = gate.held_dests(self._handoff.layout) if gate.active else []
            return self.store.handoff(
                shard,
                dests=self._handoff.dests(self.store, shard, refresh=fresh),
                layout=self._handoff.layout.fingerprint,
                limit=self.batch_size,
                lease_ms=self.lease_ms,
                fresh=fresh,
                advance_ms=advance_ms,
                companion_id=self.id,
                with_ids=self.config.audit_log or self._occurrence_due(advance_ms),
                held_dests=held_dests,
                max_late_ms=self.config.max_late_ms,
                ahead_ms=self._ahead_ms,
            )
        # Leased up to ahead_ms before due; _release_leased gives those their eta.
        return self.store.claim(
            shard,
            limit=self.batch_size,
            lease_ms=self.lease_ms,
            advance_ms=advance_ms + self._ahead_ms,
        )

    def _occurrence_due(self, advance_ms: int) -> bool:
        """Whether the next handoff may release a periodic occurrence: then it names what it moves.

        The handoff names entries only when asked, so that a busy store does
        not pay a string per entry for a schedule that ticks once a minute;
        periodic runs are matched by id (see PeriodicServer.note_released).
        """
        if self.periodic is None:
            return False
        if self._redis_clock is None:
            return True
        redis_ms, at = self._redis_clock
        now_ms = redis_ms + (time.perf_counter() - at) * 1000
        return self.periodic.due_by(int(now_ms) + advance_ms + OCCURRENCE_MARGIN_MS)

    def _release_leased(
        self,
        shard: int,
        result: ClaimResult,
        report: PassReport,
        claimed_at: float,
        *,
        passed: str | None = None,
    ) -> None:
        """Release leased entries: hand off, publish, hold, give back or dead-letter each.

        *passed* names the limit whose tokens the entries were released
        under, None for none (see :meth:`Gate.lane_of`).
        """
        token = result.token
        dead: list[tuple[str, DeadReason]] = []
        pushable: list[tuple[Claimed, TaskMessage]] = []
        generic: list[tuple[Claimed, TaskMessage]] = []
        held: dict[str, list[str]] = {}
        #: Stale entries: id -> ms late, those dead-lettered or dropped, and
        #: those published anyway (counted once the broker took them).
        stale_dead: dict[str, int] = {}
        stale_drop: dict[str, int] = {}
        stale_run: dict[str, int] = {}
        gate = self.gate if self.gate.active else None
        for entry in result.entries:
            try:
                message = decode_entry(
                    entry.payload,
                    self.config.signing_keys,
                    self.store.templates(shard),
                    entry_id=entry.task_id,
                )
            except EntryError as exc:
                dead.append((entry.task_id, self._dead_reason(exc.reason, entry.due_ms)))
                continue
            # Before the gate: an entry held by a pause or limit is judged
            # again when it is claimed from its held set, on that claim's clock.
            late_ms = self._stale_ms(entry, result.now_ms)
            if late_ms is not None:
                outcome = self.config.on_stale
                if outcome == "dead":
                    stale_dead[entry.task_id] = late_ms
                    dead.append((entry.task_id, self._dead_reason(STALE_REASON, entry.due_ms)))
                    continue
                if outcome == "drop":
                    stale_drop[entry.task_id] = late_ms
                    continue
                stale_run[entry.task_id] = late_ms
            lane = gate.lane_of(message, passed=passed) if gate is not None else None
            if lane is not None:
                held.setdefault(lane, []).append(entry.task_id)
                continue
            ahead_head: bytes | None = None
            ahead = bool(self._ahead_ms) and entry.due_ms > result.now_ms
            if ahead:
                # Released ahead of its due time: the worker's ETA timer
                # starts it then. kombu publishes the headers; push.lua the
                # envelope, which takes the eta only if its headers start
                # as Celery writes them (else kombu publishes it).
                message.headers["eta"] = eta_text(entry.due_ms)
                ahead_head = with_eta(message.envelope_head, entry.due_ms)
            handoff = self._handoff
            if (
                handoff is not None
                and self._can_push(message)
                and (not ahead or ahead_head is not None)
            ):
                if ahead_head is not None:
                    message.envelope_head = ahead_head
                # push.lua takes the envelope as an argument: one over the
                # server's limit would close the connection on every pass.
                oversized = too_large(len(message.envelope_head), handoff.bulk_limit)
                if oversized is not None:
                    dead.append((entry.task_id, self._dead_reason(oversized, entry.due_ms)))
                    continue
                pushable.append((entry, message))
            else:
                self._note_generic(message)
                generic.append((entry, message))

        slotted: dict[str, list[str]] = {}
        if gate is not None and gate.concurrency and (pushable or generic):
            pushable, generic, slotted = self._take_slots(pushable, generic, held)
        for lane, task_ids in held.items():
            self._hold(shard, token, lane, task_ids, report)
        if stale_drop:
            self._drop_stale(shard, token, report, stale_drop)
        first_released = len(report.task_ids)
        if pushable:
            self._push(shard, result, report, pushable, claimed_at, stale_run)
        if generic:
            dead += self._publish(shard, result, report, generic, claimed_at, stale_run)
        if dead:
            self._dead_letter(shard, token, report, dead)
        if slotted:
            # A slot taken for an entry the broker did not get (given back,
            # refused, dead-lettered) is freed: it runs nowhere.
            released = set(report.task_ids[first_released:])
            self._free_slots({i: s for i, s in slotted.items() if i not in released})
        if stale_dead:
            self._count_stale(shard, "dead", report, stale_dead)

    def _stale_ms(self, entry: Claimed, now_ms: int) -> int | None:
        """How late *entry* is, claimed at *now_ms* (Redis clock), if that makes it stale.

        None when it is not: within its ``max_late`` (its own, else
        ``zdelay_max_late``), without one, or a periodic occurrence. The
        same rule as handoff.lua's, on the same clock.
        """
        late_ms = now_ms - entry.due_ms
        if late_ms <= MAX_LATE_LOWEST_SECONDS * 1000 or exempt(entry.task_id):
            return None
        limit_ms = entry_max_late_ms(entry.payload)
        if limit_ms is None:
            limit_ms = self.config.max_late_ms
        return late_ms if is_stale(late_ms, limit_ms) else None

    def _drop_stale(
        self, shard: int, token: int, report: PassReport, stale: dict[str, int]
    ) -> None:
        """Cancel stale entries (``zdelay_on_stale = "drop"``), recorded as every cancel is."""
        by = f"companion:{self.id}"
        dropped = self.store.drop_stale(shard, token, list(stale), by=by)
        if not dropped:
            return
        for task_id in dropped:
            logger.debug(
                "Dropped stale %s on shard %d: released %d ms after due, past its max_late",
                task_id,
                shard,
                stale[task_id],
                extra={"task_id": task_id, "shard": shard},
            )
        # REVOKED in the result backend and task-revoked (their receivers), the audit line.
        announce_cancelled(self.app, dropped, by, why=" (stale: released past its max_late)")
        self._count_stale(shard, "drop", report, {task_id: stale[task_id] for task_id in dropped})

    def _count_stale(
        self, shard: int, outcome: str, report: PassReport, stale: Mapping[str, int]
    ) -> None:
        """Add stale entries to *report* and send ``tasks_stale`` (the metrics count it)."""
        if not stale:
            return
        report.stale[outcome] = report.stale.get(outcome, 0) + len(stale)
        # One line per batch: after an outage a backlog goes stale by the
        # thousand, and a line per task would cost more than releasing it
        # (each task's line is at DEBUG; zdelay_audit_log keeps one each).
        logger.warning(
            "Shard %d: %d stale entries %s: released %.1f s to %.1f s after due, past their "
            "max_late",
            shard,
            len(stale),
            _STALE_DONE[outcome],
            min(stale.values()) / 1000,
            max(stale.values()) / 1000,
        )
        self._send(
            signals.tasks_stale,
            shard=shard,
            outcome=outcome,
            task_ids=list(stale),
            lateness_ms=list(stale.values()),
        )

    def _take_slots(
        self,
        pushable: list[tuple[Claimed, TaskMessage]],
        generic: list[tuple[Claimed, TaskMessage]],
        held: dict[str, list[str]],
    ) -> tuple[
        list[tuple[Claimed, TaskMessage]],
        list[tuple[Claimed, TaskMessage]],
        dict[str, list[str]],
    ]:
        """Take the concurrency slots of the entries about to be published.

        Returns the entries that got every slot they need (pushable,
        generic) and, per task id, the slots it took. An entry short of a
        slot goes into *held*, in the lane of the first slot it did not
        get, and gives back the others it got (under-using them for a
        moment, never exceeding them). Slots are taken in due order: the
        earliest entries get them first.
        """
        gate = self.gate
        needs: dict[str, list[str]] = {}
        most: dict[str, int] = {}
        slots_of: dict[str, list[str]] = {}
        for entry, message in (*pushable, *generic):
            slots = gate.slots_for(message)
            slots_of[entry.task_id] = [slot for slot, _ in slots]
            for slot, limit in slots:
                needs.setdefault(slot, []).append(entry.task_id)
                most[slot] = limit
        granted = {
            slot: set(
                gate.control.take_slots(slot, most[slot], ids, max_run_ms=self.config.max_run_ms)
            )
            for slot, ids in needs.items()
        }
        given_back: dict[str, list[str]] = {}
        slotted: dict[str, list[str]] = {}

        def passes(entry: Claimed) -> bool:
            slots = slots_of[entry.task_id]
            missing = [slot for slot in slots if entry.task_id not in granted[slot]]
            if not missing:
                if slots:
                    slotted[entry.task_id] = slots
                return True
            held.setdefault(concurrency_lane(missing[0]), []).append(entry.task_id)
            got = [slot for slot in slots if entry.task_id in granted[slot]]
            if got:
                given_back[entry.task_id] = got
            return False

        pushable = [(entry, message) for entry, message in pushable if passes(entry)]
        generic = [(entry, message) for entry, message in generic if passes(entry)]
        self._free_slots(given_back)
        return pushable, generic, slotted

    def _free_slots(self, slots_by_id: dict[str, list[str]]) -> None:
        """Free the concurrency slots of task ids that were not released."""
        by_slot: dict[str, list[str]] = {}
        for task_id, slots in slots_by_id.items():
            for slot in slots:
                by_slot.setdefault(slot, []).append(task_id)
        for slot, task_ids in by_slot.items():
            free_slots(self.store, [slot], task_ids)

    def _hold(
        self, shard: int, token: int, lane: str, task_ids: list[str], report: PassReport
    ) -> None:
        """Hold entries back under *lane*'s pause or limit: parked, in due order."""
        count = self.gate.control.hold(shard, token, lane, task_ids)
        if not count:
            return
        # A per-key lane counts under its glob: as many names as limits.
        control = self.gate.control_of(lane)
        report.held[control] = report.held.get(control, 0) + count
        self.gate.lanes.setdefault(shard, set()).add(lane)
        reason = hold_reason(lane, self.gate.paused)
        self._send(signals.tasks_held, shard=shard, control=control, reason=reason, count=count)
        logger.debug("Shard %d: %d entries held by %s (%s)", shard, count, lane, reason)

    def _release_held(self, shards: Sequence[int], report: PassReport) -> None:
        """Release what limits and pauses held, in due order, as the limits allow.

        Tokens are taken from the limit's bucket (one for all companions and
        shards) before the claim, and those the claim found no entry for are
        given back. A companion that dies in between spent them on nothing:
        the limit is under-used for a moment, never exceeded, and its
        claimed entries come back when their lease expires.

        A control's lanes (its own, and one per limit key it holds: see
        :func:`~celery_zdelay.store.control.fair_lane`) are served in turns
        from its one bucket (:meth:`_release_in_turns`), each control's
        before the next; per-key limits' lanes (``limit_key:<key>``, each
        with its bucket) go last, in turns of their own.
        """
        gate = self.gate
        done: set[str] = set()
        while not self._stopping.is_set() and not report.failed:
            # The next control's lanes, asked again after each: what one
            # drains may fill the lanes of the next (a key's lane under a
            # queue's limit, once its pause is resumed), released in this pass.
            group: str | None = None
            lanes: list[tuple[str, list[int], RateLimit | None]] = []
            for name, lane_shards in gate.releasable(shards).items():
                limit = gate.limit_of(name)
                bucket = gate.bucket_of(name)
                if (limit is not None and is_key_lane(name)) or bucket in done:
                    continue
                group = group or bucket
                if bucket == group:
                    lanes.append((name, lane_shards, limit))
            if group is None:
                break
            done.add(group)
            self._release_in_turns(group, lanes, report, shared=lanes[0][2])
        # Asked again: the lanes above may have held entries in keys' lanes
        # this pass (a pause resumed, a queue's tokens granted).
        in_turns: list[tuple[str, list[int], RateLimit | None]] = []
        for name, lane_shards in gate.releasable(shards).items():
            limit = gate.limit_of(name)
            if limit is not None and is_key_lane(name):
                in_turns.append((name, lane_shards, limit))
        self._release_in_turns(LIMIT_KEY, in_turns, report)

    def _release_in_turns(
        self,
        group: str,
        lanes: list[tuple[str, list[int], RateLimit | None]],
        report: PassReport,
        *,
        shared: RateLimit | None = None,
    ) -> None:
        """Release *lanes* round robin: each in turn, a share of a batch each.

        Fairness between keys: a key with a backlog (and tokens) large
        enough to fill many batches releases one share, then every other
        key releases its share, and so on; it delays the others by at most
        one turn. Each pass of *group* starts after the lane that released
        first in its last pass, so no key is always served first, and an
        empty lane takes no key's turn. A lane leaves the turns once it has
        no tokens or no entries left.

        With *shared*, the lanes are one control's and take from its one
        bucket (named *group*): each turn takes the tokens of every share
        at once and deals them out in turn order, so a bucket that holds
        fewer serves the lanes the turns reach first; the turns stop when
        the bucket is empty (tokens a lane had no entries for go back, and
        are dealt to the others). Else each lane takes from its own bucket,
        if any.
        """
        if not lanes:
            return
        after = self._turns.get(group)
        start = next((i for i, lane in enumerate(lanes) if after is None or lane[0] > after), 0)
        active = lanes[start:] + lanes[:start]
        first: str | None = None
        while active and not self._stopping.is_set() and not report.failed:
            share = max(1, self.batch_size // len(active))
            if shared is None:
                dealt, granted, wanted = [share] * len(active), share, share
            else:
                wanted = share * len(active)
                granted, wait_ms = self.gate.control.take_tokens(group, shared, wanted)
                if granted < wanted:
                    self._note_wait(report, max(wait_ms / 1000, MIN_THROTTLE_SECONDS))
                dealt = [
                    granted // len(active) + (i < granted % len(active)) for i in range(len(active))
                ]
            more: list[tuple[str, list[int], RateLimit | None]] = []
            short = False
            unused = 0
            for lane, tokens in zip(active, dealt, strict=True):
                if not tokens or self._stopping.is_set() or report.failed:
                    unused += tokens
                    more.append(lane)
                    continue
                claimed, again = self._release_lane(
                    *lane, tokens, report, tokens=tokens if shared is not None else 0
                )
                if claimed and first is None:
                    first = lane[0]
                if again:
                    more.append(lane)
                else:
                    short = True
            if shared is not None and unused:
                # Dealt to lanes a stop or a failure left unserved.
                self.gate.control.give_back(group, shared, unused)
            # A shared bucket short of tokens ends the turns, unless a lane
            # gave some back (it had fewer entries): then the others get them.
            active = more if granted == wanted or short else []
        if first is not None:
            self._turns[group] = first

    def _release_lane(
        self,
        name: str,
        lane_shards: list[int],
        limit: RateLimit | None,
        most: int,
        report: PassReport,
        *,
        tokens: int = 0,
    ) -> tuple[int, bool]:
        """Release up to *most* of the first entries *name* holds, as its limit allows.

        *tokens* were taken from the limit's bucket for it already (its turn
        of a shared bucket: see :meth:`_release_in_turns`); else it takes
        its own. Those no entry was claimed for go back to the bucket.
        Returns how many it claimed, and whether more may be released now:
        all *most* were granted and claimed.
        """
        gate = self.gate
        order = gate.first_held(name, lane_shards, most)
        wanted = len(order)
        if not wanted:
            if limit is not None and tokens:
                gate.control.give_back(gate.bucket_of(name), limit, tokens)
            # Only held sets this companion knows of: a limit with
            # nothing held costs a peek per shard, no write.
            for shard in lane_shards:
                if name in gate.lanes.get(shard, ()) and gate.control.forget_lane(shard, name):
                    gate.lanes[shard].discard(name)
            return 0, False
        granted = wanted
        slot = slot_of_lane(name)
        if slot is not None:
            # Only as many as there are free slots now: the others would be
            # claimed only to be held again. Each claimed entry still takes
            # its slot (another companion may take the free ones first).
            granted = min(wanted, self._free_slot_count(slot))
            if not granted:
                return 0, False
        elif tokens:
            granted = min(wanted, tokens)
        elif limit is not None:
            granted, wait_ms = gate.control.take_tokens(gate.bucket_of(name), limit, wanted)
            if granted < wanted:
                self._note_wait(report, max(wait_ms / 1000, MIN_THROTTLE_SECONDS))
            if not granted:
                return 0, False
        claimed = 0
        counts: dict[int, int] = {}
        for shard in order[:granted]:
            counts[shard] = counts.get(shard, 0) + 1
        for shard, count in counts.items():
            result = gate.control.claim_held(shard, name, limit=count, lease_ms=self.lease_ms)
            claimed_at = time.perf_counter()
            self._redis_clock = (result.now_ms, claimed_at)
            claimed += len(result.entries)
            if result.entries:
                # Only a limit's tokens pass it: entries drained without
                # (a pause resumed, a limit removed) meet every limit.
                passed = gate.bucket_of(name) if limit is not None else None
                if slot is not None:
                    # It waited for a slot after passing every limit.
                    passed = ALL_LIMITS
                self._release_leased(shard, result, report, claimed_at, passed=passed)
        if limit is not None:
            gate.control.give_back(gate.bucket_of(name), limit, (tokens or granted) - claimed)
        logger.debug(
            "%s: %d of the first %d held entries granted, %d claimed",
            name,
            granted,
            wanted,
            claimed,
        )
        return claimed, granted == most and claimed == granted

    def _free_slot_count(self, slot: str) -> int:
        """How many slots of *slot* are free now (all, once its control is gone)."""
        limit = self.gate.slot_limit(slot)
        if limit is None:
            return self.batch_size
        return max(0, limit - self.gate.control.live_slots(slot))

    @staticmethod
    def _note_wait(report: PassReport, seconds: float) -> None:
        _note_event_at(report, time.perf_counter() + seconds)

    def _can_push(self, message: TaskMessage) -> bool:
        """Whether a leased (signed) entry can still go through the atomic handoff."""
        handoff = self._handoff
        return (
            handoff is not None
            and message.handoff_dest is not None
            and message.handoff_layout == handoff.layout.fingerprint
        )

    def _note_generic(self, message: TaskMessage) -> None:
        """Say once per route why its messages take kombu, not the atomic handoff."""
        handoff = self._handoff
        route = (message.exchange, message.routing_key)
        if handoff is None or route in self._generic_routes:
            return
        self._generic_routes.add(route)
        if message.handoff_dest is None:
            why = (
                "they name an exchange (or a queue with an expiry) that only kombu can "
                "route, or their producer's broker was not Redis"
            )
        else:
            why = (
                "they were parked under other Redis transport options "
                "(sep, priority_steps or global_keyprefix) than this companion's broker"
            )
        logger.info(
            "Messages for exchange %r, routing key %r are published through kombu, "
            "not handed off atomically: %s",
            message.exchange,
            message.routing_key,
            why,
        )

    def _push(
        self,
        shard: int,
        result: ClaimResult,
        report: PassReport,
        entries: list[tuple[Claimed, TaskMessage]],
        claimed_at: float,
        stale_run: Mapping[str, int],
    ) -> None:
        # push.lua pushes the envelope read (and verified) here, not what the
        # store holds by then: a payload or template rewritten since the claim
        # is never published.
        routes = [
            (entry.task_id, str(message.handoff_dest), message.envelope_head)
            for entry, message in entries
        ]
        pushed_ids, refused = self.store.push(
            shard, result.token, routes, by=self.id, ahead_ms=self._ahead_ms
        )
        pushed = set(pushed_ids)
        released = [(entry, message) for entry, message in entries if entry.task_id in pushed]
        self._released(shard, "handoff", released, result, claimed_at, report, stale_run)
        if refused:
            due_ms = {entry.task_id: entry.due_ms for entry, _ in entries}
            dead = [(task_id, self._dead_reason(why, due_ms[task_id])) for task_id, why in refused]
            self._dead_letter(shard, result.token, report, dead)

    def _publish(
        self,
        shard: int,
        result: ClaimResult,
        report: PassReport,
        entries: list[tuple[Claimed, TaskMessage]],
        claimed_at: float,
        stale_run: Mapping[str, int],
    ) -> list[tuple[str, DeadReason]]:
        """Publish through kombu; ack what the broker accepted, give back the rest.

        Returns the entries the broker refused for good, to dead-letter.
        """
        outcome = self.publisher.publish([message for _, message in entries])
        accepted = [entries[i] for i in outcome.accepted]
        settled = set(outcome.accepted) | set(outcome.rejected)
        returned = [entry.task_id for i, (entry, _) in enumerate(entries) if i not in settled]

        self.store.ack(
            shard,
            result.token,
            [entry.task_id for entry, _ in accepted],
            by=self.id,
            ahead_ms=self._ahead_ms,
        )
        if returned:
            self.store.unclaim(shard, result.token, returned)
            report.returned += len(returned)
            report.failed = True
        self._released(shard, "publish", accepted, result, claimed_at, report, stale_run)
        return [
            (entries[i][0].task_id, self._dead_reason(refusal, entries[i][0].due_ms))
            for i, refusal in outcome.rejected.items()
        ]

    def _released(
        self,
        shard: int,
        path: str,
        released: list[tuple[Claimed, TaskMessage]],
        result: ClaimResult,
        claimed_at: float,
        report: PassReport,
        stale_run: Mapping[str, int],
    ) -> None:
        """Count, signal and log leased entries that reached the broker.

        Those of *stale_run* (id -> ms late) were stale and published anyway
        (``zdelay_on_stale = "run"``): counted as such once the broker took them.
        """
        if not released:
            return
        if stale_run:
            ran = {e.task_id: stale_run[e.task_id] for e, _ in released if e.task_id in stale_run}
            self._count_stale(shard, "run", report, ran)
        # On the Redis clock: the claim's time plus what releasing took.
        released_ms = result.now_ms + round((time.perf_counter() - claimed_at) * 1000)
        lateness = [released_ms - entry.due_ms for entry, _ in released]
        task_ids = [entry.task_id for entry, _ in released]
        headers = [message.headers for _, message in released]
        self._count_released(shard, path, report, task_ids, lateness, headers)
        if not logger.isEnabledFor(logging.DEBUG):
            return  # not a dict and a call per released entry for nothing
        for (entry, message), late_ms in zip(released, lateness, strict=True):
            logger.debug(
                "Released %s[%s] %d ms after due",
                message.task_name,
                entry.task_id,
                late_ms,
                extra={"task_id": entry.task_id, "task_name": message.task_name, "shard": shard},
            )

    def _count_released(
        self,
        shard: int,
        path: str,
        report: PassReport,
        task_ids: list[str],
        lateness: list[int],
        headers: list[dict[str, Any]] | None = None,
    ) -> None:
        """Add released entries to *report* and send ``batch_released`` (audit included).

        *task_ids* is empty where the handoff moved entries without naming
        them; *headers* None where it did not read them.
        """
        if path == "handoff":
            report.handed_off += len(lateness)
        else:
            report.published += len(lateness)
        report.lateness_ms += lateness
        report.task_ids += task_ids or [None] * len(lateness)
        self._send(
            signals.batch_released,
            shard=shard,
            path=path,
            count=len(lateness),
            lateness_ms=lateness,
            task_ids=task_ids or None,
            headers=headers,
        )

    def _dead_letter(
        self,
        shard: int,
        token: int,
        report: PassReport,
        dead: list[tuple[str, DeadReason]],
    ) -> None:
        self.store.dead_letter(shard, token, dead)
        self._report_dead(shard, report, dead)

    def _report_dead(
        self, shard: int, report: PassReport, dead: list[tuple[str, DeadReason]]
    ) -> None:
        """Count, log and signal entries moved to the dead-letter set (audit included)."""
        report.dead_lettered += len(dead)
        for task_id, reason in dead:
            # A stale entry is what its max_late asked for: summed up in
            # one line per batch (_count_stale), not an error each.
            logger.log(
                logging.DEBUG if reason.reason == STALE_REASON else logging.ERROR,
                "Dead-lettered %s on shard %d: %s",
                task_id,
                shard,
                reason.reason,
                extra={"task_id": task_id, "shard": shard, "reason": reason.reason},
            )
            self._send(
                signals.task_dead_lettered,
                shard=shard,
                task_id=task_id,
                reason=reason.reason,
                due_ms=reason.due_ms,
            )

    def _dead_reason(self, reason: str, due_ms: int) -> DeadReason:
        return DeadReason(reason=reason, due_ms=due_ms, companion=self.id)

    def _note_next_event(self, result: ClaimResult, report: PassReport, started: float) -> None:
        """Note when *result*'s next entry falls due, counted from *started*.

        The claim read Redis's clock (cut to the millisecond) between
        *started* and its reply. Counting the wait from the reply, or from
        when the sleep begins, adds everything in between (the reply, the
        release, the other shards) to the next entry's lateness; counted
        from *started*, a companion wakes at most the call's way there
        early, and the claim then finds nothing due (its script compares
        with Redis's clock) and names the same next time again.
        """
        # The next entry may be released ahead_ms before it is due.
        next_release_ms = None if result.next_due_ms is None else result.next_due_ms - self.ahead_ms
        candidates = [
            ms - result.now_ms for ms in (next_release_ms, result.next_lease_ms) if ms is not None
        ]
        if candidates:
            _note_event_at(report, started + max(0, min(candidates)) / 1000)

    # -- helpers --------------------------------------------------------------

    def detect_handoff(self) -> None:
        try:
            self._handoff, self.handoff_state = detect_handoff(
                self.app, self.store, wait=self.publisher.broker_wait
            )
            self._handoff_known = True
        except Exception as exc:
            # The Redis broker is unreachable; use the generic path until it is back.
            self._handoff, self.handoff_state = None, f"unknown yet ({exc!r})"
            logger.warning("Could not tell whether the broker is the store's Redis: %r", exc)
