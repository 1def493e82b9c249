"""The producer side: park task messages, cancel and reschedule them.

A delayed call captures the messages Celery would publish (see
:mod:`celery_zdelay.capture`), turns each into an entry (see
:mod:`celery_zdelay.entry`) and parks the entries in the store, atomically.
"""

from __future__ import annotations

import contextvars
import copy
import logging
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from celery.canvas import Signature, _chain, chord, group, maybe_signature

from . import signals
from .app_state import PARK_WHEN_EAGER, RELEASED_BY_TEST, Producing, producing, store_for
from .bulk import build_messages, split_call
from .capture import announce_parked, capture
from .config import get_config
from .entry import TaskMessage, with_max_late
from .errors import ConfigurationError, ZDelayError
from .keys import (
    check_max_wait,
    check_task_id,
    mark_from_headers,
    set_headers,
    task_id_for,
)
from .limit_keys import take_limit_key
from .names import validate_limit_key, validate_task_id
from .redis_layout import RedisLayout
from .schedule import Due, due_from, jitter_ms
from .stale import PERIODIC_ID_PREFIX, max_late_ms
from .steering import announce_cancelled
from .store import Parked, ParkRequest, admin
from .store.client import store_errors
from .store.headers import (
    ETA_HEADER,
    KEY_HEADER,
    LIMIT_KEY_HEADER,
    MAX_WAIT_HEADER,
    ON_KEY_HEADER,
    PARK_HEADER,
    TAGS_HEADER,
)
from .store.redis_keys import canvas_key
from .tracing import park_span

if TYPE_CHECKING:
    from celery import Celery
    from celery.app.task import Task

__all__ = [
    "apply_delayed",
    "batch",
    "carry_eta",
    "park_many",
    "park_messages",
    "park_requests",
    "park_task",
    "remember_canvas",
    "send_delayed",
    "store_for",
]

logger = logging.getLogger(__name__)

#: apply_async options that choose a broker connection; parking has none.
_CONNECTION_OPTIONS = ("producer", "connection", "publisher")


def park_task(
    task: Task,
    args: Any,
    kwargs: Any,
    countdown: Any,
    eta: Any,
    options: dict[str, Any],
) -> Any:
    """Park one call of *task*; the body of ``Task.apply_delayed``."""
    app = task._get_app()
    _check_given_id(options)
    spread_ms = _take_jitter(options)
    take_limit_key(app, options)
    late_ms = _take_max_late(options)
    key = _take_marks(app, options)
    eager = _eager(app)
    if eager and _runs_now(app, eager):
        return task.apply_async(args, kwargs, countdown=countdown, eta=eta, **options)
    _reject_connection_options(options)
    due = due_from(countdown, eta)
    with _not_eager(app, eager):
        result, messages = capture(
            app, lambda producer: task.apply_async(args, kwargs, producer=producer, **options)
        )
    parked = park_messages(app, messages, due, spread_ms=spread_ms, max_late_ms=late_ms)
    if key is not None and parked and parked[0] != result.id:
        # The key was taken: the caller gets the entry that owns it.
        return task.AsyncResult(parked[0])
    return result


def _take_jitter(options: dict[str, Any]) -> int:
    """Pop ``jitter=`` (seconds) from *options*: how far, in ms, each call's due time may move.

    Checked before anything else happens, under ``task_always_eager`` too.
    """
    return jitter_ms(options.pop("jitter", None))


def _take_max_late(options: dict[str, Any]) -> int | None:
    """Pop ``max_late=`` (seconds) from *options*: how late, in ms, a release may be.

    Checked before anything else happens, under ``task_always_eager`` too
    (see :mod:`celery_zdelay.stale`).
    """
    return max_late_ms(options.pop("max_late", None))


def _check_given_id(options: Any) -> None:
    """Check a caller's own ``task_id=`` before Celery builds the message.

    :func:`park_requests` checks every id, these included; a lone surrogate
    would fail in kombu first, with a ``UnicodeEncodeError``.
    """
    if options.get("task_id") is not None:
        validate_task_id(options["task_id"])


