"""A worker SIGKILLed in the middle of a tool call: recovery follows the effect class (DESIGN.md 5).

The sweeper notices the expired lease, another worker claims the run and finds the step still
`dispatching`; what happens next depends only on the tool's configured effect class.
"""

from __future__ import annotations

import time

import pytest

from budgets.models import Reservation
from runs.models import Run
from runs.services import start_run
from tests import factories
from tests.recovery.conftest import (
    EMAIL,
    FAST_LEASES,
    REFUND,
    client_for,
    events,
    http_bank_tool,
    run_of,
    single_call_agent,
    step_of,
    until_dispatching,
    until_fault_taken,
    until_status,
)
from tests.servers import wait_for
from tools.models import Tool

pytestmark = pytest.mark.django_db(transaction=True)


def _bank_tool(tenant, bank, remote: str, *, transport: str = "mcp", **fields) -> Tool:
    if transport == "http":
        return http_bank_tool(tenant, bank, remote, **fields)
    tool = factories.make_bank_tools(tenant, bank.mcp_url)[remote]
    Tool.objects.filter(pk=tool.pk).update(timeout_seconds=5, **fields)
    tool.refresh_from_db()
    return tool


def _kill_once_applied(bank, worker, remote: str) -> dict:
    effect = wait_for(lambda: bank.effects(remote), timeout=30, interval=0.05, what=f"{remote} applied")[0]
    worker.kill()
    return effect


def _no_open_reservations(run_id) -> None:
    assert not Reservation.objects.filter(run_id=run_id, status=Reservation.Status.OPEN).exists()


def test_it_never_repeats_an_unsafe_call_whose_worker_died_and_waits_for_a_person(
    tenant, asha, supervisor, bank, workers
):
    email = _bank_tool(tenant, bank, "send_customer_email", effect_class="unsafe")
    factories.grant(email, approve=[supervisor])
    single_call_agent(tenant, asha, email, EMAIL, final="emailed")
    bank.fault(tool="send_customer_email", delay_after_effect=30)  # sent, but the answer never comes
    w1 = workers("w1", env=FAST_LEASES)
    run, _ = start_run(user=asha, agent="agent", input={})
    effect = _kill_once_applied(bank, w1, "send_customer_email")
    workers("w2", env=FAST_LEASES)

    run = until_status(run.pk, "needs_attention", timeout=40)
    step = step_of(run.pk, 2)
    assert (step.status, step.attempts, step.crashes) == ("outcome_unknown", 1, 1)
    swept = [e for e in events(run.pk, "recovery") if e.data.get("found") == "expired_lease"]
    assert swept and swept[0].data["action"] == "requeue"
    assert any("never retried automatically" in e.message for e in events(run.pk, "step"))
    time.sleep(2)  # a window for a wrong retry to show, not a synchronisation
    assert len(bank.effects("send_customer_email")) == 1
    assert run_of(run.pk).status == "needs_attention"

    answer = client_for(supervisor).post(
        f"/v1/runs/{run.pk}/steps/2/resolve",
        {
            "outcome": "succeeded",
            "reason": f"{effect['result']['message_id']} is in the mail log",
            "result": effect["result"],
        },
        format="json",
    )
    assert answer.status_code == 200, answer.content
    assert answer.json()["status"] == "resolved_succeeded"
    run = wait_for(lambda: (r := run_of(run.pk)).is_terminal and r, timeout=30, what="run end")
    assert run.status == "succeeded", run.error
    assert run.final_output == "emailed"
    assert len(bank.effects("send_customer_email")) == 1
    resolved = events(run.pk, "resolved")
    assert len(resolved) == 1 and resolved[0].actor == supervisor
    _no_open_reservations(run.pk)


