"""Bulk parking: many calls of one task, with different arguments, at once.

``task.apply_delayed_many(calls, countdown=...)`` parks what as many
``task.apply_delayed(args, countdown=...)`` calls would park, in one Redis
round trip, faster: Celery's ``apply_async`` costs tens of microseconds a
call before anything is sent, and much of that work (execution options,
routing, parent and root ids, expiry) gives the same answer for every call
of one task with one set of options.

So the first call runs through ``task.apply_async`` in full, with a
capturing producer (:mod:`celery_zdelay.capture`), and the arguments Celery
then hands to its two publishing seams, ``app.amqp.create_task_message``
(the message builder) and ``app.amqp.send_task_message`` (routing to an
exchange, the ``before_task_publish``/``after_task_publish`` signals,
serialization and compression through kombu's ``Producer.publish``), are
recorded. Every other call makes those two calls with the recorded
arguments, its own task id and its own arguments: the message is Celery's
own, built per call, and the signals run per call, as ``apply_async`` runs
them.

Whatever could make calls differ beyond their arguments takes the slow road,
one ``apply_async`` per call (same messages, lower rate): a task class that
overrides ``apply_async`` or ``shadow_name``, pydantic arguments, a router
other than ``task_routes`` patterns (a router function may route by argument
value), or a first call that did not publish exactly one message.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from celery import Task as CeleryTask
from celery.app.routes import MapRoute
from kombu.utils.uuid import uuid

from .capture import capture
from .entry import TaskMessage
from .errors import ConfigurationError

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["build_messages", "split_call"]


def split_call(call: Any) -> tuple[Any, Any]:
    """Return the (args, kwargs) of one item of ``apply_delayed_many``.

    An item is the positional arguments of one call (a tuple or list) or its
    keyword arguments (a mapping).
    """
    if isinstance(call, Mapping):
        return (), call
    if isinstance(call, (tuple, list)):
        return call, None
    raise ConfigurationError(
        f"apply_delayed_many takes one item per call: a tuple of positional arguments "
        f"or a dict of keyword arguments, got {type(call).__name__} {call!r}."
    )


def build_messages(
    task: CeleryTask, calls: Iterable[Any], options: dict[str, Any]
) -> tuple[list[Any], list[TaskMessage]]:
    """Return the results and captured messages of one ``apply_async`` per call.

    *options* are ``apply_async`` options shared by every call (no
    ``task_id``: each call gets its own).
    """
    if "task_id" in options:
        raise ConfigurationError(
            "apply_delayed_many gives each call its own task id: remove task_id=, "
            "or park that call with apply_delayed."
        )
    items = [split_call(call) for call in calls]
    if not items:
        return [], []
    app = task._get_app()
    if not _uniform(task, app):
        return _one_by_one(task, app, items, options)

    probe = _Probe()
    _record_publishing_calls(app)
    token = _probing.set(probe)
    try:
        first, messages = capture(
            app,
            lambda producer: task.apply_async(
                items[0][0], items[0][1], producer=producer, **options
            ),
        )
    finally:
        _probing.reset(token)
    if len(probe.creates) != 1 or len(probe.sends) != 1 or len(messages) != 1:
        # Not one plain message (a task publishing more, or a sender that
        # parks elsewhere): keep Celery's own path for every call.
        results, rest = _one_by_one(task, app, items[1:], options)
        return [first, *results], [*messages, *rest]
    create_args, create_kwargs = probe.creates[0]
    _, send_args, send_kwargs = probe.sends[0]
    # Retrying is about a broker connection, which a capture never uses;
    # kombu's retry wrapper costs more than the rest of its publish.
    send_kwargs["retry"] = False
    ignore_result = bool(create_kwargs.get("ignore_result"))
    results = [first]

    def publish_rest(producer: Any) -> None:
        # Celery's send_task after the routing, per call: build, notify the
        # result backend, hand to the task sender (signals, kombu publish).
        # Celery's own builder and sender, past the recording wrappers.
        create, send = app.amqp._zdelay_publishing_calls
        backend = app.backend
        parent = app.current_worker_task
        check = getattr(task, "__header__", None) if task.typing else None
        for args, kwargs in items[1:]:
            if check is not None:
                check(*(args or ()), **(kwargs or {}))
            task_id = uuid()
            message = create(task_id, task.name, args, kwargs, *create_args, **create_kwargs)
            if not ignore_result:
                backend.on_task_call(producer, task_id)
            send(producer, *send_args, message, **send_kwargs)
            result = task.AsyncResult(task_id)
            result.ignored = ignore_result
            if parent is not None and options.get("add_to_parent", True):
                parent.add_trail(result)
            results.append(result)

    _, rest = capture(app, publish_rest)
    return results, [*messages, *rest]


def _uniform(task: CeleryTask, app: Celery) -> bool:
    """Whether every call of *task* builds its message the same way but for its arguments."""
    cls = type(task)
    if (
        cls.apply_async is not CeleryTask.apply_async
        or cls.shadow_name is not CeleryTask.shadow_name
    ):
        return False
    if getattr(task, "pydantic", False):
        return False
    return all(isinstance(router, MapRoute) for router in app.amqp.routes)


def _one_by_one(
    task: CeleryTask, app: Celery, items: list[tuple[Any, Any]], options: dict[str, Any]
) -> tuple[list[Any], list[TaskMessage]]:
    def send_all(producer: Any) -> list[Any]:
        return [task.apply_async(a, k, producer=producer, **options) for a, k in items]

    return capture(app, send_all)


# -- recording the first call ------------------------------------------------------


@dataclass
class _Probe:
    #: (positional after task_id/name/args/kwargs, keyword) of each message built.
    creates: list[tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)
    #: (producer, positional before the message, keyword) of each message sent.
    sends: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)


_probing: contextvars.ContextVar[_Probe | None] = contextvars.ContextVar(
    "celery_zdelay_bulk_probe", default=None
)


_installing = threading.Lock()


def _record_publishing_calls(app: Celery) -> None:
    """Wrap *app*'s two publishing seams to record their arguments while probing.

    Outside a probe (other threads, other calls) they are Celery's, unchanged.
    """
    amqp = app.amqp
    if getattr(amqp, "_zdelay_publishing_calls", None) is not None:
        return
    with _installing:
        if getattr(amqp, "_zdelay_publishing_calls", None) is None:
            _wrap_publishing_calls(amqp)


def _wrap_publishing_calls(amqp: Any) -> None:
    create = amqp.create_task_message
    send = amqp.send_task_message

    def create_task_message(
        task_id: str, name: str, args: Any = None, kwargs: Any = None, *rest: Any, **kw: Any
    ) -> Any:
        probe = _probing.get()
        if probe is not None:
            probe.creates.append((rest, dict(kw)))
        return create(task_id, name, args, kwargs, *rest, **kw)

    def send_task_message(producer: Any, name: str, message: Any, **kw: Any) -> Any:
        probe = _probing.get()
        if probe is not None:
            probe.sends.append((producer, (name,), dict(kw)))
        return send(producer, name, message, **kw)

    # kombu's cached_property keeps an assigned value in the instance: these
    # wrap the sender and builder Celery (or TransparentAMQP) made for this app.
    amqp.create_task_message = create_task_message
    amqp.send_task_message = send_task_message
    amqp._zdelay_publishing_calls = (create, send)
