"""The start_run and approve_call Cedar actions, against real PostgreSQL: a tenant's policy can
forbid starting a run (the user, the agent version, the run's input and metadata) at the run-start
API with a 403 naming the policy, and forbid an approver approving a call ("supervisors approve
refunds up to INR 25,000"); the file's policy tests can use both actions."""

from __future__ import annotations

import pytest

from approvals.models import ApprovalStatus
from approvals.policy_sets import PolicySpec, PolicyTest, SourceSet, check, install
from runs.models import Run
from tests import factories
from tests.approvals.test_approvals_api import REFUND, approve, client_for, error_code, park

pytestmark = pytest.mark.django_db(transaction=True)

START_RULES = """
@id("no-bulk-runs-from-interns")
@reason("interns may not start bulk runs")
forbid (principal in Group::"interns", action == Action::"start_run", resource)
when { context.input has bulk && context.input.bulk };

@id("dispute-agent-only-from-the-console")
@reason("dispute runs start from the support console")
forbid (principal, action == Action::"start_run", resource == Agent::"agent")
unless { context.metadata has channel && context.metadata.channel == "console" };
"""

APPROVE_RULES = """
@id("supervisors-approve-up-to-25000")
@reason("supervisors approve refunds up to INR 25,000; above that a head of operations does")
forbid (principal, action == Action::"approve_call:bank__issue_refund", resource)
when { context.arguments.amount > 25000 }
unless { principal in Group::"heads-of-operations" };

@id("no-approving-your-own-team-lead")
@reason("a call asked by a supervisor is approved by a head of operations")
forbid (principal, action in Action::"approve_call", resource)
when { context.requester in Group::"supervisors" }
unless { principal in Group::"heads-of-operations" };
"""


def install_rules(tenant, *texts, tests=(), **fields):
    spec = PolicySpec(
        sets=[SourceSet(name=f"s{i}", text=t) for i, t in enumerate(texts)], tests=list(tests), **fields
    )
    problems = check(tenant, spec)
    if not problems:
        install(tenant, spec)
    return problems


RUN_FIELDS = {
    "run_attribute_types": {"input": {"bulk": {"type": "bool"}}, "metadata": {"channel": {"type": "string"}}}
}


def test_a_start_run_policy_answers_403_naming_the_policy_and_starts_nothing(tenant, asha):
    interns = factories.make_group(tenant, "interns")
    asha.groups.add(interns)
    factories.make_agent(tenant, turns=[{"text": "done"}])
    assert install_rules(tenant, START_RULES, default="deny", **RUN_FIELDS) == []
    api = client_for(asha)

    refused = api.post(
        "/v1/runs",
        {"agent": "agent", "input": {"bulk": True}, "metadata": {"channel": "console"}},
        format="json",
    )
    assert refused.status_code == 403 and error_code(refused) == "policy_denied"
    assert refused.json()["error"]["message"] == (
        "you may not start this run: denied by policy no-bulk-runs-from-interns: interns may not start bulk runs"
    )
    elsewhere = api.post(
        "/v1/runs", {"agent": "agent", "input": {}, "metadata": {"channel": "batch"}}, format="json"
    )
    assert (
        elsewhere.status_code == 403
        and "dispute-agent-only-from-the-console" in elsewhere.json()["error"]["message"]
    )
    assert not Run.objects.exists()

    # `default: deny` is about tool calls: a start no policy forbids goes ahead.
    started = api.post(
        "/v1/runs", {"agent": "agent", "input": {}, "metadata": {"channel": "console"}}, format="json"
    )
    assert started.status_code == 201, started.json()
    assert Run.objects.count() == 1


@pytest.fixture
def refund(tenant, asha, ravi, bank):
    tools = factories.make_bank_tools(tenant, bank.mcp_url)
    heads = factories.make_user(tenant, "meera", staff=True)
    factories.grant(tools["issue_refund"], use=[asha, ravi], approve=[ravi, heads])
    supervisors = factories.make_group(tenant, "supervisors")
    ravi.groups.add(supervisors)
    heads.groups.add(factories.make_group(tenant, "heads-of-operations"))
    return tools["issue_refund"]


