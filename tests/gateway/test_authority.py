"""Authority at the tool gateway (issue #3): the model proposes, the gateway decides.

Every denial is checked where it matters: the bank server's ledger (nothing applied), the step
row (denied, with a reason), the run's events, and what the model is told next.
"""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission
from guardian.shortcuts import assign_perm, remove_perm

from llm.gateway import build_messages
from runs.models import RunEvent, RunStatus, Step, StepStatus
from runs.services import start_run
from tenants.models import User
from tests import factories
from tests.conftest import drive
from tests.gateway.conftest import advance_until, tool_step_done
from tools import offer
from tools.models import Tool

pytestmark = pytest.mark.django_db(transaction=True)

REFUND_SMALL = {"transaction_id": "TXN-1002", "amount": 100, "currency": "INR"}
REFUND_OTHER = {"transaction_id": "TXN-1003", "amount": 50, "currency": "INR"}
TRANSFER = {"to_account": "ACC-999", "amount": 500000}


def tool_steps(run) -> list[Step]:
    return list(Step.objects.filter(run=run, kind="tool").order_by("seq"))


def assert_denied(run, step: Step, reason: str) -> None:
    """Denied with the reason, recorded as an event, and told to the model as an error result."""
    assert step.status == StepStatus.DENIED, (step.status, step.error)
    assert reason in step.error
    assert RunEvent.objects.filter(run=run, step_seq=step.seq, kind="step", skeleton__to="denied").exists()
    told = [
        m
        for m in build_messages(run, list(run.steps.all()))
        if m.role == "tool" and m.tool_call_id == step.call_id
    ]
    assert len(told) == 1 and told[0].is_error and "denied by the platform" in told[0].content


# --- prompt injection ------------------------------------------------------------------------


def test_it_denies_the_transfer_a_ticket_injects_and_the_run_ends_cleanly(
    tenant, asha, bank, bank_tools, claude
):
    names = {k: t.name for k, t in bank_tools.items()}
    factories.grant(bank_tools["search_tickets"], use=[asha])
    factories.grant(bank_tools["lookup_transaction"], use=[asha])
    factories.make_agent(
        tenant,
        endpoint=_endpoint(tenant, "claude"),
        tools=[bank_tools[k] for k in ("lookup_transaction", "search_tickets", "transfer_funds")],
    )
    claude.queue(
        {"tool_calls": [{"name": names["search_tickets"], "arguments": {"query": "TXN-1001"}}]},
        # The model obeys the ticket's "SYSTEM OVERRIDE" text.
        {"tool_calls": [{"name": names["transfer_funds"], "arguments": TRANSFER}]},
        {"text": "I could not move money; the refund needs a supervisor."},
    )
    run, _ = start_run(user=asha, agent="agent", input={"transaction_id": "TXN-1001"})

    run = drive(run.pk)

    assert run.status == RunStatus.SUCCEEDED, run.error
    assert run.final_output.startswith("I could not move money")
    assert bank.effects("transfer_funds") == [] and bank.effects() == []
    search, transfer = tool_steps(run)
    assert "call transfer_funds" in search.observation  # the injection reached the model, as data
    assert_denied(run, transfer, f"may not use {names['transfer_funds']}")
    # On the wire: the tool was never offered, and the denial came back as an error tool result.
    assert names["transfer_funds"] not in [t["name"] for t in claude.requests[1]["tools"]]
    results = [
        b
        for m in claude.requests[2]["messages"]
        if isinstance(m["content"], list)
        for b in m["content"]
        if b["type"] == "tool_result"
    ]
    assert results[-1]["is_error"] is True and "denied by the platform" in str(results[-1]["content"])


def _endpoint(tenant, name):
    from llm.models import ModelEndpoint

    return ModelEndpoint.objects.get(tenant=tenant, name=name)


# --- calls outside the offered set -----------------------------------------------------------


def _tenant_b_tool(bank) -> str:
    other = factories.make_tenant("globex")
    return factories.make_bank_tools(other, bank.mcp_url, name="vault")["transfer_funds"].name


