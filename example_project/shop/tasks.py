"""The task parked when an order is placed: cancel it if it is still unpaid."""

from __future__ import annotations

from celery import shared_task
from django.utils import timezone

from .models import Order


@shared_task(name="shop.cancel_unpaid")
def cancel_unpaid(order_id: int) -> str:
    """Cancel order *order_id* unless it was paid.

    Paying cancels this task, but the payment may land in the last second,
    after the task was released: so the task looks at the order again, and
    cancels only an order still pending, in one conditional UPDATE that a
    concurrent payment cannot slip past.
    """
    now = timezone.now()
    cancelled = Order.objects.filter(pk=order_id, status=Order.Status.PENDING).update(
        status=Order.Status.CANCELLED, cancelled_at=now, cancel_checked_at=now
    )
    if cancelled:
        return f"order {order_id} cancelled: unpaid"
    Order.objects.filter(pk=order_id).update(cancel_checked_at=now)
    return f"order {order_id} left alone: already paid or closed"
