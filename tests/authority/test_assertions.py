"""Every HTTP and MCP tool call carries a signed assertion of who acts (issue 25 part 1)."""

from __future__ import annotations

import base64
import datetime as dt
import json

import jwt
import pytest
from django.conf import settings
from django.utils import timezone

from authority import keys
from authority.credentials import ASSERTION_META_KEY
from authority.models import Delegation, SigningKey
from runs.models import RunEvent, RunStatus, Step, StepStatus
from runs.services import start_run
from tests import factories
from tests.authority.conftest import RecordingToolServer, http_tool, verify
from tests.conftest import drive

pytestmark = pytest.mark.django_db(transaction=True)

ARGS = {"customer": "C-1", "amount": 12499, "note": "café"}


def _one_call_run(tenant, asha, tool, *, calls=1):
    factories.grant(tool, use=[asha])
    turns = [{"tool_calls": [{"name": tool.name, "arguments": {**ARGS, "n": i}}]} for i in range(calls)]
    factories.make_agent(tenant, tools=[tool], turns=[*turns, {"text": "done"}])
    run, _ = start_run(user=asha, agent="agent", input={})
    return drive(run.pk)


def test_it_signs_each_call_with_the_user_the_agent_the_run_and_the_exact_arguments(
    tenant, asha, recorder, platform_jwks
):
    tool = http_tool(tenant, recorder.url)
    run = _one_call_run(tenant, asha, tool)

    assert run.status == RunStatus.SUCCEEDED, run.error
    step = Step.objects.get(run=run, kind="tool")
    token = recorder.requests[0]["headers"]["Agent-Assertion"]
    claims = verify(token, platform_jwks, audience=recorder.url)
    assert claims["sub"] == "asha" and claims["tenant"] == tenant.slug
    assert claims["act"] == {"sub": "agent:agent", "agent": "agent", "version": 1, "run": str(run.pk)}
    assert (claims["tool"], claims["step"], claims["purpose"]) == ("lookup", step.seq, "call")
    assert (
        claims["idempotency_key"]
        == step.idempotency_key
        == recorder.requests[0]["headers"]["Idempotency-Key"]
    )
    assert claims["jti"] != step.idempotency_key  # unique to this assertion
    assert 0 < claims["exp"] - claims["iat"] <= settings.ASSERTION_TTL_SECONDS
    assert "approval" not in claims
    # The provider recomputes the digest from the arguments it received.
    from core.digests import digest

    assert claims["args_digest"] == digest(recorder.requests[0]["body"])
    event = RunEvent.objects.get(run=run, kind="identity")
    assert (event.data["jti"], event.data["idempotency_key"]) == (claims["jti"], step.idempotency_key)
    assert (event.data["subject"], event.data["audience"]) == ("asha", recorder.url)
    assert token not in str(event.data) and token not in event.message


def test_a_retried_idempotent_call_presents_a_new_jti_with_the_same_idempotency_key(
    tenant, asha, platform_jwks
):
    flaky = RecordingToolServer(fail_first=1).start()
    try:
        tool = http_tool(tenant, flaky.url, effect_class="idempotent", settle_seconds=0, backoff_seconds=0.05)
        run = _one_call_run(tenant, asha, tool)
    finally:
        flaky.stop()

    assert run.status == RunStatus.SUCCEEDED, run.error
    step = Step.objects.get(run=run, kind="tool")
    assert step.status == StepStatus.SUCCEEDED and step.attempts == 2
    first, second = (r["headers"]["Agent-Assertion"] for r in flaky.requests)
    assert first != second
    a, b = (verify(t, platform_jwks, audience=flaky.url) for t in (first, second))
    # A provider's replay cache (keyed by jti) lets the retry through; it de-duplicates by the key.
    assert a["jti"] != b["jti"]
    assert a["idempotency_key"] == b["idempotency_key"] == step.idempotency_key
    assert (a["attempt"], b["attempt"]) == (1, 2)
    assert [
        (e.data["jti"], e.data["idempotency_key"]) for e in RunEvent.objects.filter(run=run, kind="identity")
    ] == [(a["jti"], step.idempotency_key), (b["jti"], step.idempotency_key)]


