"""Issue 25 with a real worker: the provider's own check of who acts (the example bank refusing a
refund the platform's grants allowed), and a tool behind token exchange with the tenant's IdP."""

from __future__ import annotations

import pytest
from django.conf import settings

from authority.models import Delegation, IdentityProvider
from runs.models import Run, RunEvent, Step, StepStatus
from runs.services import start_run
from tests import factories
from tests.authority.conftest import RecordingToolServer, http_tool, secret
from tests.idp import TokenServer
from tests.servers import BankServer, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

BANK_AUDIENCE = "https://core-banking.bank.example"


def _finished(run_id) -> Run:
    return wait_for(lambda: (r := Run.objects.get(pk=run_id)).is_terminal and r, timeout=90, what="run end")


def test_the_bank_refuses_by_its_own_check_a_refund_the_platforms_grants_allowed(
    tenant, asha, live_server, workers
):
    bank = BankServer(
        "bank",
        "--assertion-jwks",
        f"{live_server.url}/.well-known/jwks.json",
        "--assertion-issuer",
        settings.ASSERTION_ISSUER,
        "--assertion-audience",
        BANK_AUDIENCE,
        "--refund-limit",
        "asha=5000",
    ).start()
    try:
        tools = factories.make_bank_tools(tenant, bank.mcp_url)
        Delegation.objects.create(server=tools["issue_refund"].server, audience=BANK_AUDIENCE)
        refund = tools["issue_refund"]
        refund.approval_policy = "never"  # the platform lets asha refund any amount herself
        refund.save()
        factories.grant(refund, use=[asha])
        small = {"transaction_id": "TXN-1002", "amount": 3200, "currency": "INR"}
        large = {"transaction_id": "TXN-1001", "amount": 12499, "currency": "INR"}
        factories.make_agent(
            tenant,
            tools=[refund],
            turns=[
                {"tool_calls": [{"name": "bank__issue_refund", "arguments": small}]},
                {"tool_calls": [{"name": "bank__issue_refund", "arguments": large}]},
                {"text": "One refund issued; the bank refused the other."},
            ],
        )
        workers("w1")
        run, _ = start_run(user=asha, agent="agent", input={})
        run = _finished(run.pk)

        assert run.status == "succeeded", run.error
        first, second = Step.objects.filter(run=run, kind="tool").order_by("seq")
        # The platform's grants passed both calls: both were sent.
        assert first.status == second.status == StepStatus.SUCCEEDED
        assert first.result["structured"]["status"] == "issued"
        # The bank refused the second on its own rule, and the run shows it.
        assert (
            "Refused by the bank: asha may refund up to INR 5000; this refund is INR 12499"
            in second.observation
        )
        # The platform's trail and the bank's join on jti (one per attempt).
        events = [e.data for e in RunEvent.objects.filter(run=run, kind="identity").order_by("id")]
        assert [e["idempotency_key"] for e in events] == [first.idempotency_key, second.idempotency_key]
        assert all(e["subject"] == "asha" and e["audience"] == BANK_AUDIENCE for e in events)
        applied = bank.effects("issue_refund")
        assert [(e["arguments"]["amount"], e["subject"], e["jti"]) for e in applied] == [
            (3200, "asha", events[0]["jti"])
        ]
        seen = httpx_json(f"{bank.url}/calls")["identities"]
        assert [(c["subject"], c["jti"], c["idempotency_key"]) for c in seen] == [
            ("asha", events[0]["jti"], first.idempotency_key),
            ("asha", events[1]["jti"], second.idempotency_key),
        ]
    finally:
        bank.stop()


def test_a_tool_behind_token_exchange_acts_for_the_user_and_a_refused_user_is_told_why(
    tenant, asha, live_server, workers
):
    bob = factories.make_user(tenant, "bob")
    idp = TokenServer(
        platform_jwks_url=f"{live_server.url}/.well-known/jwks.json",
        platform_issuer=settings.ASSERTION_ISSUER,
    ).start()
    payments = RecordingToolServer(idp_keys=idp.public_keys()).start()
    try:
        idp.refused["bob"] = "bob has no payments entitlement"
        IdentityProvider.objects.create(
            tenant=tenant,
            token_url=idp.token_url,
            client_id=secret(tenant, "idp-client-id", idp.client.client_id),
            client_secret=secret(tenant, "idp-client-secret", idp.client.secret),
        )
        tool = http_tool(tenant, payments.url, server_name="payments")
        Delegation.objects.create(
            server=tool.server, mode=Delegation.Mode.TOKEN_EXCHANGE, audience="https://payments.example"
        )
        factories.grant(tool, use=[asha, bob])
        factories.make_agent(
            tenant,
            tools=[tool],
            turns=[{"tool_calls": [{"name": tool.name, "arguments": {"q": "balance"}}]}, {"text": "done"}],
        )
        workers("w1")
        runs = [start_run(user=user, agent="agent", input={"who": user.username})[0] for user in (asha, bob)]
        asha_run, bob_run = (_finished(r.pk) for r in runs)

        asha_step = Step.objects.get(run=asha_run, kind="tool")
        assert asha_step.status == StepStatus.SUCCEEDED, asha_step.error
        assert asha_step.result["structured"]["acting_for"] == "asha"
        bob_step = Step.objects.get(run=bob_run, kind="tool")
        assert bob_step.status == StepStatus.DENIED
        assert "bob has no payments entitlement" in bob_step.observation
        assert len(payments.requests) == 1  # only asha's call went out
        assert [x["sub"] for x in idp.exchanges] == ["asha"]
    finally:
        payments.stop()
        idp.stop()


def httpx_json(url: str) -> dict:
    import httpx

    return httpx.get(url, timeout=10).json()
