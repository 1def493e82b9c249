"""An order, and the parked task that cancels it if it stays unpaid."""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class Order(models.Model):
    class Status(models.TextChoices):
        PENDING = "pending"
        PAID = "paid"
        CANCELLED = "cancelled"

    customer = models.CharField(max_length=100)
    total_cents = models.PositiveIntegerField()
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    created_at = models.DateTimeField(default=timezone.now)
    #: End of the payment window: the parked cancel task is due then.
    pay_by = models.DateTimeField()
    paid_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    #: Id of the parked ``cancel_unpaid`` task, to cancel it on payment.
    cancel_task_id = models.CharField(max_length=64, blank=True)
    #: When ``cancel_unpaid`` ran for this order, if it did.
    cancel_checked_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"order {self.pk} ({self.status})"


class Sweep(models.Model):
    """One run of the periodic clean-up ``sweep_stale_orders``."""

    task_id = models.CharField(max_length=100)
    ran_at = models.DateTimeField(default=timezone.now)
    #: Orders still pending long after their window (their cancel task lost).
    cancelled = models.PositiveIntegerField(default=0)

    def __str__(self) -> str:
        return f"sweep {self.task_id}"
