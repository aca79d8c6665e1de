"""Sending: retries with growing backoff, giving up after the last attempt, every attempt recorded,
and concurrent senders that never send one attempt twice."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
from django.db import connection
from django.utils import timezone

from notifications.models import Delivery, DeliveryAttempt, DeliveryStatus, Event
from notifications.services import backoff, claim_next, post, record, send_due
from tests.notifications.conftest import Receiver, deliver_until_settled, make_webhook

pytestmark = pytest.mark.django_db(transaction=True)


def make_delivery(hook, subject: str = "s-1") -> Delivery:
    return Delivery.objects.create(
        tenant=hook.tenant,
        number=Delivery.objects.filter(tenant=hook.tenant).count() + 1,
        webhook=hook,
        event=Event.APPROVAL_REQUESTED,
        subject=subject,
        payload={"tenant": hook.tenant.slug, "approval": {"id": subject}},
        next_attempt_at=timezone.now(),
    )


@pytest.fixture
def tenant(transactional_db):
    from tests import factories

    return factories.make_tenant("acme")


def test_a_receiver_failing_twice_then_answering_200_gets_three_attempts_with_growing_backoff(
    tenant, receiver, settings
):
    settings.NOTIFY_BACKOFF_SECONDS = 0.4
    receiver.script = [500, 503]
    delivery = make_delivery(make_webhook(tenant, receiver.url, [Event.APPROVAL_REQUESTED]))

    delivery = deliver_until_settled(lambda: send_due(budget_seconds=5), delivery.pk)

    assert (delivery.status, delivery.attempts, delivery.last_status_code) == (
        DeliveryStatus.DELIVERED,
        3,
        200,
    )
    attempts = list(DeliveryAttempt.objects.filter(delivery=delivery))
    assert [(a.number, a.status_code) for a in attempts] == [(1, 500), (2, 503), (3, 200)]
    waits = [(a.retry_at - a.finished_at).total_seconds() for a in attempts[:2]]
    assert 0.2 <= waits[0] <= 0.4 and 0.4 <= waits[1] <= 0.8 and waits[1] >= waits[0]
    # Each retry went out only once it was due, and carried the same signed body.
    assert attempts[1].started_at >= attempts[0].retry_at and attempts[2].started_at >= attempts[1].retry_at
    assert len(receiver.requests) == 3 and all(r.verified for r in receiver.requests)
    assert len({r.body for r in receiver.requests}) == 1
    assert [r.headers["X-Delivery-Attempt"] for r in receiver.requests] == ["1", "2", "3"]


def test_a_receiver_down_past_the_last_attempt_fails_the_delivery_with_every_attempt_recorded(
    tenant, settings
):
    settings.NOTIFY_BACKOFF_SECONDS = 0.05
    settings.NOTIFY_MAX_ATTEMPTS = 3
    down = Receiver().start()
    down.stop()  # nothing listens on its port any more
    delivery = make_delivery(make_webhook(tenant, down.url, [Event.APPROVAL_REQUESTED]))

    delivery = deliver_until_settled(lambda: send_due(budget_seconds=5), delivery.pk)

    assert (delivery.status, delivery.attempts, delivery.delivered_at) == (DeliveryStatus.FAILED, 3, None)
    assert "ConnectError" in delivery.last_error
    attempts = list(DeliveryAttempt.objects.filter(delivery=delivery))
    assert [a.number for a in attempts] == [1, 2, 3]
    assert all("ConnectError" in a.error and a.finished_at for a in attempts)
    assert attempts[-1].retry_at is None
    assert send_due(budget_seconds=1) == {"delivered": 0, "retrying": 0, "failed": 0}
    assert Delivery.objects.get(pk=delivery.pk).attempts == 3


def test_two_concurrent_senders_never_send_the_same_delivery_twice(tenant, receiver):
    receiver.delay = 0.02
    hook = make_webhook(tenant, receiver.url, [Event.APPROVAL_REQUESTED])
    deliveries = [make_delivery(hook, f"s-{i}") for i in range(30)]
    counts = []
    start = threading.Barrier(2)

    def sender():
        try:
            start.wait()
            counts.append(send_due(budget_seconds=30))
        finally:
            connection.close()

    threads = [threading.Thread(target=sender) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert sorted(receiver.delivery_ids()) == sorted(str(d.number) for d in deliveries)
    assert sum(c["delivered"] for c in counts) == 30
    assert all(c["delivered"] > 0 for c in counts), counts  # both really sent
    assert set(Delivery.objects.values_list("status", "attempts")) == {(DeliveryStatus.DELIVERED, 1)}
    assert DeliveryAttempt.objects.count() == 30


def test_a_sender_whose_lease_ran_out_cannot_record_over_the_one_that_took_over(tenant, receiver):
    delivery = make_delivery(make_webhook(tenant, receiver.url, [Event.APPROVAL_REQUESTED]))
    stalled = claim_next()
    assert claim_next() is None  # leased: nobody else may take it meanwhile

    later = timezone.now() + dt.timedelta(minutes=5)  # past the lease
    taker = claim_next(now=later)
    assert (stalled.attempt, taker.attempt) == (1, 2)

    assert record(stalled, post(stalled)) == "delivered"  # its answer is kept as an attempt only
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts) == (DeliveryStatus.PENDING, 2)

    record(taker, post(taker))
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts) == (DeliveryStatus.DELIVERED, 2)
    assert list(DeliveryAttempt.objects.values_list("number", "status_code")) == [(1, 200), (2, 200)]


def test_a_sender_that_died_on_the_last_attempt_leaves_a_failed_delivery(tenant, receiver, settings):
    settings.NOTIFY_MAX_ATTEMPTS = 1
    delivery = make_delivery(make_webhook(tenant, receiver.url, [Event.APPROVAL_REQUESTED]))
    assert claim_next() is not None  # and the sender dies: no answer is recorded

    assert claim_next(now=timezone.now() + dt.timedelta(minutes=5)) is None

    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts, delivery.last_error) == (
        DeliveryStatus.FAILED,
        1,
        "no answer recorded",
    )
    assert receiver.requests == []


def test_a_url_the_egress_hosts_no_longer_allow_fails_without_sending(tenant, receiver):
    delivery = make_delivery(make_webhook(tenant, receiver.url, [Event.APPROVAL_REQUESTED]))
    tenant.egress_hosts = ["hooks.bank.example"]
    tenant.save(update_fields=["egress_hosts"])

    assert send_due(budget_seconds=5) == {"delivered": 0, "retrying": 0, "failed": 1}

    delivery.refresh_from_db()
    assert delivery.status == DeliveryStatus.FAILED and "egress_hosts" in delivery.last_error
    assert receiver.requests == []


def test_a_redirect_is_not_followed_and_counts_as_a_failed_attempt(tenant, receiver):
    receiver.script = [302]
    delivery = make_delivery(make_webhook(tenant, receiver.url, [Event.APPROVAL_REQUESTED]))

    assert send_due(budget_seconds=5)["retrying"] == 1

    delivery.refresh_from_db()
    assert (delivery.status, delivery.last_status_code) == (DeliveryStatus.PENDING, 302)
    assert len(receiver.requests) == 1


def test_a_receiver_slower_than_the_timeout_is_cut_off(tenant, receiver, settings):
    settings.NOTIFY_TIMEOUT_SECONDS = 0.3
    receiver.delay = 2
    delivery = make_delivery(make_webhook(tenant, receiver.url, [Event.APPROVAL_REQUESTED]))
    started = timezone.now()

    send_due(budget_seconds=0.1)

    assert (timezone.now() - started).total_seconds() < 1.5
    delivery.refresh_from_db()
    assert delivery.status == DeliveryStatus.PENDING and "Timeout" in delivery.last_error


def test_backoff_doubles_within_jitter_and_is_capped(settings):
    settings.NOTIFY_BACKOFF_SECONDS = 10
    settings.NOTIFY_BACKOFF_MAX_SECONDS = 60
    for attempt, ceiling in [(1, 10), (2, 20), (3, 40), (4, 60), (9, 60)]:
        waits = [backoff(attempt) for _ in range(200)]
        assert all(ceiling / 2 <= w <= ceiling for w in waits)
        assert len(set(waits)) > 1  # jittered
