"""Dual control and traceability (issue 39, parts 2 and 3), against real PostgreSQL and a local bank:
an @approval policy with @approvers("2") needs two distinct people, never the requester, and the
first approval alone never dispatches; an approver above their limit escalates the approval; every
dispatch decision, approval request and denial names the deciding Cedar policies and the version
of the tenant's policies; a corrected approval keeps the model's arguments beside the corrected."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection

from approvals.models import ApprovalStatus, ApprovalVote, ReminderRule, TenantPolicies
from runs.models import RunEvent, RunStatus, Step, StepStatus
from runs.services import start_run
from tenants.models import User
from tests import factories
from tests.approvals.test_approvals_api import REFUND, approve, client_for, error_code, park
from tests.approvals.test_cedar_actions import install_rules
from tests.conftest import drive
from tools.models import Tool

pytestmark = pytest.mark.django_db(transaction=True)

RULES = """
@id("refund-ceiling")
@reason("refunds above INR 2,00,000 are never made by an agent")
forbid (principal, action == Action::"bank__issue_refund", resource)
when { context.arguments.amount > 200000 };

@id("refunds-allowed")
permit (principal, action == Action::"bank__issue_refund", resource);

@id("refund-needs-supervisor")
@approval("refunds above INR 5,000 wait for a supervisor")
permit (principal, action == Action::"bank__issue_refund", resource)
when { context.arguments.amount > 5000 };

@id("large-refund-needs-two")
@approval("refunds above INR 10,000 need two supervisors")
@approvers("2")
permit (principal, action == Action::"bank__issue_refund", resource)
when { context.arguments.amount > 10000 };