def test_it_retries_an_idempotent_call_with_the_same_key_after_its_worker_died(tenant, asha, bank, workers):
    refund = _bank_tool(tenant, bank, "issue_refund", effect_class="idempotent")
    single_call_agent(tenant, asha, refund, REFUND, final="refunded")
    bank.fault(tool="issue_refund", delay_after_effect=30)
    w1 = workers("w1", env=FAST_LEASES)
    run, _ = start_run(user=asha, agent="agent", input={})
    effect = _kill_once_applied(bank, w1, "issue_refund")
    workers("w2", env=FAST_LEASES)

    run = until_status(run.pk, "succeeded", "failed", "needs_attention", timeout=40)
    assert run.status == "succeeded", run.error
    step = step_of(run.pk, 2)
    assert (step.status, step.attempts, step.crashes) == ("succeeded", 2, 1)
    effects = bank.effects("issue_refund")
    assert len(effects) == 1
    assert effects[0]["idempotency_key"] == step.idempotency_key
    assert step.result["structured"]["refund_id"] == effect["result"]["refund_id"]
    assert any(e.data.get("action") == "retry with the same key" for e in events(run.pk, "recovery"))
    _no_open_reservations(run.pk)


@pytest.mark.parametrize("transport", ["mcp", "http"])
def test_it_asks_a_reconcilable_provider_and_does_not_retry_what_happened(
    transport, tenant, asha, bank, workers
):
    refund = _bank_tool(
        tenant,
        bank,
        "issue_refund",
        transport=transport,
        effect_class="reconcilable",
        **({"status": True} if transport == "http" else {}),
    )
    single_call_agent(tenant, asha, refund, REFUND, final="refunded")
    bank.fault(tool="issue_refund", delay_after_effect=30)
    w1 = workers("w1", env=FAST_LEASES)
    run, _ = start_run(user=asha, agent="agent", input={})
    effect = _kill_once_applied(bank, w1, "issue_refund")
    workers("w2", env=FAST_LEASES)

    run = until_status(run.pk, "succeeded", "failed", "needs_attention", timeout=40)
    assert run.status == "succeeded", run.error
    step = step_of(run.pk, 2)
    assert (step.status, step.attempts) == ("succeeded", 1)  # found by the lookup: never sent again
    assert step.result["structured"]["refund_id"] == effect["result"]["refund_id"]
    assert len(bank.effects("issue_refund")) == 1
    lookups = [e for e in events(run.pk, "recovery") if "status lookup" in e.message]
    assert [e.data["found"] for e in lookups] == [True]
    _no_open_reservations(run.pk)


@pytest.mark.parametrize("transport", ["mcp", "http"])
def test_it_retries_a_reconcilable_call_exactly_once_when_the_provider_has_no_record(
    transport, tenant, asha, bank, workers
):
    refund = _bank_tool(
        tenant,
        bank,
        "issue_refund",
        transport=transport,
        effect_class="reconcilable",
        **({"status": True} if transport == "http" else {}),
    )
    single_call_agent(tenant, asha, refund, REFUND, final="refunded")
    bank.fault(tool="issue_refund", delay_before_effect=15)  # the worker dies before the refund lands
    w1 = workers("w1", env=FAST_LEASES)
    run, _ = start_run(user=asha, agent="agent", input={})
    until_dispatching(run.pk, 2)
    until_fault_taken(bank, "issue_refund")
    w1.kill()
    dispatched_at = time.monotonic()
    assert bank.effects("issue_refund") == []
    workers("w2", env=FAST_LEASES)

    run = until_status(run.pk, "succeeded", "failed", "needs_attention", timeout=40)
    assert run.status == "succeeded", run.error
    step = step_of(run.pk, 2)
    assert (step.status, step.attempts, step.crashes) == ("succeeded", 2, 1)
    lookups = [e for e in events(run.pk, "recovery") if "status lookup" in e.message]
    assert [e.data["found"] for e in lookups] == [False]
    effects = bank.effects("issue_refund")
    assert len(effects) == 1 and effects[0]["idempotency_key"] == step.idempotency_key
    # The first request was still sleeping in the server; when it finally lands the provider
    # recognises the key, so there is still one refund.
    time.sleep(max(0.0, 16 - (time.monotonic() - dispatched_at)))
    assert len(bank.effects("issue_refund")) == 1
    assert Run.objects.get(pk=run.pk).status == "succeeded"
    _no_open_reservations(run.pk)
