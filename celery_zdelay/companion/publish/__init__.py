"""Publish released messages to the app's broker: one module per publisher.

- :mod:`.generic`: any broker through kombu (:class:`Publisher`);
- :mod:`.redis_broker`: a Redis broker, each reply of the pipelined push
  read on its own (:class:`RedisPublisher`);
- :mod:`.confirming`: a broker with publisher confirms, RabbitMQ
  (:class:`ConfirmPublisher`).

:func:`make_publisher` picks one by what the broker's transport can do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .confirming import ConfirmPublisher, Confirms, supports_confirms
from .generic import MAX_BROKER_WAIT, Publisher, PublishOutcome, broker_connection
from .redis_broker import RedisPublisher

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "MAX_BROKER_WAIT",
    "ConfirmPublisher",
    "Confirms",
    "PublishOutcome",
    "Publisher",
    "RedisPublisher",
    "broker_connection",
    "make_publisher",
    "supports_confirms",
]


def make_publisher(app: Celery, *, lease_ms: int) -> Publisher:
    """Return the publisher for *app*'s broker, waiting at most half a lease.

    Chosen by what the transport can do, not by its name: a transport whose
    channels confirm publishes gets the confirm publisher.
    """
    transport = app.connection_for_write().transport
    publisher: type[Publisher] = Publisher
    if supports_confirms(transport):
        publisher = ConfirmPublisher
    elif transport.driver_type == "redis":
        publisher = RedisPublisher
    return publisher(app, broker_wait=lease_ms / 2000)