def _members(sig: Signature) -> Iterator[Signature]:
    """Yield *sig* and every signature of its canvas (group, chain, chord header and body)."""
    yield sig
    children: list[Any] = []
    if isinstance(sig, chord):
        children = [*sig.tasks, sig.body]
    elif isinstance(sig, (group, _chain)):
        children = list(sig.tasks)
    for child in children:
        member = maybe_signature(child)
        if isinstance(member, Signature):
            yield from _members(member)


def _take_marks(app: Celery, options: dict[str, Any]) -> str | None:
    """Move ``key=``, ``on_key=``, ``tags=`` and ``max_wait=`` of *options* into its
    headers; return the key.

    A keyed task's id is drawn on its key's shard (see :mod:`celery_zdelay.keys`).
    """
    key, on_key, tags, max_wait = (
        options.pop("key", None),
        options.pop("on_key", None),
        options.pop("tags", None),
        options.pop("max_wait", None),
    )
    if key is None and on_key is None and tags is None and max_wait is None:
        return None
    set_headers(options, key, on_key, tags, max_wait)
    if key is None:
        return None
    if _current_batch.get() is not None:
        raise ConfigurationError(
            "key= cannot be used inside celery_zdelay.batch(): what a keyed call returns "
            "depends on what is parked under its key when it is parked. Park keyed calls "
            "outside the batch (tags= work inside it). Nothing was parked."
        )
    shards = get_config(app).shards
    if options.get("task_id") is not None:
        check_task_id(str(options["task_id"]), key, shards)
    elif shards > 1:
        options["task_id"] = task_id_for(key, shards)
    return str(key)


def park_many(
    task: Task,
    calls: Any,
    countdown: Any,
    eta: Any,
    options: dict[str, Any],
) -> list[Any]:
    """Park many calls of *task*, all due at once; the body of ``Task.apply_delayed_many``."""
    app = task._get_app()
    if "key" in options or (
        ("on_key" in options or "max_wait" in options) and "keys" not in options
    ):
        raise ConfigurationError(
            "apply_delayed_many parks many calls, and a key names one parked task: pass "
            "keys=[...] (one key per call, None for none) with on_key= (and max_wait= for "
            'on_key="debounce"), or park keyed calls with apply_delayed. Nothing was parked.'
        )
    spread_ms = _take_jitter(options)
    take_limit_key(app, options)
    late_ms = _take_max_late(options)
    keys = options.pop("keys", None)
    if keys is not None:
        return _park_many_keyed(
            task, list(calls), keys, countdown, eta, spread_ms, options, late_ms=late_ms
        )
    if options.get("tags") is not None:
        set_headers(options, None, None, options.pop("tags"))
    options.pop("tags", None)
    if _runs_now(app):
        return [
            task.apply_async(args, kwargs, countdown=countdown, eta=eta, **options)
            for args, kwargs in map(split_call, calls)
        ]
    _reject_connection_options(options)
    due = due_from(countdown, eta)
    with _not_eager(app):
        results, messages = build_messages(task, calls, options)
    park_messages(app, messages, due, spread_ms=spread_ms, max_late_ms=late_ms)
    return results


