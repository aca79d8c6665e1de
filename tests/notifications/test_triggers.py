"""What makes a notification: an approval requested, an approval about to expire, a run needing
attention. Each is counted at a local receiver, signed, and made exactly once."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from django.utils import timezone

from notifications.models import Delivery, DeliveryStatus, Event
from notifications.services import scan, send_due
from runs.transitions import record_event
from tests.notifications.conftest import (
    approving_tenant,
    make_webhook,
    parked_approval,
    run_needing_attention,
)

pytestmark = pytest.mark.django_db(transaction=True)


def notify(now=None) -> dict:
    """One pass of the periodic task."""
    return {**scan(now), **send_due(budget_seconds=10)}


def test_a_run_that_requests_approval_produces_exactly_one_signed_delivery(acme, receiver):
    make_webhook(acme.tenant, receiver.url, [Event.APPROVAL_REQUESTED, Event.RUN_NEEDS_ATTENTION])
    scan()  # the cursor starts here: the event below is read as a fresh one
    approval = parked_approval(acme)

    assert notify() == {"created": 1, "delivered": 1, "retrying": 0, "failed": 0}
    notify()
    notify()

    assert len(receiver.requests) == 1
    request = receiver.requests[0]
    assert request.verified
    assert request.headers["X-Event"] == "approval_requested"
    body = json.loads(request.body)
    assert body["approval"]["id"] == str(approval.pk)
    assert body["approval"]["tool"] == acme.tools["echo"].name
    assert body["run"] == {"id": str(approval.run_id), "agent": "refunder", "created_by": "asha"}
    assert body["tenant"] == "acme" and "arguments" not in body["approval"]
    delivery = Delivery.objects.get()
    assert (delivery.status, delivery.attempts, delivery.last_status_code) == (
        DeliveryStatus.DELIVERED,
        1,
        200,
    )
    assert delivery.approval_id == approval.pk and delivery.delivered_at is not None


def test_an_event_committed_after_the_cursor_passed_it_is_still_notified(acme, receiver):
    make_webhook(acme.tenant, receiver.url, [Event.APPROVAL_REQUESTED])
    approval = parked_approval(acme)
    event = approval.run.events.get(kind="approval_requested")
    scan()
    # As if the event's transaction committed only now, after the cursor moved past its id.
    from notifications.models import ScanCursor

    ScanCursor.objects.update(last_id=event.id + 1000)
    Delivery.objects.all().delete()

    notify()

    assert len(receiver.requests) == 1 and receiver.requests[0].verified


def test_a_webhook_does_not_hear_of_events_from_before_it_was_made(acme, receiver):
    parked_approval(acme)
    make_webhook(acme.tenant, receiver.url, [Event.APPROVAL_REQUESTED])

    notify()

    assert receiver.requests == [] and not Delivery.objects.exists()


def test_an_approval_about_to_expire_produces_one_delivery(acme, receiver, settings):
    settings.NOTIFY_EXPIRING_WITHIN_SECONDS = 900
    make_webhook(acme.tenant, receiver.url, [Event.APPROVAL_EXPIRING])
    approval = parked_approval(acme)  # expires in the tenant's approval_ttl_seconds (a day)

    notify()
    assert receiver.requests == []  # a day ahead: not yet

    soon = approval.expires_at - dt.timedelta(minutes=10)
    notify(soon)
    notify(soon + dt.timedelta(minutes=1))

    assert len(receiver.requests) == 1
    request = receiver.requests[0]
    body = json.loads(request.body)
    assert request.verified and body["event"] == "approval_expiring"
    assert body["approval"]["id"] == str(approval.pk) and body["expires_in_seconds"] == 600
    assert Delivery.objects.get().status == DeliveryStatus.DELIVERED


def test_an_approval_already_decided_gets_no_expiry_notice(acme, receiver):
    from runs.approval_effects import decide_approval

    make_webhook(acme.tenant, receiver.url, [Event.APPROVAL_EXPIRING])
    approval = parked_approval(acme)
    decide_approval(approval_id=approval.pk, user=acme.ravi, approve=False, reason="no")

    notify(approval.expires_at - dt.timedelta(minutes=10))

    assert receiver.requests == []


def test_a_run_needing_attention_produces_one_delivery(acme, receiver):
    make_webhook(acme.tenant, receiver.url, [Event.RUN_NEEDS_ATTENTION])
    scan()
    run = run_needing_attention(acme)

    notify()
    notify()

    assert len(receiver.requests) == 1
    request = receiver.requests[0]
    body = json.loads(request.body)
    assert request.verified and body["event"] == "run_needs_attention"
    assert body["run"]["id"] == str(run.pk) and body["reason"].startswith("needs attention: step 2")
    seq = run.events.get(kind="status", skeleton__to="needs_attention").seq
    assert Delivery.objects.get().subject == f"{run.pk}:{seq}"


def test_each_entry_into_needs_attention_is_its_own_notification(acme, receiver):
    make_webhook(acme.tenant, receiver.url, [Event.RUN_NEEDS_ATTENTION])
    scan()
    run = run_needing_attention(acme)
    notify()
    # A second entry into the status later in the same run's life.
    record_event(run.pk, "status", "needs attention again", **{"from": "running", "to": "needs_attention"})

    notify()

    assert len(receiver.requests) == 2
    assert len(set(receiver.delivery_ids())) == 2


def test_only_subscribed_events_of_enabled_webhooks_of_the_tenant_are_sent(acme, receiver):
    from tests import factories

    other = factories.make_tenant("globex")
    make_webhook(other, receiver.url, [Event.APPROVAL_REQUESTED], name="globex")
    make_webhook(acme.tenant, receiver.url, [Event.RUN_NEEDS_ATTENTION], name="attention-only")
    off = make_webhook(acme.tenant, receiver.url, [Event.APPROVAL_REQUESTED], name="off")
    off.enabled = False
    off.save()
    scan()
    parked_approval(acme)

    notify()

    assert receiver.requests == [] and not Delivery.objects.exists()


def test_scan_interval_bounds_latency(acme, receiver):
    """Event to delivery within one pass: the pass right after the commit sends it."""
    make_webhook(acme.tenant, receiver.url, [Event.APPROVAL_REQUESTED])
    scan()
    approval = parked_approval(acme)
    committed = approval.run.events.get(kind="approval_requested").at

    notify()

    delivered = Delivery.objects.get().delivered_at
    assert (delivered - committed).total_seconds() < 5
    assert timezone.now() >= delivered


def test_the_periodic_task_scans_and_sends_on_the_sweepers_queue_every_few_seconds(acme, receiver, settings):
    from agentplatform.celery import app
    from notifications.tasks import notify as task

    assert settings.CELERY_BEAT_SCHEDULE["notify"]["task"] == task.name
    assert settings.CELERY_BEAT_SCHEDULE["notify"]["schedule"] <= 10
    assert app.amqp.router.route({}, task.name)["queue"].name == settings.SWEEP_QUEUE
    make_webhook(acme.tenant, receiver.url, [Event.APPROVAL_REQUESTED])
    task()
    parked_approval(acme)

    assert task() == {"created": 1, "delivered": 1, "retrying": 0, "failed": 0}
    assert len(receiver.requests) == 1


def test_delivery_ids_count_per_tenant_so_a_receiver_learns_nothing_of_other_tenants(acme, receiver):
    globex = approving_tenant("globex", requester="bob", approver="gina")
    make_webhook(acme.tenant, receiver.url, [Event.APPROVAL_REQUESTED])
    make_webhook(globex.tenant, receiver.url, [Event.APPROVAL_REQUESTED])
    scan()
    # Interleaved: acme, globex, globex, acme. One sequence across tenants gave acme 1 and 4,
    # telling its receiver that two notifications went elsewhere in between.
    for tenant in (acme, globex, globex, acme):
        parked_approval(tenant)
        notify()

    seen = sorted(
        (json.loads(r.body)["tenant"], r.headers["X-Delivery-Id"], json.loads(r.body)["id"])
        for r in receiver.requests
    )
    assert seen == [("acme", "1", 1), ("acme", "2", 2), ("globex", "1", 1), ("globex", "2", 2)]
