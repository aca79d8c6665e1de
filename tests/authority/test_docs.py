"""docs/authority.md's verification snippet, run as written against real calls."""

from __future__ import annotations

import re

import pytest
from django.conf import settings

from runs.models import RunStatus, Step
from runs.services import start_run
from tests import factories
from tests.authority.conftest import http_tool
from tests.conftest import drive
from tests.servers import ROOT

pytestmark = pytest.mark.django_db(transaction=True)

DOC = (ROOT / "docs" / "authority.md").read_text()


def snippet() -> str:
    after = DOC.split("<!-- verification snippet -->", 1)[1]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


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

    assert claims["sub"] == "asha" and claims["jti"] == Step.objects.get(run=run, kind="tool").idempotency_key
    with pytest.raises(PermissionError, match="other arguments"):
        verify(token, tool="lookup", arguments={**request["body"], "amount": 99999}, idempotency_key=key)
    with pytest.raises(PermissionError, match="another tool"):
        verify(token, tool="issue_refund", arguments=request["body"], idempotency_key=key)
    with pytest.raises(PermissionError, match="jti"):
        verify(token, tool="lookup", arguments=request["body"], idempotency_key="another-key")
    elsewhere = namespace["make_verifier"](platform_jwks, settings.ASSERTION_ISSUER, "https://other.example")
    with pytest.raises(Exception, match="Audience"):
        elsewhere(token, tool="lookup", arguments=request["body"], idempotency_key=key)
