"""Transparent mode: park every task message Celery publishes with a far ETA.

Every way of sending a task ends in one call: ``app.send_task`` hands the
finished message to ``app.amqp.send_task_message``. ``apply_async``,
``Task.retry``, ``app.send_task``, canvas steps and the callbacks a worker
publishes after a task ran all go through it. Transparent mode wraps that
sender of the app's ``amqp`` object (whatever its class): when
``zdelay_threshold`` is set and a message's ETA is at least that far away,
it runs Celery's own sender with a
:class:`~celery_zdelay.capture.CapturingProducer` instead of the broker's
producer and parks what it captured; everything else is published by
Celery unchanged.

Setting ``zdelay_threshold`` is all it takes, wherever ``celery_zdelay`` is
imported: importing it wraps the apps that exist already and registers a
Celery fix-up, so every app created afterwards is wrapped when it builds its
``amqp`` object. :class:`celery_zdelay.Task` and the worker bootstep wrap
their app too. A far-ETA message that still reaches the broker's producer
of an app with ``zdelay_threshold`` (an app created with its own
``fixups=`` list, before ``celery_zdelay`` was imported) is logged as an
error and its app wrapped from then on.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import celery
from celery import signals
from celery.app.amqp import AMQP
from kombu.utils.imports import symbol_by_name
from kombu.utils.objects import cached_property

from .capture import CapturingProducer, capture
from .config import get_config
from .errors import ConfigurationError
from .parking import park_messages, remember_canvas
from .schedule import due_from
from .store.headers import ETA_HEADER

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["TransparentAMQP", "hook_sender", "install", "is_transparent"]

logger = logging.getLogger(__name__)

#: Exchange Celery >= 5.5 reroutes delayed messages to on RabbitMQ quorum
#: queues (kombu's ``level_name(27)``, optionally ``<prefix>_`` before it).
_NATIVE_DELAY_EXCHANGE = "celery_delayed_27"
#: kombu's native delayed delivery routing key: 28 delay bits, then the
#: original routing key (``1.0.1.…0.celery``).
_NATIVE_DELAY_BITS = 28
_NATIVE_DELAY_PREFIX = re.compile(rf"^(?:[01]\.){{{_NATIVE_DELAY_BITS}}}")
_NO_DELAY_PREFIX = "0." * _NATIVE_DELAY_BITS

SendTaskMessage = Callable[..., Any]

#: Set while a message passes through a wrapped sender: a far-ETA message
#: published without it slipped past transparent mode.
_in_wrapped_sender: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "celery_zdelay_in_wrapped_sender", default=False
)


class TransparentAMQP(AMQP):  # type: ignore[misc]
    """Celery's ``AMQP`` whose task sender parks messages due far enough ahead.

    With ``zdelay_threshold`` unset it is Celery's ``AMQP`` unchanged.
    Importing ``celery_zdelay`` already wraps the sender of every app's own
    ``amqp`` class, so naming this class is optional::

        app = Celery("proj", amqp="celery_zdelay:TransparentAMQP")
    """

    @cached_property  # type: ignore[untyped-decorator]
    def send_task_message(self) -> SendTaskMessage:
        """Celery's task sender, wrapped to park messages due far enough ahead."""
        return _transparent_sender(self.app, super().send_task_message)


def install(app: Celery) -> bool:
    """Wrap *app*'s task sender for transparent mode; return whether it parks now.

    Safe to call any number of times, before or after the app created its
    ``amqp`` object. Returns True when ``zdelay_threshold`` is set (the
    wrapper looks at the setting on every publish, so setting it later
    turns transparent mode on without another call).
    """
    hook_sender(app)
    try:
        return get_config(app).threshold_ms is not None
    except ConfigurationError:
        # Reported where the settings are used; binding a task is no place for it.
        return False


def is_transparent(app: Celery) -> bool:
    """Return whether *app* parks far-ETA messages: its sender is wrapped and the threshold set."""
    try:
        threshold_ms = get_config(app).threshold_ms
    except ConfigurationError:
        return False
    sender = app.amqp.send_task_message
    return threshold_ms is not None and bool(getattr(sender, "_zdelay_transparent", False))


def hook_sender(app: Celery) -> None:
    """Make *app*'s sender transparent now, or when the app builds its ``amqp`` object.

    Does not read the app's configuration (Celery fix-ups call it while the
    app is being created).
    """
    if "amqp" in vars(app):
        _wrap(app, app.amqp)
    elif not isinstance(app.amqp_cls, _TransparentFactory):
        app.amqp_cls = _TransparentFactory(app.amqp_cls)


class _TransparentFactory:
    """An app's ``amqp_cls``: builds the class the app names, made transparent.

    Celery builds ``app.amqp`` with ``instantiate(app.amqp_cls, app=app)``,
    which calls whatever it is given. Deriving from the app's own class
    rather than replacing it keeps an app's own ``AMQP`` subclass working,
    and the class is only imported when the app first needs it.
    """

    def __init__(self, original: Any) -> None:
        self.original = original

    def __call__(self, app: Celery) -> AMQP:
        return _transparent_class(symbol_by_name(self.original))(app=app)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_TransparentFactory, (self.original,))


@functools.cache
def _transparent_class(cls: type[AMQP]) -> type[AMQP]:
    """Return *cls* with the task sender of :class:`TransparentAMQP`."""
    if issubclass(cls, TransparentAMQP):
        return cls
    return type(cls.__name__, (TransparentAMQP, cls), {"__module__": cls.__module__})