def test_an_approved_call_names_the_approval_and_the_approver(tenant, asha, ravi, recorder, platform_jwks):
    from runs.approval_effects import decide_approval

    tool = http_tool(tenant, recorder.url, approval_policy="always")
    factories.grant(tool, use=[asha], approve=[ravi])
    factories.make_agent(
        tenant,
        tools=[tool],
        turns=[{"tool_calls": [{"name": tool.name, "arguments": ARGS}]}, {"text": "done"}],
    )
    run, _ = start_run(user=asha, agent="agent", input={})
    run = drive(run.pk)
    assert run.status == RunStatus.WAITING_APPROVAL
    approval = run.approvals.get()
    decide_approval(approval_id=approval.pk, user=ravi, approve=True, reason="checked the receipt")
    run = drive(run.pk)

    assert run.status == RunStatus.SUCCEEDED, run.error
    claims = verify(recorder.requests[0]["headers"]["Agent-Assertion"], platform_jwks, audience=recorder.url)
    assert claims["approval"] == {"id": str(approval.pk), "approver": "ravi", "digest": approval.digest}


def test_a_server_configured_for_it_gets_the_assertion_in_mcp_meta_and_a_custom_header(
    tenant, asha, bank, platform_jwks
):
    tools = factories.make_bank_tools(tenant, bank.mcp_url)
    Delegation.objects.create(
        server=tools["lookup_transaction"].server, audience="https://bank.example", header="X-On-Behalf-Of"
    )
    factories.grant(tools["lookup_transaction"], use=[asha])
    factories.make_agent(
        tenant,
        tools=[tools["lookup_transaction"]],
        turns=[
            {
                "tool_calls": [
                    {"name": "bank__lookup_transaction", "arguments": {"transaction_id": "TXN-1001"}}
                ]
            },
            {"text": "done"},
        ],
    )
    run, _ = start_run(user=asha, agent="agent", input={})
    run = drive(run.pk)
    assert run.status == RunStatus.SUCCEEDED, run.error
    event = RunEvent.objects.get(run=run, kind="identity")
    assert (event.data["audience"], event.data["subject"]) == ("https://bank.example", "asha")


def test_a_rotation_keeps_the_old_key_published_until_its_assertions_expire(tenant, asha, recorder, client):
    tool = http_tool(tenant, recorder.url)
    factories.grant(tool, use=[asha])
    old_kid, _ = keys.signing_key()
    # Published a lead ago, so it signs from now.
    new = keys.create_key(now=timezone.now() - dt.timedelta(seconds=settings.SIGNING_KEY_LEAD_SECONDS))
    published = {k["kid"] for k in client.get("/.well-known/jwks.json").json()["keys"]}
    assert published == {old_kid, new.kid}
    assert keys.signing_key()[0] == new.kid
    # A key added with a lead is published first and signs only later.
    later = keys.create_key(lead_seconds=600)
    assert keys.signing_key()[0] == new.kid
    assert later.kid in {k["kid"] for k in keys.jwks()["keys"]}
    assert keys.signing_key(timezone.now() + dt.timedelta(seconds=601))[0] == later.kid
    # Once an assertion's life (and a minute of skew) has passed since a key stopped signing, it
    # is no longer published and its private half is erased (plus the seconds a process may go on
    # signing with the key it keeps: keys.KEY_CHECK_SECONDS).
    gone = timezone.now() + dt.timedelta(seconds=settings.ASSERTION_TTL_SECONDS + 61 + keys.KEY_CHECK_SECONDS)
    assert old_kid not in {k["kid"] for k in keys.jwks(gone)["keys"]}
    assert keys.erase_expired(gone) == 1
    assert not SigningKey.objects.filter(kid=old_kid).exists()


def test_the_private_key_is_stored_only_encrypted_and_the_key_set_holds_no_private_part(client):
    kid, private = keys.signing_key()
    row = SigningKey.objects.get(kid=kid)
    from cryptography.hazmat.primitives import serialization

    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    assert pem not in row.private_ciphertext and "PRIVATE" not in row.private_ciphertext
    (published,) = client.get("/.well-known/jwks.json").json()["keys"]
    assert set(published) == {"kty", "crv", "x", "kid", "use", "alg"}


def test_a_tampered_assertion_or_one_for_other_arguments_does_not_verify(
    tenant, asha, recorder, platform_jwks
):
    tool = http_tool(tenant, recorder.url)
    _one_call_run(tenant, asha, tool)
    token = recorder.requests[0]["headers"]["Agent-Assertion"]
    head, body, sig = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    forged = base64.urlsafe_b64encode(json.dumps({**claims, "sub": "ravi"}).encode()).rstrip(b"=").decode()
    with pytest.raises(jwt.InvalidSignatureError):
        verify(f"{head}.{forged}.{sig}", platform_jwks, audience=recorder.url)
    with pytest.raises(jwt.InvalidAudienceError):
        verify(token, platform_jwks, audience="https://elsewhere.example")
    assert ASSERTION_META_KEY == "io.agentplatform/assertion"