def _park_many_keyed(
    task: Task,
    calls: list[Any],
    keys: Any,
    countdown: Any,
    eta: Any,
    spread_ms: int,
    options: dict[str, Any],
    *,
    late_ms: int | None = None,
) -> list[Any]:
    """``apply_delayed_many(keys=[...])``: each call with its own key; one step per shard."""
    if isinstance(keys, (str, bytes)) or len(list(keys)) != len(calls):
        raise ConfigurationError(
            f"keys= must be a list with one key (or None) per call: {len(calls)} calls. "
            "Nothing was parked."
        )
    app = task._get_app()
    # One on_key and max_wait for every call: refused as a whole when they disagree,
    # even if every key is None.
    check_max_wait(keys, options.get("on_key"), options.get("max_wait"))
    per_call = []
    for key in keys:
        call_options = dict(options)
        call_options["key"] = key
        if key is None:
            # A call without a key: its on_key and max_wait have nothing to apply to.
            call_options.pop("on_key", None)
            call_options.pop("max_wait", None)
        per_call.append((call_options, _take_marks(app, call_options)))
    items = [split_call(call) for call in calls]
    if _runs_now(app):
        return [
            task.apply_async(args, kwargs, countdown=countdown, eta=eta, **call_options)
            for (args, kwargs), (call_options, _) in zip(items, per_call, strict=True)
        ]
    _reject_connection_options(options)
    due = due_from(countdown, eta)

    def send_all(producer: Any) -> list[Any]:
        return [
            task.apply_async(args, kwargs, producer=producer, **call_options)
            for (args, kwargs), (call_options, _) in zip(items, per_call, strict=True)
        ]

    with _not_eager(app):
        results, messages = capture(app, send_all)
    parked = park_messages(app, messages, due, spread_ms=spread_ms, max_late_ms=late_ms)
    return [
        task.AsyncResult(parked_id) if parked_id != result.id else result
        for result, parked_id in zip(results, parked, strict=True)
    ]


def apply_delayed(
    sig: Any,
    *,
    countdown: Any = None,
    eta: Any = None,
    app: Celery | None = None,
    **options: Any,
) -> Any:
    """Park any signature or canvas (chain, group, chord) until it is due.

    The delay comes from *countdown*/*eta*, else from the signature's own
    options. Returns what ``sig.apply_async()`` returns (``AsyncResult``,
    ``GroupResult``...), with ids known at once. ``jitter=`` (seconds) moves
    the whole canvas by one random amount within it, never earlier.
    """
    signature = maybe_signature(sig, app=app)
    if not isinstance(signature, Signature):
        raise ConfigurationError(f"apply_delayed needs a signature or canvas, got {sig!r}.")
    if any(name in options for name in ("key", "on_key", "tags", "max_wait", "limit_key")):
        raise ConfigurationError(
            "key=, on_key=, max_wait=, tags= and limit_key= go on a task's own call: "
            "task.apply_delayed(..., key=...), task.apply_delayed_many or "
            "celery_zdelay.send_delayed, not on a signature or "
            "canvas, which may park several messages. Nothing was parked."
        )
    _check_given_id(options)
    for member in _members(signature):
        _check_given_id(member.options)
    spread_ms = _take_jitter(options)
    late_ms = _take_max_late(options)
    app = app or signature._app or signature.app
    if countdown is None and eta is None:
        countdown = signature.options.get("countdown")
        eta = signature.options.get("eta")
    if _runs_now(app):
        return signature.apply_async(countdown=countdown, eta=eta, **options)
    _reject_connection_options(options)
    # One move for the whole canvas: its members stay due together.
    due = due_from(countdown, eta).jittered(spread_ms)
    signature = _without_schedule(signature)
    with _not_eager(app):
        result, messages = capture(
            app, lambda producer: signature.apply_async(producer=producer, **options)
        )
    park_messages(app, messages, due, max_late_ms=late_ms)
    _remember_canvas(app, result, messages, due)
    return result


def send_delayed(
    app: Celery,
    name: str,
    args: Any = None,
    kwargs: Any = None,
    *,
    countdown: Any = None,
    eta: Any = None,
    **options: Any,
) -> Any:
    """Park a task by name, as ``app.send_task`` would send it (``key=``, ``on_key=``,
    ``max_wait=``, ``tags=``, ``jitter=`` and ``limit_key=`` too, as
    :meth:`~celery_zdelay.Task.apply_delayed`)."""
    _check_given_id(options)
    spread_ms = _take_jitter(options)
    take_limit_key(app, options)
    late_ms = _take_max_late(options)
    key = _take_marks(app, options)
    _reject_connection_options(options)
    due = due_from(countdown, eta)
    with _not_eager(app):
        result, messages = capture(
            app, lambda producer: app.send_task(name, args, kwargs, producer=producer, **options)
        )
    parked = park_messages(app, messages, due, spread_ms=spread_ms, max_late_ms=late_ms)
    if key is not None and parked and parked[0] != result.id:
        return app.AsyncResult(parked[0])
    return result


