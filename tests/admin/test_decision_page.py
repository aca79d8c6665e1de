"""The approval page's Django conventions (issue 39): money in the inbox's AMOUNT column, a reason
required to deny (and to approve where the tenant says so), each decision and correction in the
admin's Recent actions, and a decision from a stale tab answered with what happened."""

from __future__ import annotations

import json

import pytest
from django.contrib import messages
from django.contrib.admin.models import LogEntry
from django.urls import reverse
from django.utils.html import escape

from approvals.models import Approval, ApprovalStatus
from core.ids import short
from tenants.models import Tenant
from tests.admin.helpers import park_on_approval
from tools.models import Tool

pytestmark = pytest.mark.django_db(transaction=True)


def page_url(approval) -> str:
    return reverse("admin:approvals_approval_change", args=[approval.pk])


def messages_of(response) -> list[tuple[int, str]]:
    return [(m.level, str(m)) for m in response.context["messages"]]


def log_of(approval) -> list[tuple[str, str]]:
    entries = LogEntry.objects.filter(object_id=str(approval.pk)).order_by("action_time")
    return [(e.user.username, e.get_change_message()) for e in entries]


@pytest.fixture
def in_inr(acme):
    """acme reads INR, and its echo tool's schema marks `amount` as money."""
    Tenant.objects.filter(pk=acme.tenant.pk).update(currency="INR", exchange_rate=83)
    echo = acme.tools["echo"]
    echo.input_schema = {
        "type": "object",
        "properties": {
            "amount": {"type": "number", "format": "money"},
            "transaction_id": {"type": "string"},
            "currency": {"type": "string"},
        },
    }
    Tool.objects.filter(pk=echo.pk).update(input_schema=echo.input_schema)
    return acme


def test_the_inbox_amount_column_and_the_page_show_money(as_ravi, in_inr):
    approval = park_on_approval(in_inr.asha, "refunder")
    inbox = as_ravi.get(reverse("admin:approvals_approval_changelist")).content.decode()
    assert '<td class="field-amount">INR 12,499.00</td>' in inbox
    page = as_ravi.get(page_url(approval)).content.decode()
    assert '<dd id="decision-amount"><strong>INR 12,499.00</strong></dd>' in page


def test_a_denial_needs_a_reason_and_lands_in_recent_actions(as_ravi, in_inr):
    approval = park_on_approval(in_inr.asha, "refunder")

    refused = as_ravi.post(page_url(approval), {"_deny": "Deny", "reason": "  "})
    assert refused.status_code == 200
    assert "a reason is required to deny" in refused.content.decode()
    assert Approval.objects.get(pk=approval.pk).status == ApprovalStatus.PENDING
    assert log_of(approval) == []

    denied = as_ravi.post(page_url(approval), {"_deny": "Deny", "reason": "a duplicate"}, follow=True)
    assert Approval.objects.get(pk=approval.pk).status == ApprovalStatus.DENIED
    assert (messages.SUCCESS, f"denied: {approval.tool.name} for run {short(approval.run_id)}") in (
        messages_of(denied)
    )
    assert log_of(approval) == [("ravi", "Denied: a duplicate")]
    recent = as_ravi.get("/admin/").content.decode()  # the index's Recent actions
    assert escape(f"{approval.tool.name} for run {approval.run_id} (denied)") in recent


def test_a_tenant_can_require_a_reason_to_approve(as_ravi, in_inr):
    Tenant.objects.filter(pk=in_inr.tenant.pk).update(approval_reason_required=True)
    approval = park_on_approval(in_inr.asha, "refunder")

    refused = as_ravi.post(page_url(approval), {"_approve": "Approve", "reason": ""})
    assert "a reason is required to approve" in refused.content.decode()
    assert Approval.objects.get(pk=approval.pk).status == ApprovalStatus.PENDING

    as_ravi.post(page_url(approval), {"_approve": "Approve", "reason": "checked the ledger"})
    assert Approval.objects.get(pk=approval.pk).status == ApprovalStatus.APPROVED
    assert log_of(approval) == [("ravi", "Approved: checked the ledger")]


def test_a_decision_from_a_stale_tab_says_what_happened_instead_of_success(as_ravi, in_inr):
    approval = park_on_approval(in_inr.asha, "refunder")
    as_ravi.post(page_url(approval), {"_approve": "Approve", "reason": "fine"}, follow=True)

    again = as_ravi.post(page_url(approval), {"_approve": "Approve", "reason": "fine"}, follow=True)
    [(level, text)] = messages_of(again)
    assert level == messages.WARNING
    assert "already approved by ravi at " in text and text.endswith("nothing changed")
    assert log_of(approval) == [("ravi", "Approved: fine")]  # the repeat changed nothing


def test_a_correction_keeps_both_calls_and_lands_in_recent_actions(as_ravi, in_inr):
    approval = park_on_approval(in_inr.asha, "refunder")
    corrected = {"amount": 899, "currency": "INR", "transaction_id": "TXN-1001"}
    url = reverse("admin:approvals_approval_correct", args=[approval.pk])
    as_ravi.post(url, {"arguments": json.dumps(corrected), "reason": "the payment was INR 899"})
    approval.refresh_from_db()
    assert approval.status == ApprovalStatus.APPROVED
    assert approval.original_arguments["amount"] == 12499 and approval.arguments == corrected
    assert log_of(approval) == [
        ("ravi", "Corrected (amount 12499 → 899) and approved: the payment was INR 899")
    ]
    page = as_ravi.get(page_url(approval)).content.decode()
    assert 'id="original-arguments"' in page and "INR 12,499.00" in page and "INR 899.00" in page
