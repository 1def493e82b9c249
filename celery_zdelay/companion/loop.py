"""The companion: sleep until the next entry is due, release it, repeat.

One pass of :meth:`Companion.release_due` walks the shards; on each it
claims due entries in bounded batches (handoff.lua straight into a Redis
broker, or claim.lua into a lease), publishes what was leased, acknowledges
what the broker accepted, gives back what it did not, and dead-letters what
can never be published. Between passes it sleeps until the earliest due time
or lease expiry, woken early when an earlier entry is parked.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis

from .. import __version__, signals
from .._format import shard_ranges as _shard_ranges
from ..bulk_limit import too_large
from ..config import get_config
from ..entry import TaskMessage, decode_entry
from ..errors import EntryError, StoreUnavailableError
from ..periodic.server import TEND_EVERY_SECONDS, PeriodicServer
from ..store import Claimed, ClaimResult, Store
from ..store.admin import COMPANION_ALIVE_MS, log_store_warnings
from ..store.client import sanitize_url
from ..store.keys import companions_key
from .gate import MIN_THROTTLE_SECONDS, REFRESH_SECONDS, Gate
from .handoff import Handoff, detect_handoff
from .ownership import ShardOwnership
from .publish import Publisher, is_transient_reply, make_publisher
from .wakeup import Wakeup

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["Companion", "PassReport"]

logger = logging.getLogger(__name__)
#: The opt-in audit trail (zdelay_audit_log): one INFO line per task.
audit = logging.getLogger("celery_zdelay.audit")

#: Longest sleep with nothing due; a safety net under the wake-up channel.
MAX_IDLE_SECONDS = 1.0
#: Longest uninterrupted sleep, so a stop request is seen promptly.
SLEEP_SLICE_SECONDS = 0.1
#: Seconds between heartbeats in the companions hash.
HEARTBEAT_SECONDS = 5.0
#: A companion whose heartbeat is older than this counts as gone (as in status).
HEARTBEAT_LIVE_SECONDS = COMPANION_ALIVE_MS / 1000
#: Heartbeats older than this are removed from the companions hash.
HEARTBEAT_PRUNE_SECONDS = 3600.0
#: Longest a starting companion waits for its first periodic pass before
#: releasing (a pass that fails ends the wait at once).
FIRST_PERIODIC_PASS_SECONDS = 30.0
#: How far past the Redis clock's estimate a periodic occurrence makes the
#: handoff name what it moves: covers the estimate's error (the time between
#: the claim that read the clock and the next).
OCCURRENCE_MARGIN_MS = 5_000

#: Pauses after consecutive failures (store or broker unreachable), growing to the last.
BACKOFF_SECONDS = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


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
    #: where the handoff moved it without naming it (see :meth:`Companion._claim`).
    task_ids: list[str | None] = field(default_factory=list)
    #: Seconds until the next due time or lease expiry; None when idle.
    next_event_s: float | None = None
    #: The broker or store failed during the pass.
    failed: bool = False
    #: Entries held back by a rate limit or a pause, per control name.
    held: dict[str, int] = field(default_factory=dict)

    @property
    def released(self) -> int:
        return self.handed_off + self.published


class Companion:
    """Releases the parked entries of one Celery app when they are due."""

    def __init__(
        self,
        app: Celery,
        *,
        shards: Sequence[int] | None = None,
        store: Store | None = None,
        beat: bool | None = None,
    ) -> None:
        self.app = app
        self.config = get_config(app)
        self.store = store if store is not None else Store(self.config)
        self.shards = list(shards) if shards is not None else list(self.store.shards)
        self.batch_size = self.config.batch_size
        self.lease_ms = self.config.lease_ms
        self.publisher: Publisher = make_publisher(app, lease_ms=self.config.lease_ms)
        self.id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._handoff: Handoff | None = None
        self._handoff_known = False
        self.handoff_state = "unknown"
        #: The wake-up listener while :meth:`run` runs (its problem goes in the heartbeat).
        self._wakeup: Wakeup | None = None
        self._stopping = threading.Event()
        #: When this companion was made, on the monotonic clock; heartbeats
        #: turn it into Redis time (the one clock ``status`` compares with).
        self._started = time.monotonic()
        self._last_heartbeat = 0.0
        self._live_companions = 1
        #: (Redis time in ms, perf_counter) at the last claim: the Redis clock
        #: without asking it, between claims.
        self._redis_clock: tuple[int, float] | None = None
        #: Routes (exchange, routing key) whose generic-path choice was logged.
        self._generic_routes: set[tuple[str, str]] = set()
        self._ownership = (
            ShardOwnership(self.store, self.id, self.shards, lease_ms=self.lease_ms)
            if self.config.shard_leases
            else None
        )
        self.totals = PassReport()
        #: Rate limits and pauses (see gate.py).
        self.gate = Gate(self.store)
        #: Serves beat_schedule (zdelay_beat or ``--beat``), else None.
        self.periodic = (
            PeriodicServer(app, self.store, companion_id=self.id)
            if (self.config.beat if beat is None else beat)
            else None
        )

    # -- running ----------------------------------------------------------------

    def run(self) -> None:
        """Release entries as they fall due until :meth:`stop` is called."""
        periodic = self._start_periodic()
        self._detect_handoff()
        logger.info(
            "celery-zdelay %s companion %s started: store %s (shards %s), broker %s, handoff %s, "
            "periodic tasks %s",
            __version__,
            self.id,
            sanitize_url(self.store.url),
            _shard_ranges(self.shards),
            sanitize_url(self.publisher.broker_url),
            self.handoff_state,
            "served" if self.periodic is not None else "not served (no --beat)",
        )
        # Parked tasks are only as durable as Redis, and only released from the
        # configured shards: say so when they are at risk.
        log_store_warnings(self.store)
        wakeup = Wakeup(self.store.client, [self.store.keys(s).wake for s in self.shards])
        wakeup.start()
        self._wakeup = wakeup
        self._send(signals.companion_started)
        failures = 0
        try:
            while not self._stopping.is_set():
                self._heartbeat()
                report = self._pass()
                self._note_periodic_runs(report)
                if report.failed:
                    pause = BACKOFF_SECONDS[min(failures, len(BACKOFF_SECONDS) - 1)]
                    failures += 1
                    self._sleep(wakeup, pause, wake_early=False)
                    continue
                if failures:
                    logger.info(
                        "Store and broker answer again: releasing (%d passes failed).", failures
                    )
                failures = 0
                wait = MAX_IDLE_SECONDS
                if report.next_event_s is not None:
                    wait = min(wait, report.next_event_s)
                if self._ownership is not None:
                    wait = min(wait, self._ownership.check_seconds)
                if self.gate.watching:
                    # Held entries are not in the due set the claims look at.
                    wait = min(wait, REFRESH_SECONDS)
                self._sleep(wakeup, wait)
        finally:
            self._stopping.set()
            if periodic is not None:
                periodic.join()
            wakeup.close()
            self.close()
            if self._ownership is not None:
                self._ownership.release_all()
            self._forget_heartbeat()
            self._send(signals.companion_stopped)
            logger.info(
                "celery-zdelay companion %s stopped after releasing %d tasks",
                self.id,
                self.totals.released,
            )

    def _pass(self) -> PassReport:
        """One pass of :meth:`run`; an unforeseen error is logged and backed off.

        What the pass had claimed stays leased and comes back when the lease
        expires, so carrying on loses nothing; stopping would strand it until
        another companion runs.
        """
        try:
            return self._renew_ownership() or self.release_due()
        except Exception:
            logger.exception("A release pass failed unexpectedly; retrying with backoff")
            return PassReport(failed=True)

    def close(self) -> None:
        """Close the broker connection (``run`` does this when it returns)."""
        self.publisher.close()

    def __enter__(self) -> Companion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stop(self) -> None:
        """Ask :meth:`run` to return after the batch in hand; safe in signal handlers."""
        self._stopping.set()

    def _sleep(self, wakeup: Wakeup, seconds: float, *, wake_early: bool = True) -> None:
        deadline = time.monotonic() + seconds
        while not self._stopping.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            slice_s = min(remaining, SLEEP_SLICE_SECONDS)
            if wake_early:
                if wakeup.wait(slice_s):
                    return
            else:
                self._stopping.wait(slice_s)

    # -- one pass -------------------------------------------------------------

    def release_due(self, *, advance_ms: int = 0) -> PassReport:
        """Release every entry due now on this companion's shards.

        *advance_ms* also releases entries due that many ms from now; it is
        for tests that fast-forward time (:mod:`celery_zdelay.testing`).
        """
        report = PassReport()
        try:
            if not self._handoff_known:
                self._detect_handoff()
            shards = self._ownership.shards() if self._ownership else self.shards
            self.gate.refresh(shards)
            for shard in shards:
                self._release_shard(shard, report, advance_ms)
                if report.failed:
                    break
            if self.gate.watching and not report.failed:
                self._release_held(shards, report)
        except StoreUnavailableError as exc:
            logger.warning("Store unreachable, retrying with backoff: %s", exc)
            report.failed = True
        except redis.exceptions.ResponseError as exc:
            if not is_transient_reply(exc):
                raise
            self._store_refused(exc)
            report.failed = True
        self._add_to_totals(report)
        return report

    def _store_refused(self, exc: redis.exceptions.ResponseError) -> None:
        """Say why the store refuses to work, and what fixes it.

        The entries stay where the refused script found them (every script
        checks before its first write), so waiting loses nothing.
        """
        text = str(exc)
        url = sanitize_url(self.store.url)
        if isinstance(exc, redis.exceptions.OutOfMemoryError) or text.startswith("OOM"):
            why = (
                f"the store Redis at {url} is out of memory (used memory above maxmemory, "
                "eviction off): parked tasks are kept but nothing can be released. "
                "Raise maxmemory or free memory"
            )
        elif isinstance(exc, redis.exceptions.ReadOnlyError) or text.startswith("READONLY"):
            why = (
                f"the store Redis at {url} is a read-only replica. Point zdelay_redis_url "
                "at the primary (or use a sentinel:// URL so failovers are followed)"
            )
        else:
            why = f"the store Redis at {url} refuses writes for now ({text})"
        logger.error("Releases paused: %s; retrying with backoff.", why)

    def _release_shard(self, shard: int, report: PassReport, advance_ms: int = 0) -> None:
        fresh = False
        while True:
            started = time.perf_counter()
            result = self._claim(shard, fresh=fresh, advance_ms=advance_ms)
            claimed_at = time.perf_counter()
            self._redis_clock = (result.now_ms, claimed_at)
            claim_s = claimed_at - started
            claimed = len(result.entries) + len(result.handed_due_ms)
            if result.handed_due_ms:
                lateness = [result.now_ms - due for due in result.handed_due_ms]
                report.handed_off += len(lateness)
                report.lateness_ms += lateness
                report.task_ids += result.handed_ids or [None] * len(lateness)
                self._send(
                    signals.batch_released,
                    shard=shard,
                    path="handoff",
                    count=len(lateness),
                    lateness_ms=lateness,
                    task_ids=result.handed_ids or None,
                )
                if self.config.audit_log:
                    for task_id, late_ms in zip(result.handed_ids, lateness, strict=True):
                        audit.info(
                            "Released %s (handoff) %d ms after due",
                            task_id,
                            late_ms,
                            extra={"task_id": task_id},
                        )
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
        self._note_next_event(result, report)

    def _claim(self, shard: int, *, fresh: bool, advance_ms: int = 0) -> ClaimResult:
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
            )
        return self.store.claim(
            shard, limit=self.batch_size, lease_ms=self.lease_ms, advance_ms=advance_ms
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

        *passed* names the control whose tokens the entries were released
        under (see :meth:`Gate.lane_of`).
        """
        token = result.token
        dead: list[tuple[str, dict[str, Any]]] = []
        pushable: list[tuple[Claimed, TaskMessage]] = []
        generic: list[tuple[Claimed, TaskMessage]] = []
        held: dict[str, list[str]] = {}
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
            lane = gate.lane_of(message, passed=passed) if gate is not None else None
            if lane is not None:
                held.setdefault(lane, []).append(entry.task_id)
                continue
            handoff = self._handoff
            if handoff is not None and self._can_push(message):
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

        for lane, task_ids in held.items():
            self._hold(shard, token, lane, task_ids, report)
        if pushable:
            self._push(shard, result, report, pushable, claimed_at)
        if generic:
            dead += self._publish(shard, result, report, generic, claimed_at)
        if dead:
            self._dead_letter(shard, token, report, dead)

    def _hold(
        self, shard: int, token: int, lane: str, task_ids: list[str], report: PassReport
    ) -> None:
        """Hold entries back under *lane*'s pause or limit: parked, in due order."""
        count = self.gate.control.hold(shard, token, lane, task_ids)
        if not count:
            return
        report.held[lane] = report.held.get(lane, 0) + count
        self.gate.lanes.setdefault(shard, set()).add(lane)
        reason = "pause" if lane in self.gate.paused else "rate_limit"
        self._send(signals.tasks_held, shard=shard, control=lane, reason=reason, count=count)
        logger.debug("Shard %d: %d entries held by %s (%s)", shard, count, lane, reason)

    def _release_held(self, shards: Sequence[int], report: PassReport) -> None:
        """Release what limits and pauses held, in due order, as the limits allow.

        Tokens are taken from the limit's bucket (one for all companions and
        shards) before the claim, and those the claim found no entry for are
        given back. A companion that dies in between spent them on nothing:
        the limit is under-used for a moment, never exceeded, and its
        claimed entries come back when their lease expires.
        """
        gate = self.gate
        for name, lane_shards in gate.releasable(shards).items():
            limit = gate.limits.get(name)
            while not self._stopping.is_set() and not report.failed:
                order = gate.first_held(name, lane_shards, self.batch_size)
                wanted = len(order)
                if not wanted:
                    # Only held sets this companion knows of: a limit with
                    # nothing held costs a peek per shard, no write.
                    for shard in lane_shards:
                        if name in gate.lanes.get(shard, ()) and gate.control.forget_lane(
                            shard, name
                        ):
                            gate.lanes[shard].discard(name)
                    break
                granted = wanted
                if limit is not None:
                    granted, wait_ms = gate.control.take_tokens(name, limit, wanted)
                    if granted < wanted:
                        self._note_wait(report, max(wait_ms / 1000, MIN_THROTTLE_SECONDS))
                    if not granted:
                        break
                claimed = 0
                counts: dict[int, int] = {}
                for shard in order[:granted]:
                    counts[shard] = counts.get(shard, 0) + 1
                for shard, count in counts.items():
                    result = gate.control.claim_held(
                        shard, name, limit=count, lease_ms=self.lease_ms
                    )
                    claimed_at = time.perf_counter()
                    self._redis_clock = (result.now_ms, claimed_at)
                    claimed += len(result.entries)
                    if result.entries:
                        self._release_leased(shard, result, report, claimed_at, passed=name)
                if limit is not None:
                    gate.control.give_back(name, limit, granted - claimed)
                logger.debug(
                    "%s: %d of the first %d held entries granted, %d claimed",
                    name,
                    granted,
                    wanted,
                    claimed,
                )
                if granted < self.batch_size or claimed < granted:
                    break

    @staticmethod
    def _note_wait(report: PassReport, seconds: float) -> None:
        if report.next_event_s is None or seconds < report.next_event_s:
            report.next_event_s = seconds

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
    ) -> None:
        # push.lua pushes the envelope read (and verified) here, not what the
        # store holds by then: a payload or template rewritten since the claim
        # is never published.
        routes = [
            (entry.task_id, str(message.handoff_dest), message.envelope_head)
            for entry, message in entries
        ]
        pushed_ids, refused = self.store.push(shard, result.token, routes)
        pushed = set(pushed_ids)
        released = [(entry, message) for entry, message in entries if entry.task_id in pushed]
        self._released(shard, "handoff", released, result, claimed_at, report)
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
    ) -> list[tuple[str, dict[str, Any]]]:
        """Publish through kombu; ack what the broker accepted, give back the rest.

        Returns the entries the broker refused for good, to dead-letter.
        """
        outcome = self.publisher.publish([message for _, message in entries])
        accepted = [entries[i] for i in outcome.accepted]
        settled = set(outcome.accepted) | set(outcome.rejected)
        returned = [entry.task_id for i, (entry, _) in enumerate(entries) if i not in settled]

        self.store.ack(shard, result.token, [entry.task_id for entry, _ in accepted])
        if returned:
            self.store.unclaim(shard, result.token, returned)
            report.returned += len(returned)
            report.failed = True
        self._released(shard, "publish", accepted, result, claimed_at, report)
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
    ) -> None:
        """Count, log and signal leased entries that reached the broker."""
        if not released:
            return
        # On the Redis clock: the claim's time plus what releasing took.
        released_ms = result.now_ms + round((time.perf_counter() - claimed_at) * 1000)
        lateness = [released_ms - entry.due_ms for entry, _ in released]
        if path == "handoff":
            report.handed_off += len(released)
        else:
            report.published += len(released)
        report.lateness_ms += lateness
        task_ids = [entry.task_id for entry, _ in released]
        report.task_ids += task_ids
        self._send(
            signals.batch_released,
            shard=shard,
            path=path,
            count=len(released),
            lateness_ms=lateness,
            task_ids=task_ids,
            headers=[message.headers for _, message in released],
        )
        if self.config.audit_log:
            for task_id, late_ms in zip(task_ids, lateness, strict=True):
                audit.info(
                    "Released %s (%s) %d ms after due",
                    task_id,
                    path,
                    late_ms,
                    extra={"task_id": task_id},
                )
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

    def _dead_letter(
        self,
        shard: int,
        token: int,
        report: PassReport,
        dead: list[tuple[str, dict[str, Any]]],
    ) -> None:
        self.store.dead_letter(shard, token, dead)
        self._report_dead(shard, report, dead)

    def _report_dead(
        self, shard: int, report: PassReport, dead: list[tuple[str, dict[str, Any]]]
    ) -> None:
        """Count, log and signal entries moved to the dead-letter set."""
        report.dead_lettered += len(dead)
        for task_id, reason in dead:
            if self.config.audit_log:
                audit.info(
                    "Dead-lettered %s: %s", task_id, reason["reason"], extra={"task_id": task_id}
                )
            logger.error(
                "Dead-lettered %s on shard %d: %s",
                task_id,
                shard,
                reason["reason"],
                extra={"task_id": task_id, "shard": shard, "reason": reason["reason"]},
            )
            self._send(
                signals.task_dead_lettered,
                shard=shard,
                task_id=task_id,
                reason=reason["reason"],
                due_ms=reason["due_ms"],
            )

    def _dead_reason(self, reason: str, due_ms: int) -> dict[str, Any]:
        return {"reason": reason, "due_ms": due_ms, "companion": self.id}

    def _note_next_event(self, result: ClaimResult, report: PassReport) -> None:
        candidates = [
            ms - result.now_ms
            for ms in (result.next_due_ms, result.next_lease_ms)
            if ms is not None
        ]
        if candidates:
            seconds = max(0, min(candidates)) / 1000
            if report.next_event_s is None or seconds < report.next_event_s:
                report.next_event_s = seconds

    # -- helpers --------------------------------------------------------------

    def _start_periodic(self) -> threading.Thread | None:
        """Serve beat_schedule in a thread of its own (when this companion serves it).

        Parking ahead writes only to Redis: a release pass that waits for a
        broker (connection retries, backoff) must not hold it back, or an
        occurrence not parked by its time would count as missed.
        """
        if self.periodic is None:
            return None
        thread = threading.Thread(
            target=self._serve_periodic, name=f"zdelay-periodic-{self.id}", daemon=True
        )
        thread.start()
        # Occurrences an outage left parked are sorted out by the missed
        # policy before this companion releases any (bounded: a store that
        # does not answer must not hold releases back).
        self.periodic.first_pass.wait(FIRST_PERIODIC_PASS_SECONDS)
        return thread

    def _serve_periodic(self) -> None:
        """Store beat_schedule, then park each schedule's next occurrences, until stopped.

        A failure here is logged, backed off and never stops releases.
        """
        assert self.periodic is not None
        start, failures = True, 0
        while not self._stopping.is_set():
            try:
                if start:
                    start = False
                    self.periodic.reconcile()
                self.periodic.tend()
                failures, wait = 0, TEND_EVERY_SECONDS
            except StoreUnavailableError as exc:
                logger.warning("Store unreachable, periodic tasks wait: %s", exc)
                wait = BACKOFF_SECONDS[min(failures, len(BACKOFF_SECONDS) - 1)]
                failures += 1
            except Exception:
                logger.exception("Serving periodic tasks failed; retrying with backoff")
                wait = BACKOFF_SECONDS[min(failures, len(BACKOFF_SECONDS) - 1)]
                failures += 1
            # Releases wait for the first pass, not for a failing one.
            self.periodic.first_pass.set()
            self._stopping.wait(wait)

    def _note_periodic_runs(self, released: PassReport) -> None:
        """Record when the periodic occurrences among what *released* held ran, and how late."""
        if self.periodic is None or not released.task_ids:
            return
        try:
            self.periodic.note_released(released.task_ids, released.lateness_ms)
        except StoreUnavailableError as exc:
            logger.warning("Store unreachable, periodic runs not recorded: %s", exc)
        except Exception:
            logger.exception("Recording periodic runs failed")

    def _renew_ownership(self) -> PassReport | None:
        """Keep shard leases up to date; a failed report when the store is down."""
        if self._ownership is None:
            return None
        try:
            self._ownership.maybe_renew(self._live_companions)
        except StoreUnavailableError as exc:
            logger.warning("Store unreachable, retrying with backoff: %s", exc)
            return PassReport(failed=True)
        except redis.exceptions.ResponseError as exc:
            if not is_transient_reply(exc):
                raise
            self._store_refused(exc)
            return PassReport(failed=True)
        return None

    def _detect_handoff(self) -> None:
        try:
            self._handoff, self.handoff_state = detect_handoff(
                self.app, self.store, wait=self.publisher.broker_wait
            )
            self._handoff_known = True
        except Exception as exc:
            # The Redis broker is unreachable; use the generic path until it is back.
            self._handoff, self.handoff_state = None, f"unknown yet ({exc!r})"
            logger.warning("Could not tell whether the broker is the store's Redis: %r", exc)

    def _add_to_totals(self, report: PassReport) -> None:
        self.totals.handed_off += report.handed_off
        self.totals.published += report.published
        self.totals.dead_lettered += report.dead_lettered
        self.totals.returned += report.returned

    def _send(self, signal: Any, **kwargs: Any) -> None:
        # A failing receiver must not stop releases: log it and carry on.
        for receiver, response in signal.send_robust(sender=self, **kwargs):
            if isinstance(response, Exception):
                logger.error(
                    "celery-zdelay signal %s receiver %r failed: %r",
                    signal.name,
                    receiver,
                    response,
                )

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_heartbeat < HEARTBEAT_SECONDS:
            return
        self._last_heartbeat = now
        key = companions_key(self.config.key_prefix)
        try:
            # The Redis clock, not this host's: status compares heartbeats
            # with Redis TIME, and a host clock minutes off must not make a
            # live companion look dead (or a dead one alive).
            now_ms = self.store.time_ms()
            beat = {
                "id": self.id,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "version": __version__,
                "shards": self._ownership.shards() if self._ownership else self.shards,
                "handoff": self.handoff_state,
                "started_ms": now_ms - round((now - self._started) * 1000),
                "seen_ms": now_ms,
                "released": self.totals.released,
                "dead_lettered": self.totals.dead_lettered,
                "wakeup": (self._wakeup.problem if self._wakeup else None) or "",
                "beat": self.periodic is not None,
            }
            client = self.store.client
            client.hset(key, self.id, json.dumps(beat))
            live = 0
            for companion, raw in client.hgetall(key).items():
                seen_ms = json.loads(raw).get("seen_ms", 0)
                if seen_ms < now_ms - HEARTBEAT_PRUNE_SECONDS * 1000:
                    client.hdel(key, companion)
                elif seen_ms >= now_ms - HEARTBEAT_LIVE_SECONDS * 1000:
                    live += 1
            self._live_companions = max(live, 1)
        except Exception as exc:
            logger.debug("Heartbeat failed: %r", exc)

    def _forget_heartbeat(self) -> None:
        try:
            self.store.client.hdel(companions_key(self.config.key_prefix), self.id)
        except Exception:
            logger.debug("Could not remove the heartbeat of %s", self.id, exc_info=True)
