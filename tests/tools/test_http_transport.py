"""HTTP tools share one client per worker process: connections are kept alive between calls, and
nothing one call received (a cookie) travels with another tenant's call."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from runs.models import RunStatus, Step, StepStatus
from runs.services import start_run
from tests import factories
from tests.conftest import drive
from tools.models import Tool, ToolServer

pytestmark = pytest.mark.django_db(transaction=True)


class KeepAliveServer:
    """An HTTP/1.1 server on 127.0.0.1 that sets a session cookie on every answer and records,
    per request, the client's port (one port per TCP connection) and the Cookie it was sent."""

    def __init__(self):
        self.seen: list[dict] = []
        seen = self.seen

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as real servers do

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                seen.append({"port": self.client_address[1], "cookie": self.headers.get("Cookie")})
                payload = json.dumps({"ok": True}).encode()
                self.send_response(200)
                self.send_header("Set-Cookie", "session=first-callers-session; Path=/")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def crm():
    server = KeepAliveServer()
    yield server
    server.stop()


def _agent_calling(tenant, user, url: str, calls: int) -> None:
    server = ToolServer.objects.create(tenant=tenant, name="crm", kind=ToolServer.Kind.HTTP, url=url)
    tool = Tool.objects.create(
        tenant=tenant,
        server=server,
        name="crm__lookup",
        remote_name="lookup",
        input_schema={"type": "object"},
        enabled=True,
        effect_class="read_only",
    )
    factories.grant(tool, use=[user])
    turns = [{"tool_calls": [{"name": tool.name, "arguments": {"n": n}}]} for n in range(calls)]
    factories.make_agent(tenant, tools=[tool], turns=[*turns, {"text": "done"}])


def test_a_cookie_a_server_sets_never_rides_on_a_later_call_of_any_tenant(tenant, asha, crm):
    other = factories.make_tenant("globex")
    bob = factories.make_user(other, "bob")
    _agent_calling(tenant, asha, crm.url, calls=2)
    _agent_calling(other, bob, crm.url, calls=2)

    for user in (asha, bob):
        run, _ = start_run(user=user, agent="agent", input={})
        run = drive(run.pk)
        assert run.status == RunStatus.SUCCEEDED, run.error
        assert Step.objects.filter(run=run, kind="tool", status=StepStatus.SUCCEEDED).count() == 2

    assert len(crm.seen) == 4
    assert [r["cookie"] for r in crm.seen] == [None, None, None, None]


def test_calls_to_one_server_reuse_a_kept_alive_connection(tenant, asha, crm):
    _agent_calling(tenant, asha, crm.url, calls=5)

    run, _ = start_run(user=asha, agent="agent", input={})
    run = drive(run.pk)

    assert run.status == RunStatus.SUCCEEDED, run.error
    assert len(crm.seen) == 5
    # A client per call opened a connection per call; calls in quick succession now share one.
    assert len({r["port"] for r in crm.seen}) < 5