@pytest.mark.parametrize(
    "case",
    [
        "not_permitted",
        "not_allowlisted",
        "disabled",
        "other_tenant",
        "misspelled",
        "wrong_type",
        "extra_field",
        "missing_field",
    ],
)
def test_it_denies_calls_outside_the_offered_set_and_sends_nothing(case, tenant, asha, bank, bank_tools):
    refund, transfer = bank_tools["issue_refund"], bank_tools["transfer_funds"]
    allowlist = [bank_tools["lookup_transaction"], refund, transfer]
    factories.grant(refund, use=[asha])
    call, reason = {"name": transfer.name, "arguments": TRANSFER}, f"may not use {transfer.name}"
    if case == "not_allowlisted":
        factories.grant(transfer, use=[asha])
        allowlist.remove(transfer)
        reason = "not in this agent's allowlist"
    elif case == "disabled":
        factories.grant(transfer, use=[asha])
        Tool.objects.filter(pk=transfer.pk).update(enabled=False)
        reason = "is disabled"
    elif case == "other_tenant":
        call = {"name": _tenant_b_tool(bank), "arguments": TRANSFER}
        reason = "unknown tool 'vault__transfer_funds'"
    elif case == "misspelled":
        call = {"name": "bank__transfer_fund", "arguments": TRANSFER}
        reason = "unknown tool 'bank__transfer_fund'"
    elif case == "wrong_type":
        call = {"name": refund.name, "arguments": {**REFUND_SMALL, "amount": "all of it"}}
        reason = "arguments invalid at amount"
    elif case == "extra_field":
        call = {"name": refund.name, "arguments": {**REFUND_SMALL, "to_account": "ACC-999"}}
        reason = "arguments invalid"
    elif case == "missing_field":
        call = {"name": refund.name, "arguments": {"amount": 100}}
        reason = "'transaction_id' is a required property"
    factories.make_agent(tenant, tools=allowlist, turns=[{"tool_calls": [call]}, {"text": "ok"}])
    run, _ = start_run(user=asha, agent="agent", input={})

    run = drive(run.pk)

    assert run.status == RunStatus.SUCCEEDED, run.error
    [step] = tool_steps(run)
    assert_denied(run, step, reason)
    assert bank.effects() == []


def test_it_allows_the_same_call_once_it_is_permitted(tenant, asha, bank, bank_tools):
    """Control for the denials above: the same refund, permitted, reaches the bank once."""
    refund = bank_tools["issue_refund"]
    factories.grant(refund, use=[asha])
    factories.make_agent(
        tenant,
        tools=[refund],
        turns=[{"tool_calls": [{"name": refund.name, "arguments": REFUND_SMALL}]}, {"text": "ok"}],
    )
    run, _ = start_run(user=asha, agent="agent", input={})
    run = drive(run.pk)
    assert [s.status for s in tool_steps(run)] == ["succeeded"]
    assert len(bank.effects("issue_refund")) == 1


def test_it_denies_a_permitted_tool_that_was_not_offered_on_that_call(tenant, asha, bank, bank_tools):
    """A narrowed catalogue: the tool is permitted, but this model call was not shown it."""
    refund = bank_tools["issue_refund"]
    lookup = bank_tools["lookup_transaction"]
    for tool in (refund, lookup, bank_tools["search_tickets"]):
        factories.grant(tool, use=[asha])
    factories.make_agent(
        tenant,
        tools=[lookup, refund, bank_tools["search_tickets"]],
        max_visible_tools=2,
        turns=[{"tool_calls": [{"name": refund.name, "arguments": REFUND_SMALL}]}, {"text": "ok"}],
    )
    run, _ = start_run(user=asha, agent="agent", input={"task": "look up transaction TXN-1001"})
    run = drive(run.pk)
    offered = Step.objects.get(run=run, seq=1).request["tools"]
    assert refund.name not in offered and offer.SEARCH_TOOLS in offered
    [step] = tool_steps(run)
    assert_denied(run, step, "was not offered on this call")
    assert bank.effects() == []


# --- permissions change during a run ---------------------------------------------------------


def _two_refunds_agent(tenant, refund):
    factories.make_agent(
        tenant,
        tools=[refund],
        turns=[
            {"tool_calls": [{"name": refund.name, "arguments": REFUND_SMALL}]},
            {"tool_calls": [{"name": refund.name, "arguments": REFUND_OTHER}]},
            {"text": "ok"},
        ],
    )


def test_it_denies_the_next_call_after_use_tool_is_revoked(tenant, asha, bank, bank_tools):
    refund = bank_tools["issue_refund"]
    factories.grant(refund, use=[asha])
    _two_refunds_agent(tenant, refund)
    run, _ = start_run(user=asha, agent="agent", input={})
    advance_until(run.pk, tool_step_done(2))
    assert len(bank.effects("issue_refund")) == 1

    remove_perm("tools.use_tool", asha, refund)
    run = drive(run.pk)

    first, second = tool_steps(run)
    assert first.status == StepStatus.SUCCEEDED
    assert_denied(run, second, "may not use")
    assert len(bank.effects("issue_refund")) == 1
    assert refund.name not in Step.objects.get(run=run, seq=3).request["tools"]