def _wrap(app: Celery, amqp: AMQP) -> None:
    """Make the existing *amqp* object of *app* park far-ETA messages."""
    if "send_task_message" not in vars(amqp):
        # Celery has not built the sender yet: it will be TransparentAMQP's.
        amqp.__class__ = _transparent_class(type(amqp))  # type: ignore[arg-type]
        return
    native = amqp.send_task_message
    if not getattr(native, "_zdelay_transparent", False):
        # A cached property: setting it replaces the sender Celery reads.
        amqp.send_task_message = _transparent_sender(app, native)


def _transparent_sender(app: Celery, native: SendTaskMessage) -> SendTaskMessage:
    def send_task_message(producer: Any, name: str, message: Any, **options: Any) -> Any:
        headers = message[0]
        eta = headers.get("eta") if isinstance(headers, dict) else None
        if eta is None or isinstance(producer, CapturingProducer):
            # No ETA, or already being captured by apply_delayed: Celery's path.
            return _native(native, producer, name, message, options)
        threshold_ms = get_config(app).threshold_ms
        if threshold_ms is None:
            return _native(native, producer, name, message, options)
        due = due_from(eta=eta)
        if due.ms - time.time() * 1000 < threshold_ms:
            return _native(native, producer, name, message, options)
        # The companion releases the message when it is due: the worker must
        # run it at once, not hold it for an ETA again. The task still sees
        # Celery's ETA in request.eta (celery_zdelay.worker.restore_eta).
        headers[ETA_HEADER] = eta
        headers["eta"] = None
        options = _without_native_delay(options)
        result, messages = capture(app, lambda p: native(p, name, message, **options))
        park_messages(app, messages, due)
        remember_canvas(app, _canvas_ids(headers, message), [m.task_id for m in messages], due)
        return result

    send_task_message._zdelay_transparent = True  # type: ignore[attr-defined]
    return send_task_message


def _canvas_ids(headers: dict[str, Any], message: Any) -> list[str]:
    """Return the ids a caller may have for this message's canvas: group, later chain steps.

    ``group(...).apply_async(countdown=)`` returns the group's id, a chain its
    last step's: ``cancel()`` finds the parked message by either.
    """
    ids = [headers.get("group")]
    body = message[2] if len(message) > 2 else None
    embed = body[2] if isinstance(body, tuple) and len(body) > 2 else None
    if isinstance(embed, dict):
        steps = list(embed.get("chain") or [])
        if embed.get("chord"):
            steps.append(embed["chord"])
        for step in steps:
            options = step.get("options") if isinstance(step, dict) else None
            if isinstance(options, dict):
                ids.append(options.get("task_id"))
    return [i for i in ids if isinstance(i, str)]


def _native(
    native: SendTaskMessage, producer: Any, name: str, message: Any, options: dict[str, Any]
) -> Any:
    token = _in_wrapped_sender.set(True)
    try:
        return native(producer, name, message, **options)
    finally:
        _in_wrapped_sender.reset(token)


def _without_native_delay(options: dict[str, Any]) -> dict[str, Any]:
    """Return *options* with Celery's RabbitMQ native delay set to zero.

    On quorum queues Celery >= 5.5 routes a delayed message to the
    ``celery_delayed_27`` exchange with its delay in the bits of the routing
    key, after it dropped the original exchange. The parked message keeps
    that route with every bit zero: on release it passes the delay levels
    without waiting and reaches its queue through the bindings Celery's
    workers declared.
    """
    exchange = options.get("exchange")
    name = getattr(exchange, "name", exchange)
    routing_key = options.get("routing_key")
    if (
        not isinstance(name, str)
        or not (name == _NATIVE_DELAY_EXCHANGE or name.endswith("_" + _NATIVE_DELAY_EXCHANGE))
        or not isinstance(routing_key, str)
        or not _NATIVE_DELAY_PREFIX.match(routing_key)
    ):
        return options
    return {**options, "routing_key": _NATIVE_DELAY_PREFIX.sub(_NO_DELAY_PREFIX, routing_key, 1)}


# -- making zdelay_threshold enough on its own ---------------------------------


@signals.before_task_publish.connect(weak=False)  # type: ignore[untyped-decorator]
def _report_unparked(sender: Any = None, headers: Any = None, **_: Any) -> None:
    """Log a far-ETA message that reached a broker without passing transparent mode."""
    if _in_wrapped_sender.get() or not isinstance(headers, dict) or not headers.get("eta"):
        return
    app = celery.current_app
    try:
        threshold_ms = get_config(app).threshold_ms
        due = due_from(eta=headers["eta"])
    except ConfigurationError:
        return
    if threshold_ms is None or due.ms - time.time() * 1000 < threshold_ms:
        return
    logger.error(
        "Task %s[%s] was sent to the broker with an ETA although zdelay_threshold is set: "
        "the app %r was created before celery_zdelay was imported, with its own fixups= "
        "list. Import celery_zdelay before creating the app, or name "
        'amqp="celery_zdelay:TransparentAMQP" when creating it. Later tasks are parked.',
        headers.get("task", sender),
        headers.get("id"),
        app.main,
        extra={"task_id": headers.get("id")},
    )
    install(app)
