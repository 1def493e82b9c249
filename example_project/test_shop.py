"""An unpaid order is cancelled after 30 minutes; a paid one is not.

Placing an order parks ``cancel_unpaid`` for the end of its 30-minute payment
window. The ``zdelay`` fixture lets those 30 minutes pass for what is parked
in an instant: ``zdelay.advance(30 * 60)`` releases the task through the
companion's code, and the task runs here as a worker would run it.
"""

from __future__ import annotations

import pytest

import celery_zdelay
from celery_zdelay.testing import FastForward
from example_project.shop.models import Order
from example_project.shop.orders import OrderClosed, cancel_key, pay_order, place_order
from example_project.shop.tasks import cancel_unpaid

pytestmark = pytest.mark.timeout(10)  # pytest-timeout: these take milliseconds

MINUTES = 60


def status(order: Order) -> str:
    order.refresh_from_db()
    return order.status


def test_an_unpaid_order_is_cancelled_after_30_minutes(zdelay: FastForward) -> None:
    order = place_order("ann", total_cents=4200)

    (parked,) = zdelay.parked()
    assert (parked.id, parked.name) == (order.cancel_task_id, "shop.cancel_unpaid")
    assert parked.argsrepr == f"({order.pk},)"

    zdelay.advance(29 * MINUTES)
    assert status(order) == Order.Status.PENDING

    zdelay.advance(1 * MINUTES)
    assert status(order) == Order.Status.CANCELLED


def test_a_paid_order_is_not_cancelled(zdelay: FastForward) -> None:
    order = place_order("bob", total_cents=4200)

    payment = pay_order(order.pk)

    assert payment.cancel_task_removed
    assert zdelay.parked() == []
    assert zdelay.advance(30 * MINUTES) == []
    assert status(order) == Order.Status.PAID


def test_a_payment_in_the_last_second_is_not_undone(zdelay: FastForward) -> None:
    order = place_order("cid", total_cents=4200)
    # The payment is recorded while the cancel task is being released, too
    # late to cancel it: the task runs, and must look before it cancels.
    Order.objects.filter(pk=order.pk).update(status=Order.Status.PAID)

    (ran,) = zdelay.advance(30 * MINUTES)

    assert ran.result == f"order {order.pk} left alone: already paid or closed"
    assert status(order) == Order.Status.PAID


def test_paying_a_cancelled_order_is_refused(zdelay: FastForward) -> None:
    order = place_order("dee", total_cents=4200)
    zdelay.advance(30 * MINUTES)

    with pytest.raises(OrderClosed, match="cancelled"):
        pay_order(order.pk)


def test_an_order_has_one_cancel_task_however_often_it_is_parked(zdelay: FastForward) -> None:
    order = place_order("eve", total_cents=4200)

    again = cancel_unpaid.apply_delayed((order.pk,), eta=order.pay_by, key=cancel_key(order.pk))

    assert again.id == order.cancel_task_id
    (parked,) = zdelay.parked()
    assert parked.id == order.cancel_task_id
    found = celery_zdelay.lookup(order.cancel_task_id, app=cancel_unpaid.app)
    assert found is not None
    assert found.tags == (f"order:{order.pk}",)
