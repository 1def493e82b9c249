"""Transparent mode: park every task message Celery publishes with a far ETA.

Every way of sending a task ends in one call: ``app.send_task`` hands the
finished message to ``app.amqp.send_task_message``. ``apply_async``,
``Task.retry``, ``app.send_task``, canvas steps and the callbacks a worker
publishes after a task ran all go through it. :class:`TransparentAMQP` is the
app's ``amqp`` class (a public seam: ``Celery(amqp=...)``) with a task sender
that looks at the ``eta`` header of each message. When ``zdelay_threshold``
is set and the ETA is at least that far away, it runs Celery's own sender
with a :class:`~celery_zdelay.capture.CapturingProducer` instead of the
broker's producer and parks what it captured; everything else is published
by Celery unchanged.

:class:`celery_zdelay.Task` (and :class:`~celery_zdelay.DelayedTaskMixin`)
call :func:`install` when a task is bound to its app, so setting
``zdelay_threshold`` is all an app using them needs.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from celery.app.amqp import AMQP
from kombu.utils.imports import symbol_by_name
from kombu.utils.objects import cached_property

from .capture import CapturingProducer, capture
from .config import get_config
from .errors import ConfigurationError
from .parking import park_messages
from .schedule import due_from

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["TransparentAMQP", "install"]

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


class TransparentAMQP(AMQP):  # type: ignore[misc]
    """Celery's ``AMQP`` whose task sender parks messages due far enough ahead.

    With ``zdelay_threshold`` unset it is Celery's ``AMQP`` unchanged. Name
    it when creating the app where :func:`install` cannot do it for you::

        app = Celery("proj", task_cls="celery_zdelay:Task",
                     amqp="celery_zdelay:TransparentAMQP")
    """

    @cached_property  # type: ignore[untyped-decorator]
    def send_task_message(self) -> SendTaskMessage:
        """Celery's task sender, wrapped to park messages due far enough ahead."""
        return _transparent_sender(self.app, super().send_task_message)


def install(app: Celery) -> bool:
    """Make *app* publish through :class:`TransparentAMQP`; return whether it does.

    Does nothing unless ``zdelay_threshold`` is set. Sets the app's
    ``amqp_cls`` when it is Celery's default; logs a warning (once per app)
    when the app uses another ``amqp`` class, or created its ``amqp``
    object before the class could be set.
    """
    state: bool | None = getattr(app, "_zdelay_transparent", None)
    if state is not None:
        return state
    try:
        threshold_ms = get_config(app).threshold_ms
    except ConfigurationError:
        # Reported where the settings are used; binding a task is no place for it.
        return False
    if threshold_ms is None:
        return False
    current = symbol_by_name(app.amqp_cls)
    if current is AMQP:
        app.amqp_cls = TransparentAMQP
    elif not issubclass(current, TransparentAMQP):
        logger.warning(
            "zdelay_threshold is set but the app's amqp class %s.%s does not derive from "
            "celery_zdelay.TransparentAMQP: delayed tasks are sent to the broker as ETA "
            "tasks. Derive it from celery_zdelay.TransparentAMQP.",
            current.__module__,
            current.__qualname__,
        )
        app._zdelay_transparent = False
        return False
    active = isinstance(app.amqp, TransparentAMQP)
    if not active:
        logger.warning(
            "zdelay_threshold is set but the app's amqp object was created before "
            "celery_zdelay could install its own: delayed tasks are sent to the broker "
            'as ETA tasks. Create the app with Celery(..., amqp="celery_zdelay:TransparentAMQP").'
        )
    app._zdelay_transparent = active
    return active


def _transparent_sender(app: Celery, native: SendTaskMessage) -> SendTaskMessage:
    def send_task_message(producer: Any, name: str, message: Any, **options: Any) -> Any:
        headers = message[0]
        eta = headers.get("eta") if isinstance(headers, dict) else None
        if eta is None or isinstance(producer, CapturingProducer):
            # No ETA, or already being captured by apply_delayed: Celery's path.
            return native(producer, name, message, **options)
        threshold_ms = get_config(app).threshold_ms
        if threshold_ms is None:
            return native(producer, name, message, **options)
        due = due_from(eta=eta)
        if due.ms - time.time() * 1000 < threshold_ms:
            return native(producer, name, message, **options)
        # The companion releases the message when it is due: the worker must
        # run it at once, not hold it for an ETA again.
        headers["eta"] = None
        options = _without_native_delay(options)
        result, messages = capture(app, lambda p: native(p, name, message, **options))
        park_messages(app, messages, due)
        return result

    return send_task_message


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
