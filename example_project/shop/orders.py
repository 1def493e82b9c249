"""Placing and paying orders: what the shop's views would call."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings
from django.db import transaction
from django.utils import timezone

import celery_zdelay

from .models import Order
from .tasks import cancel_unpaid


class OrderClosed(Exception):
    """Raised when paying an order that is no longer pending."""


@dataclass(frozen=True)
class Payment:
    order: Order
    #: The parked cancel task was removed; False if it had been released
    #: already (it will find the order paid and leave it alone).
    cancel_task_removed: bool


def cancel_key(order_id: int) -> str:
    """The key of an order's cancel task: at most one is parked per order."""
    return f"cancel-unpaid:{order_id}"


def place_order(customer: str, total_cents: int) -> Order:
    """Create an order and park the task that cancels it if it stays unpaid.

    The task is parked when the transaction commits, due at the end of the
    payment window; if the transaction rolls back, nothing is parked. Its key
    keeps one cancel task per order however often it is parked (a retried
    commit hook, a repair job), and its tag finds it by order.
    """
    with transaction.atomic():
        now = timezone.now()
        order = Order.objects.create(
            customer=customer,
            total_cents=total_cents,
            created_at=now,
            pay_by=now + settings.SHOP_PAYMENT_WINDOW,
        )
        result = cancel_unpaid.apply_delayed_on_commit(
            (order.pk,),
            eta=order.pay_by,
            key=cancel_key(order.pk),
            tags=[f"order:{order.pk}"],
        )
        order.cancel_task_id = result.id
        order.save(update_fields=["cancel_task_id"])
    return order


def pay_order(order_id: int) -> Payment:
    """Record the payment of a pending order and cancel its parked cancel task.

    Raises:
        OrderClosed: the order was cancelled (or paid) already.
    """
    paid = Order.objects.filter(pk=order_id, status=Order.Status.PENDING).update(
        status=Order.Status.PAID, paid_at=timezone.now()
    )
    order = Order.objects.get(pk=order_id)
    if not paid:
        raise OrderClosed(f"order {order_id} is {order.status}")
    # After the payment is committed: were the process to die right here, the
    # task would still run, find the order paid, and do nothing.
    removed = celery_zdelay.cancel(order.cancel_task_id, app=cancel_unpaid.app)
    return Payment(order, removed)
