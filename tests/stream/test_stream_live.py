"""A real SSE client follows runs on a real uvicorn process while real Celery workers run them."""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time

import httpx
import pytest

from runs.models import Run, RunEvent
from runs.services import start_run
from tenants.tokens import issue_token
from tests import factories
from tests.conftest import drive
from tests.recovery.conftest import FAST_LEASES, REFUND, single_call_agent, step_of, until_status
from tests.servers import ROOT, wait_for
from tests.stream.sse import ApiServer, Stream, follow
from tools.models import Tool

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def api():
    server = ApiServer(RUN_STREAM_HEARTBEAT_SECONDS="0.5").start()
    yield server
    server.stop()


def dispute_agent(tenant, asha, ravi, bank):
    """The dispute story, short: look the charge up, refund it (a supervisor approves), answer."""
    tools = factories.make_bank_tools(tenant, bank.mcp_url)
    for key in ("lookup_transaction", "issue_refund"):
        factories.grant(tools[key], use=[asha])
    factories.grant(tools["issue_refund"], approve=[ravi])
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
            {"text": "The duplicate charge of INR 12,499 was refunded."},
        ],
    )


def in_background(target) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run():
        try:
            box["value"] = target()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def result_of(thread, box, timeout: float = 90):
    thread.join(timeout)
    assert not thread.is_alive(), "the stream did not end"
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_a_client_sees_every_event_of_a_dispute_run_once_in_order_and_resumes_without_gaps(
    tenant, asha, ravi, bank, workers, api
):
    dispute_agent(tenant, asha, ravi, bank)
    workers("w1")
    http = httpx.Client(base_url=api.url, timeout=httpx.Timeout(30, read=10))
    token = issue_token(user=asha).token
    auth = {"Authorization": f"Bearer {token}"}
    started = http.post(
        "/v1/runs",
        json={"agent": "dispute-agent", "input": {"transaction_id": "TXN-1001", "amount": 12499}},
        headers={**auth, "Idempotency-Key": "stream-1"},
    )
    assert started.status_code == 201, started.text
    run_id = started.json()["id"]
    url = f"/v1/runs/{run_id}/stream"

    # One client follows the whole run; another drops after three events and comes back.
    whole, whole_box = in_background(lambda: follow(http, url, headers=auth))
    first = follow(http, url, headers=auth, until=lambda s: len(s.events) == 3)
    wait_for(lambda: Run.objects.get(pk=run_id).status == "waiting_approval", what="approval wait")
    rest_thread, rest_box = in_background(
        lambda: follow(http, url, headers={**auth, "Last-Event-ID": str(first.events[-1].id)})
    )
    time.sleep(1.5)  # the supervisor takes a moment: the streams wait with nothing to send (heartbeat: 0.5 s)
    supervisor = {"Authorization": f"Token {issue_token(user=ravi).token}"}
    pending = http.get("/v1/approvals?status=pending", headers=supervisor).json()["results"]
    decided = http.post(
        f"/v1/approvals/{pending[0]['id']}/approve", json={"reason": "ok"}, headers=supervisor
    )
    assert decided.status_code == 200, decided.text

    stream: Stream = result_of(whole, whole_box)
    rest: Stream = result_of(rest_thread, rest_box)
    stored = http.get(f"/v1/runs/{run_id}/events", headers=auth).json()
    assert Run.objects.get(pk=run_id).status == "succeeded"
    assert stream.status == 200 and stream.content_type == "text/event-stream"
    # Every event exactly once, in seq order, each as the events endpoint shows it.
    assert [m.id for m in stream.events] == list(range(1, len(stored) + 1))
    assert [m.data for m in stream.events] == stored
    assert [m.event for m in stream.events] == [e["kind"] for e in stored]
    assert any(e["kind"] == "approval" or "approv" in e["message"] for e in stored)
    assert stream.end.data == {"status": "succeeded", "last_event_id": len(stored)}
    assert stream.messages[-1].event == "end" and stream.retry == 1000
    # The client that dropped got the rest, exactly: nothing missed, nothing twice.
    assert [m.id for m in first.events] == [1, 2, 3]
    assert [m.data for m in first.events + rest.events] == stored
    assert rest.end.data["status"] == "succeeded"
    # The run waited for a person with the stream open: heartbeats kept it alive.
    assert stream.heartbeats > 0
    # After the end: a reconnect from any point gets exactly what follows, then the end at once.
    again = follow(http, f"{url}?after={len(stored) - 2}", headers=auth)
    assert [m.data for m in again.events] == stored[-2:] and again.end is not None
    header_wins = follow(http, f"{url}?after=1", headers={**auth, "Last-Event-ID": str(len(stored))})
    assert header_wins.events == [] and header_wins.end.data["last_event_id"] == len(stored)
    assert len(bank.effects("issue_refund")) == 1


