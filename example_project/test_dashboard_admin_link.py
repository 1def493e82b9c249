"""The admin and the dashboard link to each other.

Given the shop's admin with the dashboard mounted at ``/admin/zdelay/`` and
``celery_zdelay.contrib.django`` installed before the admin, a staff user
finds the dashboard on the admin index, and every dashboard page links back
to the admin index.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.contrib.auth.models import User
from django.test import Client, override_settings

pytestmark = [pytest.mark.timeout(20), pytest.mark.usefixtures("_test_host")]


@pytest.fixture
def _test_host() -> Iterator[None]:
    with override_settings(ALLOWED_HOSTS=["testserver"]):
        yield


@pytest.fixture
def staff() -> Client:
    client = Client()
    user, _ = User.objects.get_or_create(
        username="ops-admin", defaults={"is_staff": True, "is_superuser": True}
    )
    client.force_login(user)
    return client


def test_the_admin_index_links_to_the_dashboard_and_the_dashboard_back(staff: Client) -> None:
    index = staff.get("/admin/")
    assert index.status_code == 200
    html = index.content.decode()
    assert 'id="zdelay-dashboard-link"' in html
    assert 'href="/admin/zdelay/"' in html
    # The admin's own apps are still listed below it.
    assert "Users" in html
    for page in ("/admin/zdelay/", "/admin/zdelay/parked", "/admin/zdelay/periodic"):
        dashboard = staff.get(page).content.decode()
        assert '<a id="home-link" href="/admin/">' in dashboard, page
