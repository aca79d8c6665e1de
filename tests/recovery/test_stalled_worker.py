"""A worker frozen with SIGSTOP past its lease, then resumed: fencing keeps its late write out.

While it is stopped the sweeper hands its run to another worker; when it wakes up, its result
can only be recorded as a late attempt, except that a late success proves an unknown outcome.
"""

from __future__ import annotations

import signal

import pytest

from runs.services import start_run
from tests import factories
from tests.recovery.conftest import (
    EMAIL,
    FAST_LEASES,
    REFUND,
    events,
    http_bank_tool,
    run_of,
    single_call_agent,
    step_of,
    until_status,
)
from tests.servers import wait_for
from tools.models import Tool

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fast_sweeps")]


def _stop_once_applied(bank, worker, remote: str) -> dict:
    effect = wait_for(lambda: bank.effects(remote), timeout=30, interval=0.05, what=f"{remote} applied")[0]
    worker.signal(signal.SIGSTOP)
    return effect


def test_it_records_a_stalled_workers_result_only_as_a_late_attempt(tenant, asha, bank, workers):
    refund = factories.make_bank_tools(tenant, bank.mcp_url)["issue_refund"]
    Tool.objects.filter(pk=refund.pk).update(effect_class="idempotent", timeout_seconds=5)
    single_call_agent(tenant, asha, refund, REFUND, final="refunded")
    bank.fault(tool="issue_refund", delay_after_effect=2)
    w1 = workers("w1", env=FAST_LEASES)
    run, _ = start_run(user=asha, agent="agent", input={})
    effect = _stop_once_applied(bank, w1, "issue_refund")
    workers("w2", env=FAST_LEASES)

    run = until_status(run.pk, "succeeded", "failed", "needs_attention", timeout=60)
    assert run.status == "succeeded", run.error
    step = step_of(run.pk, 2)
    assert (step.status, step.attempts, step.crashes) == ("succeeded", 2, 1)
    assert not events(run.pk, "late_attempt")

    w1.signal(signal.SIGCONT)
    late = wait_for(lambda: events(run.pk, "late_attempt"), timeout=60, what="the stalled worker's write")
    assert [e.step_seq for e in late] == [2]
    after = step_of(run.pk, 2)
    assert (after.status, after.attempts, after.result) == ("succeeded", 2, step.result)
    assert run_of(run.pk).status == "succeeded"
    effects = bank.effects("issue_refund")
    assert len(effects) == 1 and effects[0]["result"]["refund_id"] == effect["result"]["refund_id"]


def test_it_resolves_an_unsafe_step_from_the_late_success_of_a_stalled_worker(tenant, asha, bank, workers):
    email = http_bank_tool(tenant, bank, "send_customer_email", effect_class="unsafe")
    single_call_agent(tenant, asha, email, EMAIL, final="emailed")
    bank.fault(tool="send_customer_email", delay_after_effect=2)  # answered while the worker is frozen
    w1 = workers("w1", env=FAST_LEASES)
    run, _ = start_run(user=asha, agent="agent", input={})
    effect = _stop_once_applied(bank, w1, "send_customer_email")
    workers("w2", env=FAST_LEASES)

    run = until_status(run.pk, "needs_attention", timeout=60)
    assert step_of(run.pk, 2).status == "outcome_unknown"
    assert len(bank.effects("send_customer_email")) == 1

    w1.signal(signal.SIGCONT)
    run = until_status(run.pk, "succeeded", "failed", timeout=60)
    assert run.status == "succeeded", run.error
    step = step_of(run.pk, 2)
    assert step.status == "resolved_succeeded"
    assert step.result["structured"]["message_id"] == effect["result"]["message_id"]
    late = events(run.pk, "late_attempt")
    assert [(e.step_seq, e.data["outcome"]) for e in late] == [(2, "succeeded")]
    assert any("resolved automatically" in e.message for e in events(run.pk, "step"))
    assert not events(run.pk, "resolved")  # nobody had to step in
    assert len(bank.effects("send_customer_email")) == 1
