"""PostgreSQL restarts while runs are in flight: workers reconnect and every run finishes."""

from __future__ import annotations

import time

import pytest

from llm.models import ModelEndpoint
from runs.models import Run, Step
from runs.services import start_run
from tests import factories
from tests.recovery.conftest import (
    EMAIL,
    FAST_LEASES,
    db_retry,
    http_bank_tool,
    postgres,
    restart_postgres,
    single_call_agent,
    step_of,
    sweep_until,
    until_status,
)
from tests.servers import wait_for

# Both tests restart PostgreSQL: the session's throwaway cluster (tests/services.py), never the machine's.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fast_sweeps", "own_services")]


def test_it_finishes_every_run_across_a_postgresql_restart(tenant, asha, bank, workers):
    tools = factories.make_bank_tools(tenant, bank.mcp_url)
    names = {k: t.name for k, t in tools.items()}
    for key in ("lookup_transaction", "search_tickets", "issue_refund"):
        factories.grant(tools[key], use=[asha])
    factories.make_agent(
        tenant,
        tools=[tools[k] for k in ("lookup_transaction", "search_tickets", "issue_refund")],
        turns=[
            {
                "tool_calls": [
                    {"name": names["lookup_transaction"], "arguments": {"transaction_id": "TXN-1002"}}
                ]
            },
            {"tool_calls": [{"name": names["search_tickets"], "arguments": {"query": "$input.ref"}}]},
            {
                "tool_calls": [
                    {"name": names["lookup_transaction"], "arguments": {"transaction_id": "TXN-1003"}}
                ]
            },
            {
                "tool_calls": [
                    {
                        "name": names["issue_refund"],
                        "arguments": {
                            "transaction_id": "TXN-1002",
                            "amount": "$input.amount",
                            "currency": "INR",
                        },
                    }
                ]
            },
            {"text": "refunded"},
        ],
    )
    ModelEndpoint.objects.filter(tenant=tenant).update(timeout_seconds=5)  # short leases for model steps too
    bank.fault(tool="lookup_transaction", delay_before_effect=1, times=100)
    workers("w1", env=FAST_LEASES)
    ids = [
        start_run(user=asha, agent="agent", input={"ref": f"R{n}", "amount": 100 + n})[0].pk for n in range(4)
    ]
    wait_for(
        lambda: Step.objects.filter(run__in=ids, kind="tool", status="succeeded").count() >= 2,
        timeout=60,
        what="runs under way",
    )
    assert not Run.objects.filter(pk__in=ids, status="succeeded").exists()

    restart_postgres()

    sweep_until(
        lambda: all(r.is_terminal for r in Run.objects.filter(pk__in=ids)),
        timeout=120,
        what="all runs finished",
    )
    finished = db_retry(lambda: list(Run.objects.filter(pk__in=ids)))
    assert {r.status for r in finished} == {"succeeded"}, [(r.pk, r.status, r.error) for r in finished]
    refunds = bank.effects("issue_refund")
    assert sorted(e["arguments"]["amount"] for e in refunds) == [100 + n for n in range(4)]


def test_it_records_the_result_of_an_unsafe_call_that_returns_while_postgresql_is_down(
    tenant, asha, bank, workers
):
    email = http_bank_tool(tenant, bank, "send_customer_email", effect_class="unsafe", timeout_seconds=8)
    single_call_agent(tenant, asha, email, EMAIL, final="emailed")
    bank.fault(tool="send_customer_email", delay_after_effect=3)
    workers("w1", env=FAST_LEASES)
    run, _ = start_run(user=asha, agent="agent", input={})
    wait_for(lambda: bank.effects("send_customer_email"), timeout=30, interval=0.05, what="email sent")

    postgres("stop")  # the answer arrives while the database is down
    time.sleep(4)
    postgres("start")

    run = until_status(run.pk, "succeeded", "failed", "needs_attention", timeout=60)
    assert run.status == "succeeded", run.error
    step = step_of(run.pk, 2)
    assert (step.status, step.attempts, step.crashes) == ("succeeded", 1, 0)  # known, so never unknown
    assert len(bank.effects("send_customer_email")) == 1
