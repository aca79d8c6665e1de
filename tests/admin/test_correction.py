"""The admin's correction form: an approver changes the amount with a reason, the corrected call
is approved and sent, the model is told; a bad correction is answered on the form."""

from __future__ import annotations

import json

from django.urls import reverse

from approvals.models import Approval, ApprovalStatus
from runs.models import RunEvent, RunStatus, Step
from tests.admin.conftest import REFUND
from tests.admin.helpers import park_on_approval
from tests.conftest import drive


def url(approval) -> str:
    return reverse("admin:approvals_approval_correct", args=[approval.pk])


def test_it_corrects_the_amount_and_the_corrected_call_is_sent(as_ravi, acme):
    approval = park_on_approval(acme.asha, "refunder")
    page = as_ravi.get(url(approval))
    assert page.status_code == 200 and b"Correct and approve" in page.content
    corrected = {**REFUND, "amount": 9000}

    response = as_ravi.post(url(approval), {"arguments": json.dumps(corrected), "reason": "partial refund"})

    assert response.status_code == 302
    approval.refresh_from_db()
    assert approval.status == ApprovalStatus.APPROVED and approval.original_arguments == REFUND
    run = drive(approval.run_id)
    assert run.status == RunStatus.SUCCEEDED
    step = Step.objects.get(pk=approval.step_id)
    assert (
        step.arguments == corrected
        and "approver ravi corrected it (amount: 12499 -> 9000)" in step.observation
    )
    assert RunEvent.objects.filter(run=run, kind="approval_corrected").count() == 1
    assert Approval.objects.get(pk=approval.pk).status == ApprovalStatus.CONSUMED


def test_a_correction_without_a_change_is_answered_on_the_form(as_ravi, acme):
    approval = park_on_approval(acme.asha, "refunder")
    response = as_ravi.post(url(approval), {"arguments": json.dumps(REFUND), "reason": "same"})
    assert response.status_code == 200 and b"the corrected call is the same call" in response.content
    assert Approval.objects.get(pk=approval.pk).status == ApprovalStatus.PENDING


def test_the_requester_cannot_open_the_form(client, acme):
    approval = park_on_approval(acme.asha, "refunder")
    client.force_login(acme.asha)
    assert client.get(url(approval)).status_code in (302, 403)