@contextmanager
def batch(app: Celery) -> Iterator[None]:
    """Park every delayed call made inside the block in one round trip.

    Nothing is parked if the block raises (and ``after_task_publish`` is
    sent for none of its calls); when it exits normally all its entries are
    parked atomically (per shard on a Redis Cluster), then the signal is
    sent once per call::

        with celery_zdelay.batch(app):
            for order in orders:
                cancel_unpaid.apply_delayed((order.id,), countdown=1800)
    """
    pending = _Batch(app)
    token = _current_batch.set(pending)
    try:
        yield
    finally:
        _current_batch.reset(token)
    if pending.requests:
        with park_span([request.task_id for request in pending.requests]):
            parked = store_for(app).park(pending.requests)
        _announce(app, [request.message for request in pending.requests], parked)


# -- parking ----------------------------------------------------------------


@dataclass
class _Batch:
    app: Celery
    requests: list[ParkRequest] = field(default_factory=list)


_current_batch: contextvars.ContextVar[_Batch | None] = contextvars.ContextVar(
    "celery_zdelay_batch", default=None
)


def park_messages(
    app: Celery,
    messages: list[TaskMessage],
    due: Due,
    *,
    spread_ms: int = 0,
    max_late_ms: int | None = None,
) -> list[str]:
    """Park captured *messages* of *app*, all due at *due*, atomically.

    With *spread_ms* (``jitter=``), each message is due at its own random
    moment in ``[due, due + spread_ms]``: never before *due*. With
    *max_late_ms* (``max_late=``), each entry carries it for the release
    (see :mod:`celery_zdelay.stale`).

    Returns, per message, the id of the entry parked for it: its own, or for
    a message with a key already taken (``on_key``), the owner's.
    Inside :func:`batch` the entries are queued and parked when it ends.
    """
    parking = producing(app)
    dues = [due.jittered(spread_ms) for _ in messages]
    # The worker gives the task this ETA back in request.eta (periodic ticks,
    # parked through park_requests, have none: Celery beat sends none).
    carry_eta(app, messages, dues)
    requests = _requests(app, parking, messages, dues, max_late_ms=max_late_ms)
    pending = _current_batch.get()
    if pending is not None and pending.app is app:
        if any(r.mark is not None and r.mark.key is not None for r in requests):
            raise ConfigurationError(
                "A task with a key cannot be parked inside celery_zdelay.batch(): park it "
                "outside the batch. Nothing was parked."
            )
        pending.requests.extend(requests)
        return [message.task_id for message in messages]
    ids = [message.task_id for message in messages]
    if requests:
        with park_span([message.task_id for message in messages]):
            parked = parking.store.park(requests)
        ids = [p.task_id for p in parked]
        if logger.isEnabledFor(logging.DEBUG):  # the loop itself costs a few µs per park
            for message, parked_id in zip(messages, ids, strict=True):
                logger.debug(
                    "Parked %s[%s]%s",
                    message.task_name,
                    message.task_id,
                    "" if parked_id == message.task_id else f": its key is owned by {parked_id}",
                )
        _announce(app, messages, parked)
        if not parking.companion_checked:
            _warn_without_companion(app, parking)
            _warn_without_wakeup(parking)
    return ids