def test_supervisors_approve_refunds_up_to_25000(tenant, asha, ravi, bank, refund):
    assert install_rules(tenant, APPROVE_RULES) == []
    big = {**REFUND, "transaction_id": "TXN-1001", "amount": 30000}
    _, approval = park(tenant, asha, refund, big)

    refused = approve(ravi, approval, reason="fine")
    assert refused.status_code == 403 and error_code(refused) == "approval_refused"
    assert "supervisors-approve-up-to-25000" in refused.json()["error"]["message"]
    approval.refresh_from_db()
    assert approval.status == ApprovalStatus.PENDING

    # Denying is never refused by an approve_call policy; a head of operations may approve.
    meera = type(ravi).objects.get(username="meera")
    assert approve(meera, approval, reason="checked with the customer").status_code == 200
    approval.refresh_from_db()
    assert approval.status == ApprovalStatus.APPROVED and approval.decided_by == meera

    _, small = park(tenant, asha, refund, REFUND)
    assert approve(ravi, small, reason="ok").status_code == 200


def test_the_requester_is_in_the_approval_context(tenant, asha, ravi, bank, refund):
    assert install_rules(tenant, APPROVE_RULES) == []
    meera = type(ravi).objects.get(username="meera")
    _, asked_by_supervisor = park(tenant, ravi, refund, REFUND)
    assert approve(meera, asked_by_supervisor, reason="ok").status_code == 200  # a head of operations may
    _, again = park(tenant, ravi, refund, REFUND)
    assert approve(ravi, again, reason="mine").status_code == 403  # self-approval, before Cedar
    factories.grant(refund, approve=[asha])
    refused = approve(asha, again, reason="ok")  # asha is no head of operations
    assert (
        refused.status_code == 403 and "no-approving-your-own-team-lead" in refused.json()["error"]["message"]
    )


def test_policy_tests_use_both_actions_and_the_validator_knows_them(tenant, asha, ravi, bank, refund):
    interns = factories.make_group(tenant, "interns")
    asha.groups.add(interns)
    factories.make_agent(tenant, turns=[{"text": "done"}])  # the rules name Agent::"agent"
    tests = [
        PolicyTest(
            name="bulk by an intern",
            principal="asha",
            tool="",
            action="start_run",
            expect="deny",
            input={"bulk": True},
            metadata={"channel": "console"},
            policy="no-bulk-runs-from-interns",
        ),
        PolicyTest(
            name="console start",
            principal="asha",
            tool="",
            action="start_run",
            expect="allow",
            metadata={"channel": "console"},
        ),
        PolicyTest(
            name="big refund by a supervisor",
            principal="ravi",
            tool="bank__issue_refund",
            action="approve_call",
            requester="asha",
            arguments={**REFUND, "amount": 30000},
            expect="deny",
            policy="supervisors-approve-up-to-25000",
        ),
        PolicyTest(
            name="small refund by a supervisor",
            principal="ravi",
            tool="bank__issue_refund",
            action="approve_call",
            requester="asha",
            arguments=REFUND,
            expect="allow",
        ),
    ]
    assert install_rules(tenant, START_RULES, APPROVE_RULES, tests=tests, **RUN_FIELDS) == []
    wrong = [
        PolicyTest(
            name="wrong",
            principal="ravi",
            tool="bank__issue_refund",
            action="approve_call",
            requester="asha",
            arguments={**REFUND, "amount": 30000},
            expect="allow",
        )
    ]
    assert install_rules(tenant, APPROVE_RULES, tests=wrong) == [
        ("", "test wrong: expected allow, got deny by supervisors-approve-up-to-25000")
    ]
    # The validator types each action's context: arguments on start_run, undeclared input fields.
    problems = install_rules(
        tenant,
        '@id("x")\nforbid (principal, action == Action::"start_run", resource) when { context.arguments.amount > 1 };',
    )
    assert problems and "arguments" in problems[0][1]
    problems = install_rules(
        tenant,
        '@id("y")\nforbid (principal, action == Action::"start_run", resource) when { context.input.priority == "high" };',
        **RUN_FIELDS,
    )
    assert problems and "priority" in problems[0][1]
    problems = install_rules(
        tenant,
        '@id("z")\nforbid (principal, action == Action::"approve_call:bank__issue_refund", resource) '
        "when { context.arguments.amont > 1 };",
    )
    assert problems and "amont" in problems[0][1]
