"""The celery-zdelay dashboard mounted in the shop's admin, for staff users only.

Given an order whose cancel task is parked, a staff user sees that task at
``/admin/zdelay/parked`` and can cancel it; a customer or an anonymous
visitor is sent to the admin's login page instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.auth.models import User
from django.test import Client, override_settings

from celery_zdelay.testing import FastForward
from example_project.shop.orders import place_order

pytestmark = [
    pytest.mark.timeout(20),
    pytest.mark.usefixtures("_test_host"),
]


@pytest.fixture
def _test_host() -> Iterator[None]:
    with override_settings(ALLOWED_HOSTS=["testserver"]):
        yield


@pytest.fixture
def staff() -> Client:
    client = Client()
    user, _ = User.objects.get_or_create(username="ops", defaults={"is_staff": True})
    client.force_login(user)
    return client


def test_staff_see_the_parked_cancel_task_and_can_cancel_it(
    zdelay: FastForward, staff: Client
) -> None:
    order = place_order("ann", total_cents=4200)

    overview = staff.get("/admin/zdelay/")
    assert overview.status_code == 200
    assert 'id="count-parked">1<' in overview.content.decode()
    listing = staff.get("/admin/zdelay/parked?task=shop.*").content.decode()
    assert order.cancel_task_id in listing
    assert "shop.cancel_unpaid" in listing
    # Links and forms point inside the mount.
    assert f'href="/admin/zdelay/entry?id={order.cancel_task_id}"' in listing
    token = re.search(r'name="csrf_token" value="([0-9a-f]+)"', listing)
    assert token is not None

    reply = staff.post(
        "/admin/zdelay/actions/parked",
        {"csrf_token": token.group(1), "op": "cancel", "ids": order.cancel_task_id},
    )
    assert reply.status_code == 303
    assert reply["Location"].startswith("/admin/zdelay/?msg=cancelled")
    assert zdelay.parked() == []
    # The admin's history says who cancelled it.
    (entry,) = LogEntry.objects.filter(object_id=order.cancel_task_id)
    assert entry.user.username == "ops"
    assert entry.action_flag == DELETION
    assert "celery-zdelay dashboard" in entry.change_message


def test_customers_and_strangers_are_sent_to_the_admin_login(zdelay: FastForward) -> None:
    assert Client().get("/admin/zdelay/").status_code == 302
    customer = Client()
    customer.force_login(User.objects.get_or_create(username="customer")[0])
    for path in ("/admin/zdelay/", "/admin/zdelay/parked"):
        reply = customer.get(path)
        assert reply.status_code == 302
        assert reply["Location"].startswith("/admin/login/")
    assert customer.post("/admin/zdelay/actions/parked", {"op": "cancel"}).status_code == 302
    assert Client().get("/admin/login/").status_code == 200  # where they are sent


def test_a_permission_and_a_decorator_together_are_refused(zdelay: FastForward) -> None:
    # Regression: the permission was silently dropped when a decorator was given.
    from django.contrib.auth.decorators import login_required

    from celery_zdelay.errors import ConfigurationError
    from celery_zdelay.web.django import dashboard_urls
    from example_project.celery import app

    with pytest.raises(ConfigurationError, match="not both"):
        dashboard_urls(app, permission="shop.view_order", decorator=login_required)
