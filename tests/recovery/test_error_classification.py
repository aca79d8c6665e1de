"""Which errors prove that nothing happened (a failure the model is told about) and which leave
the outcome unknown (recovered per effect class). Driven in-process against real tool servers."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from budgets.models import Reservation
from llm.gateway import build_messages
from runs.models import Step
from runs.services import start_run
from tests import factories
from tests.conftest import drive
from tests.recovery.conftest import EMAIL, REFUND, events, http_bank_tool, single_call_agent
from tools.models import Tool, ToolServer

pytestmark = pytest.mark.django_db(transaction=True)


def _told(run, seq: int) -> str:
    """What the model was given for the tool step `seq` on its next call."""
    steps = list(Step.objects.filter(run=run, seq__lte=seq).order_by("seq"))
    return next(m.content for m in build_messages(run, steps) if m.role == "tool")


def _tool(tenant, bank, transport: str, remote: str, effect_class: str) -> Tool:
    if transport == "http":
        return http_bank_tool(tenant, bank, remote, effect_class=effect_class)
    tool = factories.make_bank_tools(tenant, bank.mcp_url)[remote]
    Tool.objects.filter(pk=tool.pk).update(effect_class=effect_class, timeout_seconds=5, backoff_seconds=0.5)
    tool.refresh_from_db()
    return tool


@pytest.mark.parametrize("transport", ["mcp", "http"])
def test_it_fails_a_call_the_server_refused_to_connect_and_tells_the_model(transport, tenant, asha, bank):
    email = _tool(tenant, bank, transport, "send_customer_email", "unsafe")
    single_call_agent(tenant, asha, email, EMAIL, final="could not email")
    bank.stop()  # nothing listens: the request is never sent
    run, _ = start_run(user=asha, agent="agent", input={})
    run = drive(run.pk)
    assert run.status == "succeeded" and run.final_output == "could not email"
    step = Step.objects.get(run=run, seq=2)
    assert (step.status, step.attempts) == ("failed", 1)
    assert "connect" in step.error.lower()
    assert _told(run, 2).startswith("ERROR:")
    assert not Step.objects.filter(run=run, status="outcome_unknown").exists()
    assert Reservation.objects.get(run=run, purpose="tool").status == "released"


def test_it_fails_a_call_the_provider_rejected_as_invalid(tenant, asha, bank):
    refund = http_bank_tool(tenant, bank, "issue_refund", effect_class="idempotent")
    single_call_agent(tenant, asha, refund, {"transaction_id": "TXN-1002", "amount": -5}, final="refused")
    run, _ = start_run(user=asha, agent="agent", input={})
    run = drive(run.pk)
    assert run.status == "succeeded"
    step = Step.objects.get(run=run, seq=2)
    assert (step.status, step.attempts) == ("failed", 1)
    assert "422" in step.error and "must be positive" in step.error
    assert _told(run, 2).startswith("ERROR:")
    assert bank.effects() == []


@pytest.mark.parametrize("transport", ["mcp", "http"])
def test_it_parks_an_unsafe_call_answered_with_a_5xx_after_its_effect(transport, tenant, asha, bank):
    email = _tool(tenant, bank, transport, "send_customer_email", "unsafe")
    single_call_agent(tenant, asha, email, EMAIL)
    bank.fault(tool="send_customer_email", fail_5xx_after_effect=True)
    run, _ = start_run(user=asha, agent="agent", input={})
    run = drive(run.pk)
    assert run.status == "needs_attention"
    step = Step.objects.get(run=run, seq=2)
    assert (step.status, step.attempts) == ("outcome_unknown", 1)
    assert "500" in step.error
    assert len(bank.effects("send_customer_email")) == 1
    assert Reservation.objects.get(run=run, purpose="tool").status == "held"


def test_it_retries_a_read_only_call_with_backoff_after_5xx(tenant, asha, bank):
    lookup = http_bank_tool(tenant, bank, "lookup_transaction", effect_class="read_only", backoff_seconds=0.4)
    single_call_agent(tenant, asha, lookup, {"transaction_id": "TXN-1001"})
    bank.fault(tool="lookup_transaction", fail_5xx_after_effect=True, times=2)
    run, _ = start_run(user=asha, agent="agent", input={})
    run = drive(run.pk)
    assert run.status == "succeeded"
    step = Step.objects.get(run=run, seq=2)
    assert (step.status, step.attempts) == ("succeeded", 3)
    assert step.result["structured"]["transaction_id"] == "TXN-1001"
    retries = events(run.pk, "retry_scheduled")
    delays = [float(e.message.rsplit("retry in ", 1)[1].rstrip("s")) for e in retries]
    assert len(delays) == 2 and 0.2 <= delays[0] <= 0.4 and 0.4 <= delays[1] <= 0.8  # exponential, jittered


def test_it_retries_an_idempotent_call_answered_with_a_5xx_with_the_same_key(tenant, asha, bank):
    refund = http_bank_tool(tenant, bank, "issue_refund", effect_class="idempotent")
    single_call_agent(tenant, asha, refund, REFUND)
    bank.fault(tool="issue_refund", fail_5xx_after_effect=True)
    run, _ = start_run(user=asha, agent="agent", input={})
    run = drive(run.pk)
    assert run.status == "succeeded"
    step = Step.objects.get(run=run, seq=2)
    assert (step.status, step.attempts) == ("succeeded", 2)
    effects = bank.effects("issue_refund")
    assert len(effects) == 1 and effects[0]["idempotency_key"] == step.idempotency_key
    assert step.result["structured"]["refund_id"] == effects[0]["result"]["refund_id"]


class _Busy(BaseHTTPRequestHandler):
    """Answers 503 with Retry-After until `busy` calls were refused, then 200."""

    def do_POST(self):
        server = self.server
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        server.calls.append(time.monotonic())
        busy = len(server.calls) <= server.busy
        body = json.dumps({"error": "busy"} if busy else {"ok": True}).encode()
        self.send_response(503 if busy else 200)
        if busy:
            self.send_header("Retry-After", str(server.retry_after))
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def busy_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Busy)
    server.calls, server.busy, server.retry_after = [], 1, 2
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def test_it_waits_as_long_as_retry_after_says_before_retrying(tenant, asha, busy_server):
    server = ToolServer.objects.create(
        tenant=tenant,
        name="busy",
        kind=ToolServer.Kind.HTTP,
        url=f"http://127.0.0.1:{busy_server.server_port}",
    )
    quote = Tool.objects.create(
        tenant=tenant,
        server=server,
        name="busy__quote",
        remote_name="quote",
        enabled=True,
        effect_class="read_only",
        timeout_seconds=5,
        backoff_seconds=0.1,
        input_schema={"type": "object"},
    )
    single_call_agent(tenant, asha, quote, {"symbol": "INR"})
    run, _ = start_run(user=asha, agent="agent", input={})
    run = drive(run.pk)
    assert run.status == "succeeded"
    assert Step.objects.get(run=run, seq=2).attempts == 2
    assert [e.message.endswith("retry in 2.0s") for e in events(run.pk, "retry_scheduled")] == [True]
    first, second = busy_server.calls
    assert second - first >= 2.0  # the backoff alone would have been 0.1 s


def test_it_asks_a_person_when_the_status_lookup_keeps_failing(tenant, asha, bank):
    refund = http_bank_tool(
        tenant,
        bank,
        "issue_refund",
        effect_class="reconcilable",
        max_attempts=3,
        backoff_seconds=0.2,
        status_url="http://127.0.0.1:9/status/{key}",
    )  # nothing listens
    single_call_agent(tenant, asha, refund, REFUND)
    bank.fault(tool="issue_refund", fail_5xx_after_effect=True)
    run, _ = start_run(user=asha, agent="agent", input={})
    run = drive(run.pk, max_tasks=30)
    assert run.status == "needs_attention"
    step = Step.objects.get(run=run, seq=2)
    assert (step.status, step.attempts) == ("outcome_unknown", 3)  # one call, two failed lookups
    assert len([e for e in events(run.pk, "recovery") if "status lookup for step 2 failed" in e.message]) == 2
    assert len(bank.effects("issue_refund")) == 1  # never sent again without proof
