"""Fast-forward the parked tasks of a Celery app inside a test.

:class:`FastForward` binds an app to a test store: a Redis (given by URL) and
a key prefix of the test's own, so parallel test processes never see each
other's entries. Time then passes for what is parked only when the test says
so: :meth:`FastForward.advance` moves the parked entries closer to now, step
by step in due order, and releases each step with the companion's own code
(:meth:`Companion.release_due <celery_zdelay.companion.Companion.release_due>`),
so what reaches the broker is what production would publish.

Under ``task_always_eager`` there is no worker: the app's broker is pointed at
a key prefix of the test Redis for the test, delayed calls are parked as in
production instead of running at once, and each released message is taken
from that broker and run in the test process as a worker runs it
(:class:`~celery_zdelay.testing.worker.InProcessWorker`). A task that parks
another task while it runs is fast-forwarded too, from the moment it ran.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from celery import states

from ..app_state import PARK_WHEN_EAGER, RELEASED_BY_TEST, store_for
from ..companion import Companion
from ..config import get_config
from ..errors import ConfigurationError, ZDelayError
from ..store.admin import MAX_LIST_LIMIT, list_parked
from ..store.read_model import ParkedTask as StoredTask
from ..store.reading import scan_parked
from ..store.scripts import LuaFile, Scripts, ScriptSpec, register
from .worker import InProcessWorker

if TYPE_CHECKING:
    from celery import Celery

    from ..store import Store

__all__ = ["FastForward", "ParkedTask", "ReleasedTask"]

logger = logging.getLogger(__name__)

#: Most release steps one call makes before it gives up: a task that parks
#: itself again with no delay would otherwise never let time move on.
MAX_STEPS = 10_000
#: Keys SCAN looks at per call when clearing the test prefix.
CLEAR_BATCH = 500


@dataclass(frozen=True)
class ParkedTask:
    """One parked task, as :meth:`FastForward.parked` lists it."""

    #: The task id (``AsyncResult.id``).
    id: str
    #: The task name.
    name: str
    #: When it is due on the test's clock (UTC); advancing brings it closer.
    due: datetime
    #: Seconds from now until it is due, when it was listed (negative: overdue).
    due_in: float
    #: Celery's ``argsrepr`` header: ``repr()`` of the positional arguments.
    argsrepr: str
    #: Celery's ``kwargsrepr`` header.
    kwargsrepr: str


@dataclass(frozen=True)
class ReleasedTask(ParkedTask):
    """A task :meth:`FastForward.advance` released.

    Under ``task_always_eager`` it has run by then, and :attr:`state` and
    :attr:`result` say how; otherwise it is in the broker for a worker and
    both are None.
    """

    #: ``SUCCESS``, ``FAILURE``, ``RETRY``, ``REVOKED`` (expired)...; None when not run here.
    state: str | None = None
    #: What the task returned, or the exception it raised.
    result: Any = None


#: Moves a shard's due set earlier, and its debounce bursts' first calls
#: (``shift.lua``, run bare: no store checks).
SHIFT = register(
    ScriptSpec("shift", LuaFile(__package__ or "celery_zdelay.testing", "shift.lua"), guarded=False)
)[0]


class FastForward:
    """The parked tasks of one Celery app in a test, and the clock that releases them.

    Use it as a context manager (the ``zdelay`` pytest fixture does)::

        with FastForward(app, redis_url="redis://localhost:6379/15",
                         key_prefix="zdelay-test") as zdelay:
            cancel_unpaid.apply_delayed((42,), countdown=1800)
            zdelay.advance(1800)

    While it is open, the app parks in *redis_url* under *key_prefix*; when
    it closes, every key under the prefix is deleted and the app's settings
    are restored.
    """

    def __init__(self, app: Celery, *, redis_url: str, key_prefix: str) -> None:
        self.app = app
        self.redis_url = redis_url
        self.key_prefix = key_prefix
        #: True when the app runs tasks eagerly: released tasks run in this process.
        self.eager = False
        self._overrides = _Overrides(app)
        self._worker: InProcessWorker | None = None
        self._open = False

    # -- binding ----------------------------------------------------------------

    def __enter__(self) -> FastForward:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> FastForward:
        """Point the app at the test store (and, under eager, the test broker)."""
        if self._open:
            return self
        self.eager = bool(self.app.conf.task_always_eager)
        settings: dict[str, Any] = {
            "zdelay_redis_url": self.redis_url,
            "zdelay_key_prefix": self.key_prefix,
        }
        if self.eager:
            # Celery never uses the broker under eager; released messages go
            # through one of the test's own, so they can be taken and run here.
            settings.update(
                broker_write_url=self.redis_url,
                broker_transport_options={"global_keyprefix": self._broker_prefix},
                broker_use_ssl=None,
            )
        self._overrides.apply(settings)
        try:
            get_config(self.app)
            # The test releases what it parks: no companion is expected.
            setattr(self.app, RELEASED_BY_TEST, True)
            if self.eager:
                setattr(self.app, PARK_WHEN_EAGER, True)
                self._worker = InProcessWorker(self.app)
            self._open = True
            self.clear()
        except BaseException:
            self._unbind()
            raise
        return self

    def close(self) -> None:
        """Delete what the test parked and restore the app's settings."""
        if not self._open:
            return
        try:
            if self._worker is not None:
                self._worker.close()
            self.clear()
        finally:
            self._open = False
            self._unbind()

    def _unbind(self) -> None:
        self._worker = None
        if getattr(self.app, PARK_WHEN_EAGER, False):
            delattr(self.app, PARK_WHEN_EAGER)
        if getattr(self.app, RELEASED_BY_TEST, False):
            delattr(self.app, RELEASED_BY_TEST)
        try:
            # The test's store, if it was built: a store that cannot be built
            # (bad settings, Redis unreachable) has nothing to close.
            with contextlib.suppress(ZDelayError):
                store_for(self.app).close()
        finally:
            self._overrides.restore()

    @property
    def _broker_prefix(self) -> str:
        return f"{self.key_prefix}:broker:"

    @property
    def store(self) -> Store:
        """The store the app parks in (the test's)."""
        self._check_open()
        return store_for(self.app)

    # -- inspecting -------------------------------------------------------------

    def parked(self, name: str | None = None) -> list[ParkedTask]:
        """Return what is parked, in due order; only tasks called *name* if given."""
        tasks = self._listed(self.store)
        return [t for t in tasks if name is None or t.name == name]

    # -- the clock --------------------------------------------------------------

    def advance(self, seconds: float) -> list[ReleasedTask]:
        """Let *seconds* pass for what is parked; release and return what falls due.

        Entries are released in due order, one due time after the other, each
        through the companion's release path. Under ``task_always_eager`` each
        released task runs here before the clock moves on, so a task it parks
        is counted from the moment it ran, and is released in the same call if
        it falls due within *seconds*.

        Raises:
            ZDelayError: a release failed (the broker refused it, or an entry
                was dead-lettered), or tasks kept falling due for
                :data:`MAX_STEPS` steps.
            Exception: under ``task_always_eager`` with
                ``task_eager_propagates``, what a released task raised (after
                every task released in the same step has run).
        """
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, (int, float))
            or not math.isfinite(seconds)
            or seconds < 0
        ):
            raise ConfigurationError(
                f"advance() takes a number of seconds of at least 0, got {seconds!r}."
            )
        return self._run(math.ceil(seconds * 1000))

    def release_due(self, *, now: datetime | None = None) -> list[ReleasedTask]:
        """Release every task due by *now* (default: due already); return them.

        *now* is a datetime (naive means UTC, as in Celery); the parked tasks
        are brought forward to it as by :meth:`advance`. A *now* in the past
        releases only what is due already: the clock never goes back.
        """
        left_ms = 0
        if now is not None:
            if not isinstance(now, datetime):
                raise ConfigurationError(f"release_due(now=) takes a datetime, got {now!r}.")
            when = now if now.tzinfo is not None else now.replace(tzinfo=timezone.utc)
            left_ms = max(0, math.ceil(when.timestamp() * 1000) - self.store.time_ms())
        return self._run(left_ms)

    def clear(self) -> None:
        """Delete everything parked under the test's prefix (and its test broker)."""
        client = self.store.client
        prefix = _glob_escape(self.key_prefix)
        # Every shard's keys ("{prefix:N}:due", ...), and the unsharded ones:
        # companion heartbeats, worker dedupe marks, and under eager the test
        # broker's queues and bindings. Only the test's prefix is scanned.
        for pattern in (f"{{{prefix}:*", f"{prefix}:*"):
            for key in list(client.scan_iter(match=pattern, count=CLEAR_BATCH)):
                client.delete(key)

    # -- internals --------------------------------------------------------------

    def _check_open(self) -> None:
        if not self._open:
            raise ZDelayError(
                "This FastForward is closed: use it inside its with-block (or the "
                "zdelay fixture's test)."
            )

    def _run(self, left_ms: int) -> list[ReleasedTask]:
        self._check_open()
        store = self.store
        released: list[ReleasedTask] = []
        for _ in range(MAX_STEPS):
            now_ms, next_ms = self._peek(store)
            if next_ms is not None and next_ms <= now_ms:
                released += self._release_step(store)
                continue
            if left_ms <= 0:
                return released
            step_ms = left_ms if next_ms is None else min(left_ms, next_ms - now_ms)
            self._shift(store, step_ms)
            left_ms -= step_ms
        raise ZDelayError(
            f"Tasks kept falling due for {MAX_STEPS} release steps; a task probably "
            "parks itself again with no delay. Give it a countdown, or advance less."
        )

    def _peek(self, store: Store) -> tuple[int, int | None]:
        """Return the Redis clock and the earliest due time parked, in ms."""
        now_ms = store.time_ms()
        earliest: int | None = None
        for shard in store.shards:
            head = next(scan_parked(store, shards=[shard], first_page=1, payloads=False), None)
            if head is not None:
                earliest = head.due_ms if earliest is None else min(earliest, head.due_ms)
        return now_ms, earliest

    def _shift(self, store: Store, step_ms: int) -> None:
        script = Scripts(store.client, [SHIFT])["shift"]
        for shard in store.shards:
            keys = store.keys(shard)
            script(keys=[keys.due, keys.marks], args=[step_ms])

    def _release_step(self, store: Store) -> list[ReleasedTask]:
        """Release what is due now through the companion; under eager, run it."""
        # Whatever the companion's claim can pick: due now, or within the
        # second it takes to get there.
        candidates = self._listed(store, due_within_ms=1000)
        with Companion(self.app, store=store) as companion:
            report = companion.release_due()
        if report.failed:
            raise ZDelayError(
                "The companion could not release the due tasks: the broker or the "
                "store refused them (see the celery_zdelay.companion log). They "
                "stay parked."
            )
        if report.dead_lettered:
            raise ZDelayError(
                f"{report.dead_lettered} due entries could not be published and were "
                "dead-lettered (see the celery_zdelay.companion log): their payload is "
                "damaged or was not signed with a current zdelay_signing_key."
            )
        gone = self._released_ids(store, candidates)
        released = [task for task in candidates if task.id in gone]
        if not self.eager:
            return [ReleasedTask(**_fields(task)) for task in released]
        return self._run_released(released)

    def _run_released(self, released: list[ParkedTask]) -> list[ReleasedTask]:
        assert self._worker is not None
        messages = self._worker.fetch()
        results: list[ReleasedTask] = []
        errors: list[BaseException] = []
        try:
            for task in released:
                message = messages.pop(task.id, None)
                if message is None:
                    raise ZDelayError(
                        f"{task.name}[{task.id}] was released but is not in the test "
                        "broker; was the app's broker changed during the test?"
                    )
                try:
                    outcome = self._worker.run(message)
                except Exception as exc:
                    errors.append(exc)
                    continue
                results.append(
                    ReleasedTask(**_fields(task), state=outcome.state, result=outcome.result)
                )
                if (
                    outcome.state == states.FAILURE
                    and isinstance(outcome.result, BaseException)
                    and self.app.conf.task_eager_propagates
                ):
                    errors.append(outcome.result)
        finally:
            # Messages sent to the broker by other means (send_task under
            # eager) stay where they are.
            self._worker.give_back(messages)
        if errors:
            raise errors[0]
        return results

    def _listed(self, store: Store, *, due_within_ms: int | None = None) -> list[ParkedTask]:
        """List parked entries through the store's own listing, which reads payloads."""
        due_before_ms = None
        if due_within_ms is not None:
            due_before_ms = store.time_ms() + due_within_ms + 1
        listing = list_parked(store, due_before_ms=due_before_ms, limit=MAX_LIST_LIMIT)
        if listing.more:
            raise ZDelayError(
                f"More than {MAX_LIST_LIMIT} tasks are parked (or due at once); the "
                "zdelay fixture lists them all, and is made for tests that park fewer."
            )
        return [_parked(entry, listing.now_ms) for entry in listing.entries]

    def _released_ids(self, store: Store, candidates: list[ParkedTask]) -> set[str]:
        gone: set[str] = set()
        for task in candidates:
            keys = store.keys(store.shard_of(task.id))
            if store.client.zscore(keys.due, task.id) is None:
                gone.add(task.id)
        return gone


