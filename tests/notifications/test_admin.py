"""Operators configure webhooks and read deliveries in the admin; tenant users see neither."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

from notifications.models import Delivery, Event, Webhook
from tests import factories
from tests.notifications.conftest import SECRET

pytestmark = pytest.mark.django_db

WEBHOOKS = "/admin/notifications/webhook/"


@pytest.fixture
def tenant():
    return factories.make_tenant("acme", egress_hosts=["hooks.bank.example"])


def add(client, tenant, url: str):
    return client.post(
        f"{WEBHOOKS}add/",
        {
            "tenant": tenant.pk,
            "name": "supervisors",
            "url": url,
            "signing_secret": SECRET,
            "events": [Event.APPROVAL_REQUESTED, Event.APPROVAL_EXPIRING],
            "enabled": "on",
        },
    )


def test_an_operator_adds_a_webhook_whose_secret_is_stored_encrypted(client, tenant):
    client.force_login(get_user_model().objects.create_superuser("ops", password="pw"))

    response = add(client, tenant, "https://hooks.bank.example/in")

    assert response.status_code == 302, response.content.decode()[:2000]
    hook = Webhook.objects.get()
    assert hook.signing_secret() == SECRET and SECRET not in hook.signing_ciphertext
    assert hook.events == [Event.APPROVAL_REQUESTED, Event.APPROVAL_EXPIRING]
    page = client.get(f"{WEBHOOKS}{hook.pk}/change/").content.decode()
    assert SECRET not in page and hook.signing_ciphertext not in page
    assert client.get("/admin/notifications/delivery/").status_code == 200


def test_an_operator_cannot_point_a_webhook_outside_the_egress_hosts(client, tenant):
    client.force_login(get_user_model().objects.create_superuser("ops", password="pw"))

    response = add(client, tenant, "http://10.0.0.7/steal")

    assert response.status_code == 200
    assert "host is not in tenant.egress_hosts" in response.content.decode()
    assert not Webhook.objects.exists()


def test_a_tenant_supervisor_sees_no_webhooks_nor_deliveries(client, tenant):
    client.force_login(factories.make_user(tenant, "ravi", staff=True))

    assert client.get(WEBHOOKS).status_code == 403
    assert add(client, tenant, "https://hooks.bank.example/in").status_code == 403
    assert client.get("/admin/notifications/delivery/").status_code == 403
    assert not Webhook.objects.exists() and not Delivery.objects.exists()


def test_an_edit_without_a_new_secret_keeps_the_stored_one(client, tenant):
    client.force_login(get_user_model().objects.create_superuser("ops", password="pw"))
    add(client, tenant, "https://hooks.bank.example/in")
    hook = Webhook.objects.get()

    response = client.post(
        f"{WEBHOOKS}{hook.pk}/change/",
        {
            "tenant": tenant.pk,
            "name": "supervisors",
            "url": "https://hooks.bank.example/moved",
            "signing_secret": "",
            "events": [Event.RUN_NEEDS_ATTENTION],
        },
    )

    assert response.status_code == 302, response.content.decode()[:2000]
    hook.refresh_from_db()
    assert (hook.url, hook.events, hook.enabled) == (
        "https://hooks.bank.example/moved",
        ["run_needs_attention"],
        False,
    )
    assert hook.signing_secret() == SECRET
