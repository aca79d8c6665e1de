"""Token exchange with the tenant's identity provider, a real OAuth server (Authlib) started by the
test (issue 25 part 2)."""

from __future__ import annotations

import pytest
from django.conf import settings

from authority.models import Delegation, ExchangedToken, IdentityProvider
from runs.models import RunEvent, RunStatus, Step, StepStatus
from runs.services import start_run
from tests import factories
from tests.authority.conftest import RecordingToolServer, http_tool, secret
from tests.conftest import drive
from tests.idp import TokenServer

pytestmark = pytest.mark.django_db(transaction=True)

AUDIENCE = "https://payments.bank.example"


@pytest.fixture
def idp(tenant, platform_jwks):
    server = TokenServer(platform_jwks_url=platform_jwks, platform_issuer=settings.ASSERTION_ISSUER).start()
    IdentityProvider.objects.create(
        tenant=tenant,
        token_url=server.token_url,
        client_id=secret(tenant, "idp-client-id", server.client.client_id),
        client_secret=secret(tenant, "idp-client-secret", server.client.secret),
    )
    yield server
    server.stop()


@pytest.fixture
def payments(idp):
    server = RecordingToolServer(idp_keys=idp.public_keys()).start()
    yield server
    server.stop()


def _exchange_tool(tenant, url, **fields):
    tool = http_tool(tenant, url, server_name="payments", **fields)
    Delegation.objects.create(
        server=tool.server, mode=Delegation.Mode.TOKEN_EXCHANGE, audience=AUDIENCE, scopes=["payments:write"]
    )
    return tool


def _run(tenant, user, tool, calls=1):
    factories.grant(tool, use=[user])
    turns = [{"tool_calls": [{"name": tool.name, "arguments": {"n": i}}]} for i in range(calls)]
    factories.make_agent(tenant, tools=[tool], turns=[*turns, {"text": "done"}])
    run, _ = start_run(user=user, agent="agent", input={})
    return drive(run.pk)


def test_the_tool_gets_a_token_issued_to_the_user_and_one_exchange_serves_many_calls(
    tenant, asha, idp, payments
):
    tool = _exchange_tool(tenant, payments.url)
    run = _run(tenant, asha, tool, calls=2)

    assert run.status == RunStatus.SUCCEEDED, run.error
    steps = list(Step.objects.filter(run=run, kind="tool").order_by("seq"))
    assert [s.result["structured"]["acting_for"] for s in steps] == ["asha", "asha"]
    assert steps[0].result["structured"]["aud"] == AUDIENCE
    assert steps[0].result["structured"]["scope"] == "payments:write"
    assert idp.exchanges == [{"sub": "asha", "aud": AUDIENCE, "scope": "payments:write"}]  # one round trip
    events = list(RunEvent.objects.filter(run=run, kind="identity").order_by("seq"))
    assert [(e.data["token_subject"], e.data["token_from_cache"]) for e in events] == [
        ("asha", False),
        ("asha", True),
    ]
    cached = ExchangedToken.objects.get(user=asha, audience=AUDIENCE)
    token = payments.requests[0]["headers"]["Authorization"].removeprefix("Bearer ")
    assert cached.subject == "asha" and token not in cached.ciphertext
    # The assertion went along too, and the IdP's token never reached the step log or the events.
    assert "Agent-Assertion" in payments.requests[0]["headers"]
    assert not [s for s in steps if token in str(s.result) + s.observation]
    assert not [e for e in RunEvent.objects.filter(run=run) if token in e.message + str(e.data)]


def test_a_user_the_idp_refuses_gets_a_denial_with_its_reason_and_nothing_is_sent(
    tenant, asha, idp, payments
):
    idp.refused["asha"] = "asha is suspended from payments until the audit closes"
    tool = _exchange_tool(tenant, payments.url)
    run = _run(tenant, asha, tool)

    assert run.status == RunStatus.SUCCEEDED, run.error  # the model was told and answered
    step = Step.objects.get(run=run, kind="tool")
    assert step.status == StepStatus.DENIED
    assert "access_denied" in step.error and "suspended from payments until the audit closes" in step.error
    assert step.observation.startswith("ERROR: call denied: the identity provider refused")
    assert payments.requests == []
    assert not ExchangedToken.objects.exists()


def test_an_idp_that_does_not_answer_is_retried_with_backoff_and_the_call_goes_once(
    tenant, asha, idp, payments, monkeypatch
):
    idp.down = True
    tool = _exchange_tool(tenant, payments.url, effect_class="unsafe", backoff_seconds=0.05, max_attempts=5)
    factories.grant(tool, use=[asha])
    factories.make_agent(
        tenant,
        tools=[tool],
        turns=[{"tool_calls": [{"name": tool.name, "arguments": {"n": 1}}]}, {"text": "done"}],
    )
    run, _ = start_run(user=asha, agent="agent", input={})
    from runs.engine import advance

    for _ in range(4):  # the claim and the first attempt, then a retry that also finds the IdP down
        advance(run.pk)
    step = Step.objects.get(run=run, kind="tool")
    assert step.status == StepStatus.DISPATCHING and step.next_attempt_at is not None
    assert "not sent: the identity provider answered 503" in step.error
    assert payments.requests == []
    idp.down = False
    run = drive(run.pk)

    assert run.status == RunStatus.SUCCEEDED, run.error
    step.refresh_from_db()
    assert step.status == StepStatus.SUCCEEDED and step.result["structured"]["acting_for"] == "asha"
    assert len(payments.requests) == 1  # an unsafe tool, and still sent exactly once
    assert RunEvent.objects.filter(run=run, kind="retry_scheduled").exists()


def test_an_idp_that_stays_down_fails_the_step_after_max_attempts_and_the_model_is_told(
    tenant, asha, idp, payments
):
    idp.down = True
    tool = _exchange_tool(tenant, payments.url, effect_class="unsafe", backoff_seconds=0.01, max_attempts=2)
    run = _run(tenant, asha, tool)

    assert run.status == RunStatus.SUCCEEDED, run.error
    step = Step.objects.get(run=run, kind="tool")
    assert step.status == StepStatus.FAILED and "identity provider answered 503" in step.error
    assert payments.requests == []


def test_a_tenant_without_an_identity_provider_is_denied_with_that_reason(tenant, asha):
    payments = RecordingToolServer().start()
    try:
        tool = _exchange_tool(tenant, payments.url)
        run = _run(tenant, asha, tool)
    finally:
        payments.stop()
    step = Step.objects.get(run=run, kind="tool")
    assert step.status == StepStatus.DENIED and "none is configured" in step.error
    assert payments.requests == []
