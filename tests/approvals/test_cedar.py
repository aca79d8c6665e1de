"""Cedar policies at dispatch, against real PostgreSQL and the example bank server: forbid wins,
a grant the policy narrows is denied with the policy's id, attribute limits, approval policies,
shadow mode, and the daily total under twenty racing runs."""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from approvals.calls import check_call
from approvals.models import Approval, ShadowDecision, ToolArgumentDayTotal, ToolDayTotal
from approvals.policy_sets import PolicySpec, SourceSet, check, install
from runs.engine import advance
from runs.models import RunEvent, RunStatus, Step, StepStatus
from runs.services import start_run
from tests import factories
from tests.conftest import drive

pytestmark = pytest.mark.django_db(transaction=True)

REFUND = "bank__issue_refund"


def refund_args(amount: int, txn: str = "TXN-1001") -> dict:
    return {"transaction_id": txn, "amount": amount, "currency": "INR", "reason": "duplicate charge"}


@pytest.fixture
def refund(tenant, asha, bank):
    tools = factories.make_bank_tools(tenant, bank.mcp_url)
    refund = tools["issue_refund"]
    refund.approval_policy = "never"
    refund.save(update_fields=["approval_policy"])
    factories.grant(refund, use=[asha])
    return refund


def agent_refunding(tenant, refund, *amounts: int) -> None:
    factories.make_agent(
        tenant,
        tools=[refund],
        turns=[
            *({"tool_calls": [{"name": REFUND, "arguments": refund_args(a)}]} for a in amounts),
            {"text": "done"},
        ],
    )


def policies(tenant, *texts: str, shadow: str = "", **spec_fields) -> None:
    sets = [SourceSet(name=f"set{i}", text=text) for i, text in enumerate(texts)]
    if shadow:
        sets.append(SourceSet(name="trial", text=shadow, mode="shadow"))
    spec = PolicySpec(sets=sets, **spec_fields)
    assert check(tenant, spec) == []
    install(tenant, spec)


CEILING = """
@id("refund-ceiling")
@reason("refunds above INR 50,000 are never made by an agent")
forbid (principal, action == Action::"bank__issue_refund", resource)
when { context.arguments.amount > 50000 };
"""


def test_forbid_beats_permit_and_the_model_is_told_the_policy_not_its_text(tenant, asha, refund, bank):
    permit_all = (
        '@id("refunds-for-support")\npermit (principal, action == Action::"bank__issue_refund", resource);'
    )
    policies(tenant, permit_all, CEILING, default="deny")
    agent_refunding(tenant, refund, 60000)
    run, _ = start_run(user=asha, agent="agent", input={})
    drive(run.pk)
    step = Step.objects.get(run=run, kind="tool")
    assert step.status == StepStatus.DENIED
    assert (
        "denied by policy refund-ceiling: refunds above INR 50,000 are never made by an agent"
        in step.observation
    )
    assert "context.arguments" not in step.observation  # never the policy's text
    assert bank.effects("issue_refund") == []


def test_a_grant_the_policy_narrows_is_denied_at_dispatch_with_the_policy_id(tenant, asha, refund, bank):
    # asha holds use_tool on the refund; the policy allows refunds to supervisors only.
    only_supervisors = """
@id("refunds-by-supervisors")
@reason("only supervisors refund")
forbid (principal, action == Action::"bank__issue_refund", resource)
unless { principal in Group::"supervisors" };
"""
    factories.make_group(tenant, "supervisors")  # a policy may name only groups the tenant has
    policies(tenant, only_supervisors)
    agent_refunding(tenant, refund, 100)
    run, _ = start_run(user=asha, agent="agent", input={})
    drive(run.pk)
    step = Step.objects.get(run=run, kind="tool")
    assert step.status == StepStatus.DENIED
    assert "refunds-by-supervisors" in step.error and "only supervisors refund" in step.error
    assert bank.effects("issue_refund") == []
    assert RunEvent.objects.filter(run=run, kind="tool_denied").exists() or step.status == StepStatus.DENIED


LIMIT = """
@id("refund-within-own-limit")
@reason("refunds above your own refund limit")
forbid (principal, action == Action::"bank__issue_refund", resource)
when { context.arguments.amount > principal.refund_limit };
"""


