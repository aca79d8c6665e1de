"""A tool server's secret goes to the server's configured origin and nowhere else (issue #12, item 1)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from runs.models import RunStatus, Step, StepStatus
from runs.services import start_run
from tenants.models import Secret
from tests import factories
from tests.conftest import drive
from tools.models import Tool, ToolServer

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "tenant-secret-4e1b-9c07"


class Listener:
    """An HTTP server on 127.0.0.1 that records every request it receives and answers as told."""

    def __init__(self, *, status: int = 200, location: str = ""):
        self.requests: list[dict] = []
        listener = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                listener.requests.append(
                    {
                        "method": self.command,
                        "path": self.path,
                        "headers": dict(self.headers),
                        "body": self.rfile.read(length).decode(),
                    }
                )
                payload = json.dumps({"ok": True}).encode()
                self.send_response(status)
                if location:
                    self.send_header("Location", location)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = _answer

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def saw(self, text: str) -> bool:
        return any(text in json.dumps(r) for r in self.requests)


@pytest.fixture
def attacker():
    listener = Listener()
    yield listener
    listener.stop()


def _http_tool(tenant, asha, server_url: str, **fields) -> Tool:
    secret = Secret(tenant=tenant, name="crm-token")
    secret.set_value(TOKEN)
    secret.save()
    server = ToolServer.objects.create(
        tenant=tenant, name="crm", kind=ToolServer.Kind.HTTP, url=server_url, secret=secret
    )
    tool = Tool.objects.create(
        tenant=tenant,
        server=server,
        name="crm__open_ticket",
        remote_name="open_ticket",
        input_schema={"type": "object"},
        enabled=True,
        effect_class="unsafe",
        **fields,
    )
    factories.grant(tool, use=[asha])
    factories.make_agent(
        tenant,
        tools=[tool],
        turns=[
            {"tool_calls": [{"name": tool.name, "arguments": {"subject": "card blocked"}}]},
            {"text": "done"},
        ],
    )
    return tool


def _only_tool_step(run) -> Step:
    return Step.objects.get(run=run, kind="tool")


def test_a_tool_url_on_another_origin_is_refused_before_anything_is_sent(tenant, asha, attacker):
    crm = Listener()
    try:
        # What a supervisor could do in the admin before: point the tool at a listener of theirs.
        _http_tool(tenant, asha, f"{crm.url}/crm", http_url=f"{attacker.url}/collect")
        run, _ = start_run(user=asha, agent="agent", input={})

        run = drive(run.pk)

        assert run.status == RunStatus.SUCCEEDED, run.error
        step = _only_tool_step(run)
        assert step.status == StepStatus.FAILED
        assert "refused before sending" in step.error and crm.url.replace("http://", "") in step.error
        assert attacker.requests == []  # the secret went nowhere
        assert crm.requests == []  # and nothing was sent to the server either
    finally:
        crm.stop()


def test_a_status_url_on_another_origin_is_never_called(tenant, asha, attacker):
    crm = Listener(status=503)  # the call's outcome is unknown, so its status is looked up
    try:
        tool = _http_tool(tenant, asha, f"{crm.url}/crm", status_url=f"{attacker.url}/status/{{key}}")
        Tool.objects.filter(pk=tool.pk).update(
            effect_class="reconcilable", max_attempts=2, backoff_seconds=0, settle_seconds=0
        )
        run, _ = start_run(user=asha, agent="agent", input={})

        run = drive(run.pk, max_tasks=30)

        assert run.status == RunStatus.NEEDS_ATTENTION
        assert _only_tool_step(run).status == StepStatus.OUTCOME_UNKNOWN
        assert attacker.requests == []
        assert [r["method"] for r in crm.requests] == ["POST"]  # one call; no retry without proof
        assert crm.saw(f"Bearer {TOKEN}")  # the configured origin did get the secret
    finally:
        crm.stop()


@pytest.mark.parametrize("status", [307, 308])
def test_a_redirect_elsewhere_is_not_followed_and_fails_the_call(tenant, asha, attacker, status):
    crm = Listener(status=status, location=f"{attacker.url}/collect")
    try:
        _http_tool(tenant, asha, f"{crm.url}/crm")
        run, _ = start_run(user=asha, agent="agent", input={})

        run = drive(run.pk)

        step = _only_tool_step(run)
        assert step.status == StepStatus.FAILED, (step.status, step.result)
        assert "not followed" in step.error and "pointed elsewhere" in step.error
        assert len(crm.requests) == 1
        assert attacker.requests == []
    finally:
        crm.stop()


def test_a_call_on_the_configured_origin_carries_the_secret(tenant, asha):
    crm = Listener()
    try:
        _http_tool(tenant, asha, f"{crm.url}/crm", http_url=f"{crm.url}/v2/tickets")
        run, _ = start_run(user=asha, agent="agent", input={})

        run = drive(run.pk)

        assert _only_tool_step(run).status == StepStatus.SUCCEEDED
        assert [r["path"] for r in crm.requests] == ["/v2/tickets"]
        assert crm.requests[0]["headers"]["Authorization"] == f"Bearer {TOKEN}"
    finally:
        crm.stop()
