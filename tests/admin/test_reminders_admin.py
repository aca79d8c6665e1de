"""The approval page shows its reminder and escalation with their times; a member of the group it
was escalated to finds it in the inbox and decides it there."""

from __future__ import annotations

import datetime as dt

from django.urls import reverse
from django.utils import dateformat, timezone

from approvals.models import ApprovalStatus
from configuration.apply import apply_config
from runs.approval_effects import remind_approvals
from tenants.models import User
from tests.admin.helpers import park_on_approval


def configure() -> None:
    apply_config(
        {
            "tenant": {"slug": "acme", "remind_after": "10m", "escalate_after": "1h", "escalate_to": "risk"},
            "groups": [{"name": "risk"}],
            "users": [{"username": "meera", "groups": ["risk"], "staff": True}],
        }
    )


def detail_url(approval) -> str:
    return reverse("admin:approvals_approval_change", args=[approval.pk])


def test_the_page_shows_when_it_is_due_then_when_it_was_reminded_and_escalated(as_ravi, acme):
    configure()
    approval = park_on_approval(acme.asha, "refunder")
    due = dateformat.format(approval.remind_at, "j M Y, H:i")

    html = as_ravi.get(detail_url(approval)).content.decode()
    assert f"due at {due}" in html and "Escalation</th><td>to risk due at" in html

    reminded_at = timezone.now() + dt.timedelta(minutes=11)
    escalated_at = timezone.now() + dt.timedelta(minutes=61)
    remind_approvals(now=reminded_at)
    remind_approvals(now=escalated_at)

    html = as_ravi.get(detail_url(approval)).content.decode()
    assert f"Reminded</th><td>at {dateformat.format(reminded_at, 'j M Y, H:i')}" in html
    assert f"Escalated</th><td>to risk (meera) at {dateformat.format(escalated_at, 'j M Y, H:i')}" in html


def test_a_member_of_the_escalation_group_decides_it_in_the_admin(client, acme):
    configure()
    meera = User.objects.get(username="meera")
    approval = park_on_approval(acme.asha, "refunder")
    client.force_login(meera)
    inbox = reverse("admin:approvals_approval_changelist")

    assert client.get(inbox).status_code == 403  # nothing escalated to her group yet
    remind_approvals(now=timezone.now() + dt.timedelta(minutes=61))
    assert str(approval.pk) in client.get(inbox).content.decode()

    response = client.post(detail_url(approval), {"_approve": "Approve", "reason": "ravi is away"})

    assert response.status_code == 302
    approval.refresh_from_db()
    assert (approval.status, approval.decided_by) == (ApprovalStatus.APPROVED, meera)


def test_the_inbox_says_which_calls_were_already_reminded_of_or_escalated(as_ravi, acme):
    configure()
    reminded = park_on_approval(acme.asha, "refunder")
    remind_approvals(now=timezone.now() + dt.timedelta(minutes=11))
    inbox = reverse("admin:approvals_approval_changelist")

    html = as_ravi.get(inbox).content.decode()
    assert "Reminded / escalated" in html
    assert "reminded 0" in html and "escalated to risk" not in html

    remind_approvals(now=timezone.now() + dt.timedelta(minutes=61))
    html = as_ravi.get(inbox).content.decode()
    assert "escalated to risk" in html
    assert str(reminded.pk) in html
