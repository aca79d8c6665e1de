"""A client generated from /v1/schema (openapi-python-client) drives a run end to end on a live
server with a real Celery worker and the example bank: the schema is true enough to program against.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import time

import httpx
import pytest

from tests import factories

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

PACKAGE = "agentplatform_client"


def generate_client(base_url: str, directory) -> object:
    """Generate the client package from the served schema into `directory` and import it."""
    schema = httpx.get(f"{base_url}/v1/schema", params={"format": "json"}, timeout=30)
    assert schema.status_code == 200
    (directory / "schema.json").write_text(schema.text)
    # No post hooks: the generated code is imported as generated, not reformatted.
    (directory / "config.json").write_text(json.dumps({"package_name_override": PACKAGE, "post_hooks": []}))
    generated = subprocess.run(
        [
            sys.executable,
            "-m",
            "openapi_python_client",
            "generate",
            "--path",
            str(directory / "schema.json"),
            "--config",
            str(directory / "config.json"),
            "--meta",
            "none",
            "--output-path",
            str(directory / PACKAGE),
            "--fail-on-warning",
        ],
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert generated.returncode == 0, generated.stdout + generated.stderr
    assert "Warning" not in generated.stdout + generated.stderr
    sys.path.insert(0, str(directory))
    importlib.invalidate_caches()
    return importlib.import_module(PACKAGE)


def eventually(read, done, *, timeout: float = 90, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = read()
        if done(value):
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}: last {value}")


@pytest.fixture
def dispute_agent(tenant, bank):
    support = factories.make_user(tenant, "asha", password="asha-pw")
    supervisor = factories.make_user(tenant, "ravi", staff=True, password="ravi-pw")
    tools = factories.make_bank_tools(tenant, bank.mcp_url)
    for key in ("lookup_transaction", "issue_refund"):
        factories.grant(tools[key], use=[support])
    factories.grant(tools["issue_refund"], approve=[supervisor])
    factories.make_agent(
        tenant,
        name="dispute-agent",
        tools=[tools["lookup_transaction"], tools["issue_refund"]],
        turns=[
            {
                "tool_calls": [
                    {
                        "name": tools["lookup_transaction"].name,
                        "arguments": {"transaction_id": "$input.transaction_id"},
                    }
                ]
            },
            {
                "tool_calls": [
                    {
                        "name": tools["issue_refund"].name,
                        "arguments": {
                            "transaction_id": "$input.transaction_id",
                            "amount": "$input.amount",
                            "currency": "INR",
                        },
                    }
                ]
            },
            {"text": "Refunded INR 12,499."},
        ],
    )
    return tools


def test_a_generated_client_starts_a_run_follows_it_approves_it_and_reads_usage(
    live_server, dispute_agent, bank, workers, tmp_path
):
    client = generate_client(live_server.url, tmp_path)
    from agentplatform_client import AuthenticatedClient, Client
    from agentplatform_client.api.approvals import approve, deny, list_approvals
    from agentplatform_client.api.auth import create_token
    from agentplatform_client.api.runs import get_run, list_run_steps, start_run
    from agentplatform_client.api.usage import get_usage
    from agentplatform_client.models import (
        ApproveRequest,
        DenyRequest,
        Error,
        ListApprovalsStatus,
        RunStatusEnum,
        SignInRequest,
        StartRunRequest,
        StartRunRequestInput,
    )

    assert client.__name__ == PACKAGE
    workers("w1")
    anonymous = Client(base_url=live_server.url, timeout=httpx.Timeout(30), raise_on_unexpected_status=True)

    def signed_in(username: str, password: str) -> AuthenticatedClient:
        token = create_token.sync(client=anonymous, body=SignInRequest(username=username, password=password))
        assert token.token_type.value == "Bearer"
        return AuthenticatedClient(
            base_url=live_server.url,
            token=token.token,
            timeout=httpx.Timeout(30),
            raise_on_unexpected_status=True,
        )

    wrong = create_token.sync(client=anonymous, body=SignInRequest(username="asha", password="nope"))
    assert isinstance(wrong, Error) and wrong.error.code == "invalid_credentials"
    asha = signed_in("asha", "asha-pw")
    ravi = signed_in("ravi", "ravi-pw")

    body = StartRunRequest(
        agent="dispute-agent",
        input_=StartRunRequestInput.from_dict({"transaction_id": "TXN-1001", "amount": 12499}),
    )
    created = start_run.sync_detailed(client=asha, body=body, idempotency_key="dispute-TXN-1001")
    assert created.status_code == 201
    run = created.parsed
    replayed = start_run.sync_detailed(client=asha, body=body, idempotency_key="dispute-TXN-1001")
    assert replayed.status_code == 200 and replayed.parsed.id == run.id
    other = StartRunRequest(
        agent="dispute-agent", input_=StartRunRequestInput.from_dict({"transaction_id": "X"})
    )
    reused = start_run.sync_detailed(client=asha, body=other, idempotency_key="dispute-TXN-1001")
    assert reused.status_code == 422 and reused.parsed.error.code == "idempotency_key_reused"
    bad = start_run.sync_detailed(
        client=asha, body=StartRunRequest(agent="no such agent", input_=body.input_)
    )
    assert bad.status_code == 400 and list(bad.parsed.error.fields.additional_properties) == ["agent"]

    waiting = eventually(
        lambda: get_run.sync(str(run.id), client=asha),
        lambda r: r.status == RunStatusEnum.WAITING_APPROVAL,
        what="the run to wait for approval",
    )
    assert waiting.input_.to_dict() == {"transaction_id": "TXN-1001", "amount": 12499}

    pending = list_approvals.sync(client=ravi, status=ListApprovalsStatus.PENDING, run=run.id)
    assert pending.count == 1 and pending.next_ is None
    approval = pending.results[0]
    assert approval.tool == dispute_agent["issue_refund"].name
    assert approval.arguments.to_dict() == {"transaction_id": "TXN-1001", "amount": 12499, "currency": "INR"}
    decided = approve.sync(
        str(approval.id), client=ravi, body=ApproveRequest(reason="duplicate charge verified")
    )
    assert decided.status.value == "approved" and decided.decided_by == "ravi"
    again = approve.sync_detailed(str(approval.id), client=ravi, body=ApproveRequest())
    assert (
        again.status_code == 200 and again.parsed.id == approval.id
    )  # a repeated decision is answered again
    reversed_ = deny.sync_detailed(str(approval.id), client=ravi, body=DenyRequest(reason="changed my mind"))
    assert reversed_.status_code == 409 and isinstance(reversed_.parsed, Error)
    assert reversed_.parsed.error.code in ("approval_approved", "approval_consumed")

    final = eventually(
        lambda: get_run.sync(str(run.id), client=asha),
        lambda r: r.finished_at is not None,
        what="the run to end",
    )
    assert final.status == RunStatusEnum.SUCCEEDED, final.error
    assert final.final_output == "Refunded INR 12,499."
    assert final.budget.spent_micros > 0

    steps = list_run_steps.sync(str(run.id), client=asha)
    refund = next(s for s in steps if s.tool == dispute_agent["issue_refund"].name)
    assert refund.status.value == "succeeded"
    effects = bank.effects("issue_refund")
    assert len(effects) == 1  # the side effect, counted at the bank, happened once
    assert effects[0]["idempotency_key"] == refund.idempotency_key

    usage = get_usage.sync(client=asha, days=1)
    (agent_usage,) = [a for a in usage.agents if a.agent == "dispute-agent"]
    assert agent_usage.runs == 1
    assert agent_usage.spent_micros == final.budget.spent_micros
    assert usage.days[0].spent_micros >= final.budget.spent_micros