def carry_eta(app: Celery, messages: Sequence[TaskMessage], dues: Sequence[Due]) -> None:
    """Put the ETA Celery would have sent for each due time of *dues* into its message's
    :data:`ETA_HEADER`.

    A released message has no ``eta`` header: with one, Celery's worker
    would hold it in its timer and raise its prefetch count for it (see
    docs/transparent.rst, "The ETA a released task sees"); the worker puts
    this one back into ``request.eta`` (:func:`celery_zdelay.worker.restore_eta`).
    A message that has one already (transparent mode keeps the very string
    Celery wrote) keeps it. A countdown is counted from this host's clock
    and written in the app's time zone, as Celery writes an ``eta``; the
    release itself goes by the Redis clock.
    """
    now_ms = time.time() * 1000
    for message, due in zip(messages, dues, strict=True):
        eta_ms = due.ms if due.mode == "a" else now_ms + due.ms
        eta = datetime.fromtimestamp(eta_ms / 1000, tz=app.timezone).isoformat()
        message.headers.setdefault(ETA_HEADER, eta)


def _announce(
    app: Celery, messages: Sequence[TaskMessage | None], parked: Sequence[Parked]
) -> None:
    """Tell receivers about the messages this call parked, and only those.

    Only now, after the park: ``after_task_publish`` receivers and
    :data:`~celery_zdelay.signals.tasks_parked` (Celery's ``task-sent``
    event) learn of parked tasks only; a kept key parked nothing. A parked
    task that a ``replace`` or ``debounce`` took out is announced cancelled
    first (``REVOKED``, ``task-revoked``), as any cancel is.
    """
    replaced = [p.replaced for p in parked if p.replaced is not None]
    if replaced:
        # Their callers hold their AsyncResults: they end REVOKED, as a cancel does.
        announce_cancelled(app, replaced, None, why=" (replaced under its key)")
    done = [
        (message, p.due_ms)
        for message, p in zip(messages, parked, strict=True)
        if p.parked and message is not None and p.due_ms is not None
    ]
    announce_parked(message for message, _ in done)
    if done:
        signals.tasks_parked.send(
            sender=app, messages=[m for m, _ in done], due_ms=[ms for _, ms in done]
        )


def park_requests(
    app: Celery, messages: list[TaskMessage], dues: Sequence[Due]
) -> list[ParkRequest]:
    """Return the store requests that park captured *messages* of *app*, each at its due time.

    Every park path (a task's call, ``send_delayed``, a canvas, a batch,
    transparent mode, periodic ticks) comes through here: each id is checked
    by the rule of :mod:`celery_zdelay.names` before anything is written, as
    the key and tags are (:func:`~celery_zdelay.keys.mark_from_headers`) and
    the limit key (its ``zdelay_limit_key`` header).

    Raises:
        ConfigurationError: an id, key, tag or limit key breaks that rule; nothing of
            *messages* is parked.
    """
    return _requests(app, producing(app), messages, dues)


def _requests(
    app: Celery,
    parking: Producing,
    messages: list[TaskMessage],
    dues: Sequence[Due],
    *,
    max_late_ms: int | None = None,
) -> list[ParkRequest]:
    """:func:`park_requests` with the app's :class:`Producing` already looked up.

    *max_late_ms* goes into each entry's metadata line (see :mod:`.stale`).
    """
    encoder = parking.encoder
    if max_late_ms is not None and parking.config.whole_messages:
        raise ConfigurationError(
            "max_late= cannot be stored with zdelay_whole_messages: a message parked whole "
            "has no metadata line to hold it. Set zdelay_max_late on the companions instead "
            "(it applies to every entry), or turn zdelay_whole_messages off. Nothing was parked."
        )
    requests = []
    for message, due in zip(messages, dues, strict=True):
        validate_task_id(message.task_id)
        if LIMIT_KEY_HEADER in message.headers:
            # Set by limit_key= (checked there) or by hand (transparent mode).
            validate_limit_key(message.headers[LIMIT_KEY_HEADER])
        if max_late_ms is not None and message.task_id.startswith(PERIODIC_ID_PREFIX):
            raise ConfigurationError(
                f"max_late= cannot apply to task id {message.task_id!r}: ids starting with "
                f"{PERIODIC_ID_PREFIX!r} are periodic occurrences, which are never stale "
                "(zdelay_missed decides). Choose another task_id. Nothing was parked."
            )
        if parking.config.worker_dedupe:
            # The worker-side guard tells a second publish of this park from
            # a redelivery by it (celery_zdelay.worker.refuse_second_delivery).
            message.headers[PARK_HEADER] = uuid.uuid4().hex
        if message.headers.get("eta") is not None:
            # A canvas member carried its own countdown; the delayed call's
            # due time wins, as the outer countdown does in Celery.
            message.headers["eta"] = None
        dest = _handoff_dest(app, parking.layout, message)
        payload, template = encoder.encode(
            message,
            dest=dest,
            layout=parking.layout.fingerprint if parking.layout and dest else None,
        )
        if max_late_ms is not None:
            payload = with_max_late(payload, max_late_ms)
        mark = (
            mark_from_headers(message.headers, max_run_ms=parking.config.max_run_ms)
            if KEY_HEADER in message.headers
            or TAGS_HEADER in message.headers
            or ON_KEY_HEADER in message.headers
            or MAX_WAIT_HEADER in message.headers
            else None
        )
        if mark is not None and mark.key is not None:
            check_task_id(message.task_id, mark.key, parking.config.shards)
        requests.append(
            ParkRequest(message.task_id, due, payload, dest, template, mark, message=message)
        )
    return requests


