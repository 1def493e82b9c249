"""The companion: sleep until the next entry is due, release it, repeat.

Each pass of :meth:`Companion.release_due` is a :class:`~.release.ReleasePass`
over the shards this companion owns. Around it this module keeps the loop:
it sleeps until the earliest due time or lease expiry (woken early when an
earlier entry is parked), backs off while the store or broker fails, writes
the heartbeat (:mod:`celery_zdelay.store.heartbeats`), renews shard leases
and serves the periodic schedules in a thread of their own.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .. import __version__, signals
from .._format import shard_ranges as _shard_ranges
from ..config import get_config
from ..errors import StoreRefusedError, StoreUnavailableError, ZDelayError
from ..periodic.server import TEND_EVERY_SECONDS, PeriodicServer
from ..store import Store
from ..store.client import sanitize_url
from ..store.health import log_store_warnings
from ..store.heartbeats import CompanionInfo, forget_heartbeat, write_heartbeat
from ..store.history import sweep_history
from . import audit
from .gate import REFRESH_SECONDS, Gate
from .ownership import ShardOwnership
from .publish import Publisher, make_publisher
from .release import PassReport, ReleasePass
from .wakeup import Wakeup

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["Companion", "PassReport"]

logger = logging.getLogger(__name__)

#: Longest sleep with nothing due; a safety net under the wake-up channel.
MAX_IDLE_SECONDS = 1.0
#: Longest uninterrupted sleep, so a stop request is seen promptly.
SLEEP_SLICE_SECONDS = 0.1
#: Seconds between heartbeats in the companions hash.
HEARTBEAT_SECONDS = 5.0
#: Longest a starting companion waits for its first periodic pass before
#: releasing (a pass that fails ends the wait at once).
FIRST_PERIODIC_PASS_SECONDS = 30.0
#: Seconds between sweeps of expired task histories (store/history.py).
HISTORY_SWEEP_SECONDS = 1.0
#: Records one sweep call looks at, and calls per shard per sweep: a call
#: never blocks Redis for long, and a sweep looks at 10,000 records a second
#: per shard (a scan of a million records takes 100 s).
HISTORY_SWEEP_COUNT = 1000
HISTORY_SWEEP_CALLS = 10
#: Pauses after consecutive failures (store or broker unreachable), growing to the last.
BACKOFF_SECONDS = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


def backoff_seconds(failures: int) -> float:
    """The pause after *failures* consecutive failed attempts (0 for the first)."""
    return BACKOFF_SECONDS[min(failures, len(BACKOFF_SECONDS) - 1)]


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
        #: Whether :meth:`close` closes the store's connections: only those
        #: of a store this companion made (a caller's store is the caller's).
        self._owns_store = store is None
        self.shards = list(shards) if shards is not None else list(self.store.shards)
        self.batch_size = self.config.batch_size
        self.lease_ms = self.config.lease_ms
        self.publisher: Publisher = make_publisher(app, lease_ms=self.config.lease_ms)
        self.id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        #: The wake-up listener while :meth:`run` runs (its problem goes in the heartbeat).
        self._wakeup: Wakeup | None = None
        self._stopping = threading.Event()
        #: When this companion was made, on the monotonic clock; heartbeats
        #: turn it into Redis time (the one clock ``status`` compares with).
        self._started = time.monotonic()
        self._last_heartbeat = 0.0
        self._last_history_sweep = 0.0
        #: Where the sweep's scan of each shard's history is (0: a new scan).
        self._history_cursors: dict[int, int] = {}
        self._live_companions = 1
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
        #: The release pass, run by :meth:`release_due`.
        self.releaser = ReleasePass(
            app,
            config=self.config,
            store=self.store,
            publisher=self.publisher,
            gate=self.gate,
            periodic=self.periodic,
            companion_id=self.id,
            stopping=self._stopping,
            send=self._send,
        )
        if self.config.audit_log:
            audit.connect(self)

    @property
    def handoff_state(self) -> str:
        """Whether releases hand entries straight to a Redis broker, and why not."""
        return self.releaser.handoff_state

    # -- running ----------------------------------------------------------------

    def run(self) -> None:
        """Release entries as they fall due until :meth:`stop` is called."""
        periodic = self._start_periodic()
        self.releaser.detect_handoff()
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
                self._sweep_history()
                report = self._pass()
                self._note_periodic_runs(report)
                if report.failed:
                    pause = backoff_seconds(failures)
                    failures += 1
                    self._sleep(wakeup, pause, wake_early=False)
                    continue
                if failures:
                    logger.info(
                        "Store and broker answer again: releasing (%d passes failed).", failures
                    )
                failures = 0
                wait = MAX_IDLE_SECONDS
                if report.next_event_at is not None:
                    wait = min(wait, max(0.0, report.next_event_at - time.perf_counter()))
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
            if self.periodic is not None:
                self.periodic.stop()
            wakeup.close()
            if self._ownership is not None:
                self._ownership.release_all()
            self._forget_heartbeat()
            # Last: the shards and the heartbeat above are given up in Redis.
            self.close()
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
        """Close the broker connection, and the store's if this companion made the store.

        ``run`` does this when it returns.
        """
        self.publisher.close()
        audit.disconnect(self)
        if self._owns_store:
            self.store.close()

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
        """Release every entry due now on this companion's shards (see :mod:`.release`).

        *advance_ms* also releases entries due that many ms from now; it is
        for tests that fast-forward time (:mod:`celery_zdelay.testing`).
        """
        report = PassReport()
        try:
            shards = self._ownership.shards() if self._ownership else self.shards
            self.releaser.release(shards, report, advance_ms)
        except (StoreUnavailableError, StoreRefusedError) as exc:
            if not exc.transient:
                raise
            report.failed = self._store_waits(exc)
        self._add_to_totals(report)
        return report

    @staticmethod
    def _store_waits(exc: ZDelayError) -> bool:
        """Say why releases wait for the store (its error says what fixes it); True.

        The entries stay where the refused call found them (every script
        checks before its first write), so waiting loses nothing.
        """
        if isinstance(exc, StoreUnavailableError):
            logger.warning("Store unreachable, retrying with backoff: %s", exc)
        else:
            logger.error("Releases paused: %s Retrying with backoff.", exc)
        return True

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
                    self.periodic.begin()
                self.periodic.tend()
                failures, wait = 0, TEND_EVERY_SECONDS
            except Exception as exc:
                if isinstance(exc, ZDelayError) and exc.transient:
                    logger.warning("Store unreachable or refusing, periodic tasks wait: %s", exc)
                else:
                    logger.exception("Serving periodic tasks failed; retrying with backoff")
                wait = backoff_seconds(failures)
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
        except (StoreUnavailableError, StoreRefusedError) as exc:
            if not exc.transient:
                raise
            return PassReport(failed=self._store_waits(exc))
        return None

    def _add_to_totals(self, report: PassReport) -> None:
        self.totals.handed_off += report.handed_off
        self.totals.published += report.published
        self.totals.dead_lettered += report.dead_lettered
        self.totals.returned += report.returned
        for outcome, count in report.stale.items():
            self.totals.stale[outcome] = self.totals.stale.get(outcome, 0) + count

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
        try:
            # The Redis clock, not this host's (see heartbeats.py).
            now_ms = self.store.time_ms()
            info = CompanionInfo(
                id=self.id,
                host=socket.gethostname(),
                pid=os.getpid(),
                version=__version__,
                shards=self._ownership.shards() if self._ownership else self.shards,
                handoff=self.handoff_state,
                started_ms=now_ms - round((now - self._started) * 1000),
                seen_ms=now_ms,
                released=self.totals.released,
                dead_lettered=self.totals.dead_lettered,
                alive=True,
                wakeup=(self._wakeup.problem if self._wakeup else None) or "",
                beat=self.periodic is not None,
            )
            self._live_companions = write_heartbeat(self.store, info)
        except Exception as exc:
            logger.debug("Heartbeat failed: %r", exc)

    def _sweep_history(self) -> None:
        """Delete expired task histories of this companion's shards, in bounded steps.

        Reads ignore an expired record already: this only frees its memory,
        so a failure is logged and tried again on the next sweep.
        """
        now = time.monotonic()
        if now - self._last_history_sweep < HISTORY_SWEEP_SECONDS:
            return
        self._last_history_sweep = now
        shards = self._ownership.shards() if self._ownership else self.shards
        try:
            for shard in shards:
                cursor = self._history_cursors.get(shard, 0)
                for _ in range(HISTORY_SWEEP_CALLS):
                    cursor, _ = sweep_history(self.store, shard, cursor, HISTORY_SWEEP_COUNT)
                    if cursor == 0:
                        break
                self._history_cursors[shard] = cursor
        except Exception as exc:
            logger.debug("History sweep failed: %r", exc)

    def _forget_heartbeat(self) -> None:
        try:
            forget_heartbeat(self.store, self.id)
        except Exception:
            logger.debug("Could not remove the heartbeat of %s", self.id, exc_info=True)
