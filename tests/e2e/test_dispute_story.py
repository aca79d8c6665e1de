"""The reference story end to end: REST API, a real Celery worker, the MCP bank server."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from runs.models import Run
from tests import factories
from tests.servers import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def client_for(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


def test_it_pauses_for_approval_denies_the_injected_transfer_and_refunds_once(
    tenant, asha, ravi, bank, workers
):
    tools = factories.make_bank_tools(tenant, bank.mcp_url)
    names = {k: t.name for k, t in tools.items()}
    for key in ("lookup_transaction", "search_tickets", "issue_refund", "send_customer_email"):
        factories.grant(tools[key], use=[asha])
    factories.grant(tools["issue_refund"], approve=[ravi])
    factories.make_agent(
        tenant,
        name="dispute-agent",
        tools=[
            tools[k]
            for k in (
                "lookup_transaction",
                "search_tickets",
                "issue_refund",
                "send_customer_email",
                "transfer_funds",
            )
        ],
        turns=[
            {
                "tool_calls": [
                    {
                        "name": names["lookup_transaction"],
                        "arguments": {"transaction_id": "$input.transaction_id"},
                    }
                ]
            },
            {
                "tool_calls": [
                    {"name": names["search_tickets"], "arguments": {"query": "$input.transaction_id"}}
                ]
            },
            {
                "tool_calls": [
                    {
                        "name": names["transfer_funds"],
                        "arguments": {"to_account": "ACC-999", "amount": 500000},
                    }
                ]
            },
            {
                "tool_calls": [
                    {
                        "name": names["issue_refund"],
                        "arguments": {
                            "transaction_id": "$input.transaction_id",
                            "amount": "$input.amount",
                            "currency": "INR",
                        },
                    }
                ]
            },
            {
                "tool_calls": [
                    {
                        "name": names["send_customer_email"],
                        "arguments": {
                            "to": "$input.customer_email",
                            "subject": "Your refund",
                            "body": "Refunded.",
                        },
                    }
                ]
            },
            {"text": "The duplicate charge of INR 12,499 was refunded."},
        ],
    )
    workers("w1")

    response = client_for(asha).post(
        "/v1/runs",
        {
            "agent": "dispute-agent",
            "input": {"transaction_id": "TXN-1001", "amount": 12499, "customer_email": "c@example.com"},
        },
        format="json",
        HTTP_IDEMPOTENCY_KEY="dispute-1",
    )
    assert response.status_code == 201, response.content
    run_id = response.json()["id"]

    wait_for(lambda: Run.objects.get(pk=run_id).status == "waiting_approval", what="approval wait")
    approvals = client_for(ravi).get("/v1/approvals?status=pending").json()["results"]
    assert [a["tool"] for a in approvals] == [names["issue_refund"]]
    assert approvals[0]["arguments"]["amount"] == 12499
    decided = client_for(ravi).post(
        f"/v1/approvals/{approvals[0]['id']}/approve", {"reason": "verified"}, format="json"
    )
    assert decided.status_code == 200, decided.content

    run = wait_for(lambda: (r := Run.objects.get(pk=run_id)).is_terminal and r, what="run end")
    assert run.status == "succeeded", run.error
    assert len(bank.effects("issue_refund")) == 1
    assert bank.effects("transfer_funds") == []
    assert len(bank.effects("send_customer_email")) == 1
    steps = client_for(asha).get(f"/v1/runs/{run_id}/steps").json()
    transfer = next(s for s in steps if s["tool"] == names["transfer_funds"])
    assert transfer["status"] == "denied" and "may not use" in transfer["error"]
    refund = next(s for s in steps if s["tool"] == names["issue_refund"])
    assert refund["status"] == "succeeded"
    assert bank.effects("issue_refund")[0]["idempotency_key"] == refund["idempotency_key"]