@id("supervisors-approve-up-to-150000")
@reason("supervisors approve refunds up to INR 1,50,000")
forbid (principal in Group::"supervisors", action == Action::"approve_call:bank__issue_refund", resource)
when { context.arguments.amount > 150000 };
"""

# The example bank refunds at most the transaction's amount (TXN-1001: INR 12,499).
LARGE = {**REFUND, "amount": 12000}
SMALL = {**REFUND, "amount": 9000}


@pytest.fixture
def refund(tenant, asha, ravi, bank):
    """asha asks; ravi, meera and kiran approve (ravi and meera are supervisors)."""
    tool = factories.make_bank_tools(tenant, bank.mcp_url)["issue_refund"]
    meera = factories.make_user(tenant, "meera", staff=True)
    kiran = factories.make_user(tenant, "kiran", staff=True)
    factories.grant(tool, use=[asha, ravi], approve=[ravi, meera, kiran])
    supervisors = factories.make_group(tenant, "supervisors")
    ravi.groups.add(supervisors)
    meera.groups.add(supervisors)
    assert install_rules(tenant, RULES, default="deny") == []
    # Only the tenant's Cedar policies ask for approval here: the tool's own rule is `never`.
    Tool.objects.filter(pk=tool.pk).update(approval_policy="never")
    tool.refresh_from_db()
    return tool


def user(name):
    return User.objects.get(username=name)


def refunds(bank) -> int:
    return len(bank.effects("issue_refund"))


def test_two_approvers_the_first_alone_never_dispatches_and_the_second_dispatches_once(
    tenant, asha, ravi, bank, refund
):
    run, approval = park(tenant, asha, refund, LARGE)
    assert approval.required_approvals == 2
    assert approval.policy_ids == ["refund-needs-supervisor", "large-refund-needs-two"]

    # The requester is never one of the approvers, however many are needed.
    assert approve(asha, approval, reason="mine").status_code == 403

    first = approve(ravi, approval, reason="checked the ledger")
    assert first.status_code == 200, first.json()
    body = first.json()
    assert body["status"] == "pending" and body["required_approvals"] == 2
    assert [a["user"] for a in body["approvals"]] == ["ravi"]
    assert drive(run.pk).status == RunStatus.WAITING_APPROVAL
    assert Step.objects.get(pk=approval.step_id).status == StepStatus.AWAITING_APPROVAL
    assert refunds(bank) == 0
    given = RunEvent.objects.get(run=run, kind="approval_given")
    assert given.message.endswith("1 of 2 approvals (checked the ledger)")

    # The same person approving again is a repeat, not a second approval.
    again = approve(ravi, approval, reason="again")
    assert again.status_code == 200 and again.json()["repeated"] is True
    assert "1 of 2 approvals given (ravi)" in again.json()["detail"]
    assert ApprovalVote.objects.filter(approval=approval).count() == 1
    assert drive(run.pk).status == RunStatus.WAITING_APPROVAL and refunds(bank) == 0

    second = approve(user("meera"), approval, reason="agreed")
    assert second.status_code == 200 and second.json()["status"] == "approved"
    assert [a["user"] for a in second.json()["approvals"]] == ["ravi", "meera"]
    run = drive(run.pk)
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert refunds(bank) == 1
    approval.refresh_from_db()
    assert approval.status == ApprovalStatus.CONSUMED and approval.decided_by.username == "meera"
    # A third approver after the fact changes nothing.
    late = approve(user("kiran"), approval, reason="late")
    assert late.status_code == 409 and error_code(late) == "approval_consumed"
    assert refunds(bank) == 1


def test_one_denial_denies_a_call_that_needs_two(tenant, asha, ravi, bank, refund):
    run, approval = park(tenant, asha, refund, LARGE)
    assert approve(ravi, approval, reason="fine").json()["status"] == "pending"
    denied = approve(user("meera"), approval, "deny", reason="the customer already got it back")
    assert denied.status_code == 200 and denied.json()["status"] == "denied"
    drive(run.pk)
    assert refunds(bank) == 0
    assert Step.objects.get(pk=approval.step_id).status == StepStatus.REJECTED


def test_an_approver_above_their_limit_escalates_the_approval_at_once(tenant, asha, ravi, bank, refund):
    heads = factories.make_group(tenant, "heads-of-operations")
    user("kiran").groups.add(heads)
    ReminderRule.objects.create(tenant=tenant, escalate_after_seconds=3600, escalate_to=heads.tenant_link)
    run, approval = park(tenant, asha, refund, {**REFUND, "amount": 160000})
    assert approval.escalated_at is None

    refused = approve(ravi, approval, reason="ok")
    assert refused.status_code == 403 and error_code(refused) == "approval_refused"
    message = refused.json()["error"]["message"]
    assert "supervisors-approve-up-to-150000" in message and message.endswith(
        "escalated to heads-of-operations"
    )
    approval.refresh_from_db()
    assert approval.status == ApprovalStatus.PENDING and approval.escalated_at is not None
    event = RunEvent.objects.get(run=run, kind="approval_escalated")
    assert event.data["above_limit_of"] == "ravi" and event.data["members"] == ["kiran"]
    assert ApprovalVote.objects.filter(approval=approval).count() == 0  # the refusal counted nothing


def test_a_correction_above_the_approvers_limit_escalates_the_approval_at_once(
    tenant, asha, ravi, bank, refund
):
    heads = factories.make_group(tenant, "heads-of-operations")
    user("kiran").groups.add(heads)
    ReminderRule.objects.create(tenant=tenant, escalate_after_seconds=3600, escalate_to=heads.tenant_link)
    run, approval = park(tenant, asha, refund, {**REFUND, "amount": 120000})
    refused = client_for(ravi).post(
        f"/v1/approvals/{approval.pk}/correct",
        {"arguments": {**REFUND, "amount": 160000}, "reason": "the fee too"},
        format="json",
    )
    assert refused.status_code == 403 and error_code(refused) == "approval_refused"
    assert refused.json()["error"]["message"].endswith("escalated to heads-of-operations")
    approval.refresh_from_db()
    assert approval.status == ApprovalStatus.PENDING and approval.escalated_at is not None
    assert approval.arguments["amount"] == 120000  # the refused correction changed nothing
    event = RunEvent.objects.get(run=run, kind="approval_escalated")
    assert "a correction above the limit of ravi" in event.message
    assert refunds(bank) == 0


def test_every_decision_names_its_policies_and_the_policy_version(tenant, asha, ravi, bank, refund):
    version = TenantPolicies.objects.get(tenant=tenant).version
    # Allowed without approval: the dispatch event names the permit that allowed it.
    small_run, _ = park_or_finish(tenant, asha, refund, {**REFUND, "amount": 900})
    dispatched = RunEvent.objects.get(
        run=small_run, kind="step", skeleton__to="dispatching", skeleton__step_kind="tool"
    )
    assert dispatched.data["policies"] == ["refunds-allowed"]
    assert dispatched.data["policy_version"] == version

    # Denied: the denial event names the forbid.
    big_run, _ = park_or_finish(tenant, asha, refund, {**REFUND, "amount": 250000})
    denied = RunEvent.objects.get(run=big_run, kind="step", skeleton__to="denied")
    assert denied.data["policies"] == ["refund-ceiling"] and denied.data["policy_version"] == version

    # Approval asked: the approval and its event name the @approval policy, its text and version.
    run, approval = park(tenant, asha, refund, SMALL)
    assert approval.policy_ids == ["refund-needs-supervisor"] and approval.policy_set_version == version
    assert approval.policy_texts[0].startswith('@id("refund-needs-supervisor")')
    assert "context.arguments.amount > 5000" in approval.policy_texts[0]
    requested = RunEvent.objects.get(run=run, kind="approval_requested")
    assert requested.data["policies"] == ["refund-needs-supervisor"]
    assert requested.data["policy_version"] == version
    shown = client_for(ravi).get(f"/v1/approvals/{approval.pk}").json()
    assert shown["policies"] == ["refund-needs-supervisor"] and shown["policy_set_version"] == version


def test_a_corrected_approval_keeps_the_proposed_and_the_corrected_arguments(
    tenant, asha, ravi, bank, refund
):
    run, approval = park(tenant, asha, refund, SMALL)
    corrected = {**REFUND, "amount": 899}
    answer = client_for(ravi).post(
        f"/v1/approvals/{approval.pk}/correct",
        {"arguments": corrected, "reason": "the payment was INR 899"},
        format="json",
    )
    assert answer.status_code == 200, answer.json()
    shown = client_for(ravi).get(f"/v1/approvals/{approval.pk}").json()
    assert shown["original_arguments"] == SMALL and shown["arguments"] == corrected
    assert shown["corrected_by"] == "ravi" and shown["correction_reason"] == "the payment was INR 899"
    drive(run.pk)
    assert [e["arguments"]["amount"] for e in bank.effects("issue_refund")] == [899]


def test_a_correction_of_a_call_that_needs_two_waits_for_a_second_approver(tenant, asha, ravi, bank, refund):
    run, approval = park(tenant, asha, refund, LARGE)
    approve(user("meera"), approval, reason="fine")  # approved the call as proposed
    corrected = {**LARGE, "amount": 11000}
    answer = client_for(ravi).post(
        f"/v1/approvals/{approval.pk}/correct", {"arguments": corrected, "reason": "fee"}, format="json"
    )
    assert answer.status_code == 200 and answer.json()["status"] == "pending"
    # meera's approval was of another call: it does not count towards the corrected one.
    assert [a["user"] for a in answer.json()["approvals"]] == ["ravi"]
    assert drive(run.pk).status == RunStatus.WAITING_APPROVAL and refunds(bank) == 0
    assert approve(user("meera"), approval, reason="fine too").json()["status"] == "approved"
    drive(run.pk)
    assert [e["arguments"]["amount"] for e in bank.effects("issue_refund")] == [11000]


def park_or_finish(tenant, asha, tool, arguments):
    """A run of one call that is not parked (allowed or denied), driven to its end."""
    name = f"agent-{uuid.uuid4().hex[:8]}"
    endpoint = factories.make_endpoint(
        tenant,
        name=name,
        config={"turns": [{"tool_calls": [{"name": tool.name, "arguments": arguments}]}, {"text": "done"}]},
    )
    factories.make_agent(tenant, name=name, endpoint=endpoint, tools=[tool])
    run, _ = start_run(user=asha, agent=name, input={})
    return drive(run.pk), None


def test_two_approvers_at_the_same_moment_approve_once_and_dispatch_once(tenant, asha, ravi, bank, refund):
    run, approval = park(tenant, asha, refund, LARGE)
    barrier = threading.Barrier(2)

    def decide(person):
        try:
            barrier.wait()
            return approve(person, approval, reason="checked")
        finally:
            connection.close()

    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(decide, [ravi, user("meera")]))

    assert sorted(a.json()["status"] for a in answers) == ["approved", "pending"]
    assert ApprovalVote.objects.filter(approval=approval).count() == 2
    assert drive(run.pk).status == RunStatus.SUCCEEDED
    assert refunds(bank) == 1