def test_a_status_lookup_of_a_reconcilable_call_carries_an_assertion_with_the_calls_key(
    tenant, asha, live_server
):
    from tests.servers import BankServer

    bank = BankServer(
        "bank",
        "--assertion-jwks",
        f"{live_server.url}/.well-known/jwks.json",
        "--assertion-issuer",
        settings.ASSERTION_ISSUER,
        "--assertion-audience",
        "https://bank.example",
        "--refund-limit",
        "asha=5000",
    ).start()
    try:
        tools = factories.make_bank_tools(tenant, bank.mcp_url)
        Delegation.objects.create(server=tools["issue_refund"].server, audience="https://bank.example")
        refund = tools["issue_refund"]
        refund.effect_class, refund.approval_policy = "reconcilable", "never"
        refund.save()
        factories.grant(refund, use=[asha])
        bank.fault(tool="issue_refund", fail_5xx_after_effect=True)  # applied, then the answer is lost
        arguments = {"transaction_id": "TXN-1002", "amount": 3200, "currency": "INR"}
        factories.make_agent(
            tenant,
            tools=[refund],
            turns=[
                {"tool_calls": [{"name": "bank__issue_refund", "arguments": arguments}]},
                {"text": "done"},
            ],
        )
        run, _ = start_run(user=asha, agent="agent", input={})
        run = drive(run.pk)

        assert run.status == RunStatus.SUCCEEDED, run.error
        step = Step.objects.get(run=run, kind="tool")
        assert step.status == StepStatus.SUCCEEDED and "found by status lookup" in " ".join(
            RunEvent.objects.filter(run=run).values_list("message", flat=True)
        )
        assert len(bank.effects("issue_refund")) == 1
        import httpx

        seen = httpx.get(f"{bank.url}/calls", timeout=10).json()["identities"]
        # The bank keeps a replay cache: the lookup's assertion has a jti of its own.
        assert [(c["tool"], c["idempotency_key"]) for c in seen] == [
            ("issue_refund", step.idempotency_key),
            ("refund_status", step.idempotency_key),
        ]
        assert seen[0]["jti"] != seen[1]["jti"]
    finally:
        bank.stop()


def test_the_rotate_command_publishes_a_key_that_signs_after_its_lead():
    from io import StringIO

    from django.core.management import call_command
    from django.core.management.base import CommandError

    first, _ = keys.signing_key()
    # Shorter than twice the key set's cache bound (JWKS_CACHE_SECONDS, 300): providers caching the
    # set would refuse the new key's calls (a 12 s lead had calls refused for about 10 s).
    for short in ("12", "0", "599"):
        with pytest.raises(CommandError, match="shorter than 600 s"):
            call_command("rotate_signing_key", "--lead-seconds", short, stdout=StringIO())
    assert SigningKey.objects.count() == 1
    out = StringIO()
    call_command("rotate_signing_key", "--lead-seconds", "900", stdout=out)
    new = SigningKey.objects.exclude(kid=first).get()
    assert f"key {new.kid} published" in out.getvalue()
    assert keys.signing_key()[0] == first  # the old key signs until the new one's lead has passed
    assert keys.signing_key(timezone.now() + dt.timedelta(seconds=901))[0] == new.kid
    assert SigningKey.objects.get(kid=first).retired_at == new.signs_from


def test_the_first_signatures_made_at_once_share_the_first_key():
    # A worker's threads starting together each find no key: one makes it, the others, refused
    # a 0 s rotation, sign with it (once an engine error leaving a refund `dispatching`).
    import threading

    from django.db import connection

    barrier, kids, errors = threading.Barrier(8), [], []

    def first_signature():
        try:
            barrier.wait()
            kids.append(keys.signing_key()[0])
        except Exception as exc:  # the assertion below names it
            errors.append(exc)
        finally:
            connection.close()

    keys._current.clear()
    threads = [threading.Thread(target=first_signature) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == [] and len(kids) == 8
    published = {key.kid for key in keys.published()}
    assert set(kids) <= published