#: How long after its due time a canvas's result id still finds its parked ids.
CANVAS_GRACE_MS = 7 * 24 * 3600 * 1000


def _remember_canvas(app: Celery, result: Any, messages: list[TaskMessage], due: Due) -> None:
    """Let the ids the caller has for a canvas find the tasks parked for it.

    A chain parks its first task but returns its last one's result (its
    ``parent`` chain leads back), a group returns a result under the group
    id: ``cancel(result.id)`` must still act on what was parked.
    """
    remember_canvas(app, _result_ids(result), [message.task_id for message in messages], due)


def remember_canvas(app: Celery, result_ids: Iterable[str], parked: list[str], due: Due) -> None:
    """Record that the ids in *result_ids* stand for the entries *parked* (canvas aliases).

    Members add up (a group parked member by member in transparent mode); the
    record expires :data:`CANVAS_GRACE_MS` after the due time.
    """
    aliases = {result_id for result_id in result_ids if result_id} - set(parked)
    if not parked or not aliases:
        return
    store = store_for(app)
    ahead_ms = due.ms if due.mode == "r" else due.ms - round(time.time() * 1000)
    ttl_ms = max(ahead_ms, 0) + CANVAS_GRACE_MS
    with store_errors(store.url), store.client.pipeline(transaction=False) as pipe:
        for result_id in sorted(aliases):
            key = canvas_key(store.config.key_prefix, result_id)
            pipe.sadd(key, *parked)
            pipe.pexpire(key, ttl_ms)
        pipe.execute()


def _result_ids(result: Any) -> list[str]:
    """Return the id of *result* and of each ``parent`` before it (a chain's steps)."""
    ids: list[str] = []
    node = result
    while node is not None and len(ids) < 10_000:
        result_id = getattr(node, "id", None)
        if isinstance(result_id, str):
            ids.append(result_id)
        node = getattr(node, "parent", None)
    return ids


def _warn_without_companion(app: Celery, parking: Producing) -> None:
    """On the first park of this process, warn when no companion is alive to release it."""
    parking.companion_checked = True
    if getattr(app, RELEASED_BY_TEST, False):
        return
    try:
        warning = admin.no_companion_warning(parking.store)
    except ZDelayError as exc:  # the park itself succeeded: never fail it for this
        logger.debug("Could not look for a live companion: %r", exc)
        return
    if warning is not None:
        logger.warning("%s", warning)


def _warn_without_wakeup(parking: Producing) -> None:
    """On the first park of this process, warn when Redis refuses this user the wake-up channels.

    park.lua's wake-up is a best effort after its writes (a refusal never
    fails a park that wrote), so a refusal would otherwise go unseen: the
    tasks are released, up to a second late.
    """
    try:
        problem = admin.wake_problem(parking.store)
    except ZDelayError as exc:  # the park itself succeeded: never fail it for this
        logger.debug("Could not check the wake-up channels: %r", exc)
        return
    if problem is not None:
        logger.warning("%s", problem)


