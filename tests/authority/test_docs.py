"""docs/authority.md's verification snippet, run as written against real calls."""

from __future__ import annotations

import re
import time

import pytest
from django.conf import settings

from authority import assertions, keys
from authority.assertions import CallFacts
from runs.models import RunStatus, Step
from runs.services import start_run
from tests import factories
from tests.authority.conftest import http_tool
from tests.conftest import drive
from tests.servers import ROOT

pytestmark = pytest.mark.django_db(transaction=True)

DOC = (ROOT / "docs" / "authority.md").read_text()


AUDIENCE = "https://bank.example"


def snippet() -> str:
    after = DOC.split("<!-- verification snippet -->", 1)[1]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


def namespace_of_snippet() -> dict:
    namespace: dict = {}
    exec(compile(snippet(), "docs/authority.md", "exec"), namespace)  # as a provider would paste it
    return namespace


def test_the_documented_verifier_accepts_real_calls_and_refuses_altered_ones(
    tenant, asha, recorder, platform_jwks
):
    tool = http_tool(tenant, recorder.url)
    factories.grant(tool, use=[asha])
    arguments = {"customer": "C-7", "amount": 3200.5, "note": "reçu"}
    factories.make_agent(
        tenant,
        tools=[tool],
        turns=[{"tool_calls": [{"name": tool.name, "arguments": arguments}]}, {"text": "ok"}],
    )
    run, _ = start_run(user=asha, agent="agent", input={})
    assert drive(run.pk).status == RunStatus.SUCCEEDED
    namespace: dict = {}
    exec(compile(snippet(), "docs/authority.md", "exec"), namespace)  # as a provider would paste it
    verify = namespace["make_verifier"](platform_jwks, settings.ASSERTION_ISSUER, recorder.url)
    request = recorder.requests[0]
    token, key = request["headers"]["Agent-Assertion"], request["headers"]["Idempotency-Key"]

    claims = verify(token, tool="lookup", arguments=request["body"], idempotency_key=key)

    step = Step.objects.get(run=run, kind="tool")
    assert claims["sub"] == "asha" and claims["idempotency_key"] == step.idempotency_key == key
    assert claims["jti"] != key
    with pytest.raises(PermissionError, match="other arguments"):
        verify(token, tool="lookup", arguments={**request["body"], "amount": 99999}, idempotency_key=key)
    with pytest.raises(PermissionError, match="another tool"):
        verify(token, tool="issue_refund", arguments=request["body"], idempotency_key=key)
    with pytest.raises(PermissionError, match="another idempotency key"):
        verify(token, tool="lookup", arguments=request["body"], idempotency_key="another-key")
    with pytest.raises(PermissionError, match="replayed"):
        verify(token, tool="lookup", arguments=request["body"], idempotency_key=key)
    elsewhere = namespace["make_verifier"](platform_jwks, settings.ASSERTION_ISSUER, "https://other.example")
    with pytest.raises(Exception, match="Audience"):
        elsewhere(token, tool="lookup", arguments=request["body"], idempotency_key=key)


def facts(attempt: int, *, key: str = "acme:run-1:3") -> CallFacts:
    return CallFacts(
        tenant="acme",
        user="asha",
        agent="agent",
        version=1,
        run_id="run-1",
        step=3,
        tool="lookup",
        arguments={"customer": "C-7"},
        idempotency_key=key,
        attempt=attempt,
    )


def test_a_retry_passes_the_documented_replay_cache_with_the_same_idempotency_key(platform_jwks):
    verify = namespace_of_snippet()["make_verifier"](platform_jwks, settings.ASSERTION_ISSUER, AUDIENCE)
    first, retry = (assertions.sign(facts(n), audience=AUDIENCE) for n in (1, 2))

    claims = [
        verify(a.token, tool="lookup", arguments={"customer": "C-7"}, idempotency_key="acme:run-1:3")
        for a in (first, retry)
    ]

    assert [c["attempt"] for c in claims] == [1, 2]
    assert claims[0]["idempotency_key"] == claims[1]["idempotency_key"] == "acme:run-1:3"
    assert claims[0]["jti"] != claims[1]["jti"] and first.jti == claims[0]["jti"]


def test_the_documented_verifier_refuses_no_call_across_a_rotation(platform_jwks, settings):
    # A short cache bound, so the rotation's lead (twice the bound) passes in seconds; the snippet
    # caches for exactly the bound, as docs/authority.md tells providers.
    settings.JWKS_CACHE_SECONDS = 2
    settings.SIGNING_KEY_LEAD_SECONDS = 4
    verify = namespace_of_snippet()["make_verifier"](
        platform_jwks, settings.ASSERTION_ISSUER, AUDIENCE, cache_seconds=2
    )
    old_kid, _ = keys.signing_key()
    check = {"tool": "lookup", "arguments": {"customer": "C-7"}, "idempotency_key": "acme:run-1:3"}
    verify(assertions.sign(facts(1), audience=AUDIENCE).token, **check)  # the set is now cached
    with pytest.raises(keys.RotationRefused, match="shorter than 4 s"):
        keys.create_key(lead_seconds=3)
    new = keys.create_key()

    # Calls go on every 0.2 s until the new key has signed a few (a process re-reads which key
    # signs every KEY_CHECK_SECONDS); each one must verify, before, during and after the switch.
    signed_by: list[str] = []
    deadline = time.monotonic() + 4 + keys.KEY_CHECK_SECONDS + 5
    attempt = 2
    while signed_by.count(new.kid) < 5:
        assert time.monotonic() < deadline, f"the new key never signed: {signed_by}"
        signed = assertions.sign(facts(attempt), audience=AUDIENCE)
        verify(signed.token, **check)
        signed_by.append(signed.key_id)
        attempt += 1
        time.sleep(0.2)
    assert signed_by[0] == old_kid and signed_by[-1] == new.kid


def test_the_key_set_says_how_long_it_may_be_cached(client, settings):
    settings.JWKS_CACHE_SECONDS = 120
    assert client.get("/.well-known/jwks.json")["Cache-Control"] == "public, max-age=120"