@pytest.mark.parametrize(("amount", "dispatched"), [(8000, True), (12000, False)])
def test_ashas_refund_limit_holds(tenant, asha, refund, bank, amount, dispatched):
    policies(
        tenant,
        LIMIT,
        user_attribute_types={"refund_limit": {"type": "long", "default": 0}},
        user_attributes={"asha": {"refund_limit": 10000}},
    )
    agent_refunding(tenant, refund, amount)
    run, _ = start_run(user=asha, agent="agent", input={})
    drive(run.pk)
    step = Step.objects.get(run=run, kind="tool")
    assert (step.status == StepStatus.SUCCEEDED) is dispatched
    assert len(bank.effects("issue_refund")) == (1 if dispatched else 0)
    if not dispatched:
        assert "refund-within-own-limit" in step.error


def test_an_approval_policy_parks_the_call_with_its_reason(tenant, asha, refund, bank):
    second_person = """
@id("big-refund-needs-supervisor")
@approval("refunds above INR 5,000 need a supervisor")
permit (principal, action == Action::"bank__issue_refund", resource)
when { context.arguments.amount > 5000 };
"""
    policies(tenant, second_person)
    agent_refunding(tenant, refund, 12499)
    run, _ = start_run(user=asha, agent="agent", input={})
    run = drive(run.pk)
    assert run.status == RunStatus.WAITING_APPROVAL
    approval = Approval.objects.get(run=run)
    assert approval.reason == "refunds above INR 5,000 need a supervisor"
    assert bank.effects("issue_refund") == []


def test_shadow_mode_records_and_does_not_enforce(tenant, asha, refund, bank):
    trial = '@id("no-refunds-trial")\n@reason("trial")\nforbid (principal, action == Action::"bank__issue_refund", resource);'
    policies(tenant, shadow=trial)
    agent_refunding(tenant, refund, 100)
    run, _ = start_run(user=asha, agent="agent", input={})
    run = drive(run.pk)
    assert run.status == RunStatus.SUCCEEDED
    assert len(bank.effects("issue_refund")) == 1
    shadow = ShadowDecision.objects.get(run=run)
    assert (shadow.policy_set, shadow.outcome, shadow.policies) == ("trial", "deny", ["no-refunds-trial"])
    event = RunEvent.objects.get(run=run, kind="policy_shadow")
    assert "no-refunds-trial" in event.message


def test_default_deny_without_a_permit_denies(tenant, asha, refund, bank):
    unrelated = '@id("lookups")\npermit (principal, action == Action::"bank__lookup_transaction", resource);'
    policies(tenant, unrelated, default="deny")
    agent_refunding(tenant, refund, 100)
    run, _ = start_run(user=asha, agent="agent", input={})
    drive(run.pk)
    step = Step.objects.get(run=run, kind="tool")
    assert step.status == StepStatus.DENIED and "default-deny" in step.error


DAILY = """
@id("tenant-daily-refunds")
@reason("the bank refunds at most INR 10,000 a day through agents")
forbid (principal, action == Action::"bank__issue_refund", resource)
when { context.today.amount + context.arguments.amount > 10000 };
"""


def test_the_daily_total_holds_when_twenty_runs_race(tenant, asha, refund, bank):
    policies(tenant, DAILY, tool_attributes={}, totals={REFUND: "amount"})
    agent_refunding(tenant, refund, 3000)
    runs = [start_run(user=asha, agent="agent", input={"n": i})[0] for i in range(20)]
    # Each run's first step (the model's proposal) first, so that the twenty claims of the refund race.
    for run in runs:
        advance(run.pk)
    assert Step.objects.filter(run__in=runs, kind="tool", status=StepStatus.PROPOSED).count() == 20
    barrier = threading.Barrier(20)
    errors = []

    def go(run_id):
        try:
            barrier.wait()
            drive(run_id)
        except Exception as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=go, args=(run.pk,)) for run in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    steps = Step.objects.filter(run__in=runs, kind="tool")
    assert steps.filter(status=StepStatus.SUCCEEDED).count() == 3
    assert steps.filter(status=StepStatus.DENIED).count() == 17
    assert len(bank.effects("issue_refund")) == 3
    total = ToolDayTotal.objects.get(tool=refund, user__isnull=True)
    assert (total.calls, total.amount) == (3, 9000)


