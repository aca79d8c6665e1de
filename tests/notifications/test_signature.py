"""The verification snippet in docs/notifications.md, run as written against real deliveries."""

from __future__ import annotations

import time

import pytest
from django.utils import timezone

from notifications.models import Delivery, Event
from notifications.services import send_due
from notifications.signing import signature
from tests.notifications.conftest import SECRET, documented_verify, make_webhook

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def received(receiver):
    from tests import factories

    tenant = factories.make_tenant("acme")
    hook = make_webhook(tenant, receiver.url, [Event.APPROVAL_REQUESTED])
    Delivery.objects.create(
        tenant=tenant,
        number=1,
        webhook=hook,
        event=Event.APPROVAL_REQUESTED,
        subject="a-1",
        payload={"tenant": "acme", "approval": {"id": "a-1"}},
        next_attempt_at=timezone.now(),
    )
    send_due(budget_seconds=5)
    assert len(receiver.requests) == 1
    return receiver.requests[0]


def test_the_documented_snippet_verifies_a_delivered_request(received):
    verify = documented_verify()

    assert verify(SECRET, received.headers, received.body)
    assert received.headers["X-Signature"] == signature(
        SECRET, received.headers["X-Timestamp"], received.body
    )


def test_the_documented_snippet_refuses_a_changed_body_a_wrong_secret_and_an_old_request(received):
    verify = documented_verify()
    old = str(int(time.time()) - 3600)

    assert not verify(SECRET, received.headers, received.body.replace(b"a-1", b"a-2"))
    assert not verify("another-secret-0123456789", received.headers, received.body)
    assert not verify(
        SECRET,
        {**received.headers, "X-Timestamp": old, "X-Signature": signature(SECRET, old, received.body)},
        received.body,
    )
