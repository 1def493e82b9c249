"""The shop's tasks: the one parked when an order is placed, and a periodic clean-up."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from .models import Order, Sweep


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


@shared_task(name="shop.sweep_stale_orders", bind=True)
def sweep_stale_orders(self) -> str:  # type: ignore[no-untyped-def]
    """Cancel orders still pending long after their window: belt and braces.

    Runs on ``CELERY_BEAT_SCHEDULE``, served by the celery-zdelay companions
    (``CELERY_ZDELAY_BEAT``) instead of celery beat: hourly in production.
    An order's own parked cancel task does the real work; this only catches
    one whose task was lost (e.g. its Redis was restored from an old backup).
    """
    now = timezone.now()
    stale = Order.objects.filter(
        status=Order.Status.PENDING, pay_by__lt=now - settings.SHOP_SWEEP_GRACE
    ).update(status=Order.Status.CANCELLED, cancelled_at=now)
    Sweep.objects.create(task_id=self.request.id or "", ran_at=now, cancelled=stale)
    return f"{stale} stale orders cancelled"