def test_a_repeated_claim_counts_a_call_once(tenant, asha, refund, bank):
    policies(tenant, DAILY, totals={REFUND: "amount"})
    agent_refunding(tenant, refund, 3000)
    run, _ = start_run(user=asha, agent="agent", input={})
    drive(run.pk)
    step = Step.objects.get(run=run, kind="tool")
    from django.db import transaction

    from approvals import calls

    with transaction.atomic():
        step.tool = refund
        step.status = StepStatus.APPROVED
        assert check_call(run, step, user=asha) is None
        calls.count_call(step)
    total = ToolDayTotal.objects.get(tool=refund, user__isnull=True)
    assert (total.calls, total.amount) == (1, 3000)


PER_TRANSACTION = """
@id("third-refund-same-transaction-needs-second-person")
@approval("the third refund for the same transaction today needs a second person")
permit (principal, action == Action::"bank__issue_refund", resource)
when { context.today.by_argument.transaction_id.calls >= 2 };

@id("per-transaction-ceiling")
@reason("at most INR 10,000 a day refunded on one transaction")
forbid (principal, action == Action::"bank__issue_refund", resource)
when { context.today.by_argument.transaction_id.amount + context.arguments.amount > 10000 };
"""


def test_per_argument_totals_hold_when_twenty_runs_race(tenant, asha, refund, bank):
    # Twenty runs refund INR 1,000 each, ten on TXN-1001 and ten on TXN-1002: on each transaction the
    # first two go out and the other eight wait for a second person, whatever the interleaving.
    policies(tenant, PER_TRANSACTION, totals={REFUND: "amount"}, totals_by={REFUND: ["transaction_id"]})
    factories.make_agent(
        tenant,
        tools=[refund],
        turns=[
            {"tool_calls": [{"name": REFUND, "arguments": refund_args(1000, "$input.txn")}]},
            {"text": "done"},
        ],
    )
    runs = [start_run(user=asha, agent="agent", input={"txn": f"TXN-100{i % 2 + 1}"})[0] for i in range(20)]
    for run in runs:
        advance(run.pk)
    assert Step.objects.filter(run__in=runs, kind="tool", status=StepStatus.PROPOSED).count() == 20
    barrier = threading.Barrier(20)
    errors = []

    def go(run_id):
        try:
            barrier.wait()
            drive(run_id)
        except Exception as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=go, args=(run.pk,)) for run in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    for txn in ("TXN-1001", "TXN-1002"):
        sent = [e for e in bank.effects("issue_refund") if e["arguments"]["transaction_id"] == txn]
        assert len(sent) == 2
        waiting = [  # found in Python: the arguments are sealed at rest
            a
            for a in Approval.objects.filter(run__in=runs, status="pending")
            if a.arguments.get("transaction_id") == txn
        ]
        assert len(waiting) == 8
        assert {a.reason for a in waiting} == {
            "the third refund for the same transaction today needs a second person"
        }
        total = ToolArgumentDayTotal.objects.get(tool=refund, argument="transaction_id", value=txn)
        assert (total.calls, total.amount) == (2, 2000)
    assert ToolDayTotal.objects.get(tool=refund, user__isnull=True).calls == 4


def test_a_per_argument_forbid_and_the_schema_knows_by_argument(tenant, asha, refund, bank):
    policies(tenant, PER_TRANSACTION, totals={REFUND: "amount"}, totals_by={REFUND: ["transaction_id"]})
    factories.make_agent(
        tenant,
        tools=[refund],
        turns=[
            {"tool_calls": [{"name": REFUND, "arguments": refund_args(4000)}]},
            {"tool_calls": [{"name": REFUND, "arguments": refund_args(7000)}]},
            {"text": "done"},
        ],
    )
    run, _ = start_run(user=asha, agent="agent", input={})
    drive(run.pk)
    first, second = Step.objects.filter(run=run, kind="tool").order_by("seq")
    assert first.status == StepStatus.SUCCEEDED
    assert second.status == StepStatus.DENIED and "per-transaction-ceiling" in second.error
    # Without `by`, the validator refuses a policy that reads by_argument, naming the attribute.
    spec = PolicySpec(sets=[SourceSet(name="s", text=PER_TRANSACTION)], totals={REFUND: "amount"})
    problems = check(tenant, spec)
    assert problems and all("by_argument" in message for _, message in problems)
    # `by` must name an argument of the tool.
    spec = PolicySpec(sets=[], totals_by={REFUND: ["customer_id"]})
    assert check(tenant, spec) == [
        ("policies.tools.bank__issue_refund.by", "'customer_id' is not an argument of bank__issue_refund")
    ]