def test_an_open_stream_keeps_delivering_across_a_worker_killed_mid_run(tenant, asha, bank, workers, api):
    tool = factories.make_bank_tools(tenant, bank.mcp_url)["issue_refund"]
    Tool.objects.filter(pk=tool.pk).update(timeout_seconds=5, effect_class="idempotent")
    tool.refresh_from_db()
    single_call_agent(tenant, asha, tool, REFUND, final="refunded")
    bank.fault(tool="issue_refund", delay_after_effect=30)  # applied, but the answer never comes back
    w1 = workers("w1", env=FAST_LEASES)
    http = httpx.Client(base_url=api.url, timeout=httpx.Timeout(30, read=10))
    auth = {"Authorization": f"Bearer {issue_token(user=asha).token}"}
    run_id = http.post("/v1/runs", json={"agent": "agent", "input": {}}, headers=auth).json()["id"]
    thread, box = in_background(lambda: follow(http, f"/v1/runs/{run_id}/stream", headers=auth))

    wait_for(lambda: bank.effects("issue_refund"), timeout=30, interval=0.05, what="refund applied")
    w1.kill()  # SIGKILL mid-call: no cleanup, no ack
    workers("w2", env=FAST_LEASES)
    until_status(run_id, "succeeded", "failed", "needs_attention", timeout=60)

    stream: Stream = result_of(thread, box)
    stored = http.get(f"/v1/runs/{run_id}/events", headers=auth).json()
    assert [m.id for m in stream.events] == list(range(1, len(stored) + 1))
    assert [m.data for m in stream.events] == stored
    assert any(m.event == "recovery" for m in stream.events)  # the takeover is in the stream too
    assert stream.end.data == {"status": "succeeded", "last_event_id": len(stored)}
    assert step_of(run_id, 2).attempts == 2 and len(bank.effects("issue_refund")) == 1


def test_the_curl_example_in_the_api_docs_prints_the_run_as_events_then_the_end(tenant, asha, builtins, api):
    docs = (ROOT / "docs" / "api.md").read_text()
    section = docs[docs.index("## Run stream (server-sent events)") :]
    command = next(line for line in section.splitlines() if line.startswith("curl -N"))
    factories.make_agent(tenant, tools=[builtins["echo"]], turns=[{"text": "hi"}])
    run, _ = start_run(user=asha, agent="agent", input={"q": "hello"})
    drive(run.pk)
    env = {
        "PATH": os.environ["PATH"],
        "TOKEN": issue_token(user=asha).token,
        "BASE": api.url,
        "RUN": str(run.pk),
    }

    printed = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=30)

    assert printed.returncode == 0, printed.stderr
    stored = list(RunEvent.objects.filter(run=run).order_by("seq").values_list("seq", "kind"))
    assert re.findall(r"^id: (\d+)\nevent: (\w+)$", printed.stdout, re.M) == [(str(s), k) for s, k in stored]
    assert printed.stdout.endswith(
        f'event: end\ndata: {{"status": "succeeded", "last_event_id": {len(stored)}}}\n\n'
    )
    print(printed.stdout)