def _handoff_dest(app: Celery, layout: RedisLayout | None, message: TaskMessage) -> str | None:
    """Return the Redis list a handoff may push *message* to, if any.

    Only messages for the default (anonymous) exchange go straight to a
    list; named exchanges need kombu's binding lookup, and queues with an
    ``expires`` need kombu to refresh the expiry, so both take the generic
    path.
    """
    if layout is None or message.exchange != "":
        return None
    queue = app.amqp.queues.get(message.routing_key)
    if queue is not None and queue.expires is not None:
        return None
    return layout.list_key(message.routing_key, message.priority)


def _eager(app: Celery) -> bool:
    """Whether *app* is under ``task_always_eager`` now.

    Read once per delayed call and passed on: reading a Celery setting costs
    a few microseconds, a tenth of what a plain park's Python costs beyond
    Celery's own build.
    """
    return bool(app.conf.task_always_eager)


def _runs_now(app: Celery, eager: bool | None = None) -> bool:
    """Whether a delayed call of *app* runs at once instead of being parked.

    Under ``task_always_eager`` it runs, as ``apply_async`` does, unless
    :mod:`celery_zdelay.testing` bound the app to a test (it sets
    :data:`~celery_zdelay.app_state.PARK_WHEN_EAGER`): then it is parked as
    in production, so the test can fast-forward it. *eager* is
    :func:`_eager` when the caller read it already.
    """
    if eager is None:
        eager = _eager(app)
    return eager and not getattr(app, PARK_WHEN_EAGER, False)


@contextmanager
def _not_eager(app: Celery, eager: bool | None = None) -> Iterator[None]:
    """Let Celery build the message it would publish, even under eager.

    Production is never eager; under ``task_always_eager`` Celery would run
    the task instead of handing its message to the capturing producer (and
    ``send_task`` would warn). Only a test binding parks under eager.
    *eager* is :func:`_eager` when the caller read it already.
    """
    if not (_eager(app) if eager is None else eager):
        yield
        return
    changes = app.conf.changes
    saved = changes.get("task_always_eager")
    app.conf.task_always_eager = False
    try:
        yield
    finally:
        if saved is None:
            changes.pop("task_always_eager", None)
        else:
            changes["task_always_eager"] = saved


def _reject_connection_options(options: dict[str, Any]) -> None:
    for name in _CONNECTION_OPTIONS:
        if name in options:
            raise ConfigurationError(
                f"{name}= is not used by a delayed call: the message is parked in Redis "
                "and the companion publishes it. Remove the argument."
            )


def _without_schedule(sig: Signature) -> Signature:
    """Return *sig* without countdown/eta on the messages published now.

    Celery would otherwise put an ETA in them, and on RabbitMQ quorum queues
    reroute them through its own delayed-delivery exchanges.
    """
    if not any(_has_schedule(s) for s in _published_now(sig)):
        return sig
    sig = copy.deepcopy(sig)
    for member in _published_now(sig):
        member.options.pop("countdown", None)
        member.options.pop("eta", None)
    return sig


def _has_schedule(sig: Signature) -> bool:
    return sig.options.get("countdown") is not None or sig.options.get("eta") is not None


def _published_now(sig: Signature) -> Iterator[Signature]:
    """Yield *sig* and the canvas members it publishes when applied."""
    yield sig
    if isinstance(sig, _chain):
        if sig.tasks:
            yield from _published_now(maybe_signature(sig.tasks[0]))
    elif isinstance(sig, chord):
        header = sig.tasks
        members = header.tasks if isinstance(header, group) else header
        for member in members:
            yield from _published_now(maybe_signature(member))
    elif isinstance(sig, group):
        for member in sig.tasks:
            yield from _published_now(maybe_signature(member))