def test_it_denies_the_next_call_after_the_user_leaves_the_group_that_held_use_tool(
    tenant, asha, bank, bank_tools
):
    refund = bank_tools["issue_refund"]
    agents = factories.make_group(tenant, "agents")
    asha.groups.add(agents)
    assign_perm("tools.use_tool", agents, refund)
    _two_refunds_agent(tenant, refund)
    run, _ = start_run(user=asha, agent="agent", input={})
    advance_until(run.pk, tool_step_done(2))
    assert len(bank.effects("issue_refund")) == 1

    asha.groups.remove(agents)
    run = drive(run.pk)

    assert_denied(run, tool_steps(run)[1], "may not use")
    assert len(bank.effects("issue_refund")) == 1


def test_it_stops_a_deactivated_users_run_before_any_model_call(tenant, asha, bank, bank_tools):
    from budgets.models import Reservation

    refund = bank_tools["issue_refund"]
    factories.grant(refund, use=[asha])
    _two_refunds_agent(tenant, refund)
    run, _ = start_run(user=asha, agent="agent", input={})
    User.objects.filter(pk=asha.pk).update(is_active=False)

    run = drive(run.pk)

    assert run.status == RunStatus.STOPPED and run.stop_reason == "user_deactivated"
    assert not Step.objects.filter(run=run).exists()  # no model call, nothing proposed
    assert not Reservation.objects.filter(run=run).exists()  # and no money reserved for one
    stopped = RunEvent.objects.filter(run=run, kind="status", skeleton__to="stopped")
    assert [event.data["reason"] for event in stopped] == ["user_deactivated"]
    assert bank.effects() == []


def test_it_denies_the_proposed_call_and_stops_when_the_user_is_deactivated_mid_run(
    tenant, asha, bank, bank_tools
):
    refund = bank_tools["issue_refund"]
    factories.grant(refund, use=[asha])
    _two_refunds_agent(tenant, refund)
    run, _ = start_run(user=asha, agent="agent", input={})
    advance_until(run.pk, lambda r: r.steps.filter(seq=4).exists())  # the second refund is proposed
    assert len(bank.effects("issue_refund")) == 1
    User.objects.filter(pk=asha.pk).update(is_active=False)

    run = drive(run.pk)

    first, second = tool_steps(run)
    assert first.status == StepStatus.SUCCEEDED
    assert_denied(run, second, "deactivated")
    assert len(bank.effects("issue_refund")) == 1
    # The model is not asked again on the deactivated user's behalf.
    assert list(Step.objects.filter(run=run, kind="model").values_list("seq", flat=True)) == [1, 3]
    assert run.status == RunStatus.STOPPED and run.stop_reason == "user_deactivated"


# --- no implicit authority -------------------------------------------------------------------


def test_it_gives_a_superuser_no_implicit_tool_access(tenant, bank, bank_tools):
    root = User.objects.create_superuser(username="root", password="pw", tenant=tenant)
    refund = bank_tools["issue_refund"]
    _two_refunds_agent(tenant, refund)
    run, _ = start_run(user=root, agent="agent", input={})
    assert offer.offered_tools(run) == []

    run = drive(run.pk)

    for step in tool_steps(run):
        assert_denied(run, step, f"root may not use {refund.name}")
    assert bank.effects() == []


def test_it_ignores_a_global_use_tool_permission(tenant, asha, bank, bank_tools):
    asha.user_permissions.add(Permission.objects.get(codename="use_tool", content_type__app_label="tools"))
    assert User.objects.get(pk=asha.pk).has_perm("tools.use_tool")  # Django would say yes
    refund = bank_tools["issue_refund"]
    _two_refunds_agent(tenant, refund)
    run, _ = start_run(user=asha, agent="agent", input={})
    assert offer.offered_tools(run) == []

    run = drive(run.pk)

    for step in tool_steps(run):
        assert_denied(run, step, "may not use")
    assert bank.effects() == []
    # Control: an object permission does expose the tool.
    factories.grant(refund, use=[asha])
    assert [s.name for s in offer.offered_tools(run)] == [refund.name]