def _parked(entry: StoredTask, now_ms: int) -> ParkedTask:
    """The testing plugin's view of the store's read model: the fields a test asserts on."""
    if entry.error is not None:
        logger.warning("Parked entry %s cannot be read: %s", entry.task_id, entry.error)
    # A listed entry is parked, held or in flight: it always has its due time.
    due_ms = now_ms if entry.due_ms is None else entry.due_ms
    return ParkedTask(
        id=entry.task_id,
        name=entry.task or "",
        due=datetime.fromtimestamp(due_ms / 1000, tz=timezone.utc),
        due_in=(due_ms - now_ms) / 1000,
        argsrepr=entry.argsrepr or "",
        kwargsrepr=entry.kwargsrepr or "",
    )


def _fields(task: ParkedTask) -> dict[str, Any]:
    return {
        "id": task.id,
        "name": task.name,
        "due": task.due,
        "due_in": task.due_in,
        "argsrepr": task.argsrepr,
        "kwargsrepr": task.kwargsrepr,
    }


def _glob_escape(text: str) -> str:
    return "".join(f"\\{ch}" if ch in "*?[]\\" else ch for ch in text)


class _Overrides:
    """Settings of an app changed for a test, and how to put them back.

    Celery stores a setting under the key it was given, or under its
    namespaced name in a Django project (``CELERY_...``): the key that
    changed is found by comparing, and only that key is restored.
    """

    def __init__(self, app: Celery) -> None:
        self.app = app
        self._saved: list[tuple[str, bool, Any]] = []

    def apply(self, settings: dict[str, Any]) -> None:
        changes = self.app.conf.changes
        before = dict(changes)
        for key, value in settings.items():
            self.app.conf[key] = value
        for key in _changed(before, changes):
            self._saved.append((key, key in before, before.get(key)))

    def restore(self) -> None:
        changes = self.app.conf.changes
        saved, self._saved = self._saved, []
        for key, existed, value in reversed(saved):
            if existed:
                changes[key] = value
            else:
                changes.pop(key, None)


def _changed(before: dict[str, Any], after: Any) -> Iterator[str]:
    keys: Iterable[str] = list(after.keys())
    for key in keys:
        if key not in before or before[key] is not after[key]:
            yield key
