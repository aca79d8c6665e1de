"""An approver corrects a call: checked again (policy with the approver as editor), its own
digest, dispatched once with the corrected arguments, the model told, both versions on the
timeline; an edit above the approver's own limit is refused. Real PostgreSQL and bank server."""

from __future__ import annotations

import pytest

from approvals.models import Approval, ApprovalStatus
from approvals.policy_sets import PolicySpec, SourceSet, check, install
from runs.models import RunEvent, RunStatus, Step
from tests import factories
from tests.approvals.test_approvals_api import REFUND, approve, error_code, park
from tests.conftest import drive

pytestmark = pytest.mark.django_db(transaction=True)

EDITOR_LIMIT = """
@id("edit-within-approvers-limit")
@reason("an approver may not set a refund above their own refund limit")
forbid (principal, action == Action::"bank__issue_refund", resource)
when { context has editor && context.arguments.amount > context.editor.refund_limit };
"""


@pytest.fixture
def tools(tenant, asha, ravi, bank):
    made = factories.make_bank_tools(tenant, bank.mcp_url)
    factories.grant(made["issue_refund"], use=[asha], approve=[ravi])
    return made


@pytest.fixture
def limits(tenant, tools):
    spec = PolicySpec(
        sets=[SourceSet(name="edits", text=EDITOR_LIMIT)],
        user_attribute_types={"refund_limit": {"type": "long", "default": 0}},
        user_attributes={"ravi": {"refund_limit": 10000}},
    )
    assert check(tenant, spec) == []
    install(tenant, spec)


def correct(user, approval, **body):
    return approve(user, approval, "correct", **body)


def test_an_edit_above_the_approvers_own_limit_is_refused(tenant, asha, ravi, bank, tools, limits):
    run, approval = park(tenant, asha, tools["issue_refund"], REFUND)
    response = correct(ravi, approval, arguments={**REFUND, "amount": 11000}, reason="partial refund")
    assert response.status_code == 403 and error_code(response) == "correction_refused"
    assert "edit-within-approvers-limit" in response.json()["error"]["message"]
    approval.refresh_from_db()
    assert approval.status == ApprovalStatus.PENDING and approval.arguments == REFUND
    assert Step.objects.get(pk=approval.step_id).arguments == REFUND


def test_a_corrected_call_is_rechecked_approved_and_dispatched_once_with_its_arguments(
    tenant, asha, ravi, bank, tools, limits
):
    run, approval = park(tenant, asha, tools["issue_refund"], REFUND)
    old_digest = approval.digest
    corrected = {**REFUND, "amount": 9000}

    response = correct(ravi, approval, arguments=corrected, reason="only the duplicate part")

    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["status"] == "approved" and body["arguments"] == corrected and body["digest"] != old_digest
    assert drive(run.pk).status == RunStatus.SUCCEEDED
    effects = bank.effects("issue_refund")
    assert len(effects) == 1 and effects[0]["arguments"]["amount"] == 9000
    step = Step.objects.get(pk=approval.step_id)
    assert step.arguments == corrected
    assert step.observation.startswith(
        "[platform] Before this call was sent, approver ravi corrected it (amount: 12499 -> 9000); "
        "reason: only the duplicate part."
    )
    event = RunEvent.objects.get(run=run, kind="approval_corrected")
    assert event.data["proposed"] == REFUND and event.data["corrected"] == corrected
    assert event.actor == ravi
    assert Approval.objects.get(pk=approval.pk).status == ApprovalStatus.CONSUMED


def test_a_correction_must_change_something_and_give_a_reason(tenant, asha, ravi, bank, tools):
    run, approval = park(tenant, asha, tools["issue_refund"], REFUND)
    assert correct(ravi, approval, arguments=REFUND, reason="same").status_code == 400
    assert correct(ravi, approval, arguments={**REFUND, "amount": 1}, reason="").status_code == 400
    bad = correct(ravi, approval, arguments={**REFUND, "amount": "lots"}, reason="typo")
    assert bad.status_code == 400 and "amount" in bad.json()["error"]["message"]
    assert correct(asha, approval, arguments={**REFUND, "amount": 1}, reason="mine").status_code == 403
    assert Approval.objects.get(pk=approval.pk).status == ApprovalStatus.PENDING
