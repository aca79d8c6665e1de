"""Tool servers behind the gateway: routing by server, and secrets that never leak (issue #3)."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.contrib.admin.sites import all_sites
from django.urls import reverse
from rest_framework.test import APIClient

from approvals.models import Approval
from authority.models import Delegation, ExchangedToken, IdentityProvider, SigningKey
from llm.models import ModelEndpoint
from runs.models import Run, RunEvent, RunStatus, Step, StepStatus
from runs.services import start_run
from tenants.crypto import REDACTED
from tenants.models import Secret, User
from tests import factories
from tests.conftest import drive
from tests.gateway.conftest import MODEL_KEY
from tests.servers import BankServer
from tools.models import Tool, ToolServer

pytestmark = pytest.mark.django_db(transaction=True)

CANARY = "canary-7Hq2-secret-a91f"


# --- two servers, one tool name --------------------------------------------------------------


def test_it_routes_same_named_tools_of_two_servers_to_their_own_server(tenant, asha):
    a, b = BankServer("a").start(), BankServer("b").start()
    try:
        on_a = factories.make_bank_tools(tenant, a.mcp_url, name="a")
        on_b = factories.make_bank_tools(tenant, b.mcp_url, name="b")
        for tool in (on_a["search"], on_b["search"], on_b["issue_refund"]):
            factories.grant(tool, use=[asha])
        refund = {"transaction_id": "TXN-1002", "amount": 100, "currency": "INR"}
        factories.make_agent(
            tenant,
            tools=[on_a["search"], on_b["search"], on_b["issue_refund"]],
            turns=[
                {
                    "tool_calls": [
                        {"name": "a__search", "arguments": {"query": "refund policy"}},
                        {"name": "b__search", "arguments": {"query": "refund policy"}},
                    ]
                },
                {"tool_calls": [{"name": "b__issue_refund", "arguments": refund}]},
                {"text": "ok"},
            ],
        )
        run, _ = start_run(user=asha, agent="agent", input={})

        run = drive(run.pk)

        assert run.status == RunStatus.SUCCEEDED, run.error
        steps = {s.tool_name: s for s in Step.objects.filter(run=run, kind="tool")}
        assert steps["a__search"].result["structured"]["label"] == "a"
        assert steps["b__search"].result["structured"]["label"] == "b"
        assert (
            "[a] result" in steps["a__search"].observation and "[b] result" in steps["b__search"].observation
        )
        assert [e["label"] for e in b.effects("issue_refund")] == ["b"]
        assert a.effects() == []
    finally:
        a.stop()
        b.stop()


# --- the canary secret -----------------------------------------------------------------------


class _LeakyHandler(BaseHTTPRequestHandler):
    """An http tool server that carelessly echoes the credential it was sent."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        auth = self.headers.get("Authorization", "")
        status, body = (
            (200, {"you_are": auth})
            if self.path.endswith("/whoami")
            else (400, {"error": f"rejected credential {auth}"})
        )
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def leaky_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _LeakyHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _admin_pages(client) -> dict[str, str]:
    """Every changelist and change page of the run's objects on every registered admin site."""
    pages = {}
    objects = [
        *Run.objects.all(),
        *Step.objects.all(),
        *ToolServer.objects.all(),
        *Secret.objects.all(),
        *Tool.objects.all(),
        *RunEvent.objects.all()[:20],
        *Approval.objects.all(),
        *ModelEndpoint.objects.all(),
        *SigningKey.objects.all(),
        *Delegation.objects.all(),
        *IdentityProvider.objects.all(),
        *ExchangedToken.objects.all(),
    ]
    for site in all_sites:
        listed = set()
        for obj in objects:
            model = type(obj)
            if model not in site._registry:
                continue
            prefix = f"{site.name}:{model._meta.app_label}_{model._meta.model_name}"
            urls = [reverse(f"{prefix}_change", args=[obj.pk])]
            if model not in listed:
                listed.add(model)
                urls.append(reverse(f"{prefix}_changelist"))
            for url in urls:
                response = client.get(url)
                if response.status_code == 404:
                    continue
                assert response.status_code == 200, (url, response.status_code)
                pages[url] = response.content.decode()
    return pages


def test_it_keeps_a_secret_out_of_requests_steps_events_logs_api_and_admin(
    tenant, asha, builtins, claude, leaky_server, caplog
):
    caplog.set_level(logging.DEBUG)
    secret = Secret(tenant=tenant, name="bank-token")
    secret.set_value(CANARY)
    secret.save()
    bank = BankServer("bank", "--require-token", CANARY).start()
    try:
        bank_tools = factories.make_bank_tools(
            tenant, bank.mcp_url, secret=secret
        )  # lists only with the token
        hr = ToolServer.objects.create(
            tenant=tenant, name="hr", kind=ToolServer.Kind.HTTP, url=leaky_server, secret=secret
        )
        leaky = [
            Tool.objects.create(
                tenant=tenant,
                server=hr,
                name=f"hr__{name}",
                remote_name=name,
                input_schema={"type": "object"},
                enabled=True,
                effect_class="read_only",
            )
            for name in ("whoami", "refuse")
        ]
        tools = [bank_tools["lookup_transaction"], *leaky, builtins["echo"], builtins["sleep"]]
        for tool in tools:
            factories.grant(tool, use=[asha])
        factories.make_agent(
            tenant, endpoint=ModelEndpoint.objects.get(tenant=tenant, name="claude"), tools=tools
        )
        claude.queue(
            {
                "tool_calls": [
                    {"name": "bank__lookup_transaction", "arguments": {"transaction_id": "TXN-1001"}},
                    {"name": "hr__whoami", "arguments": {}},
                    {"name": "hr__refuse", "arguments": {}},
                ]
            },
            # A model that somehow holds the secret tries to echo it and to smuggle it in arguments.
            {
                "tool_calls": [
                    {"name": "platform__echo", "arguments": {"note": f"the token is {CANARY}"}},
                    {"name": "platform__sleep", "arguments": {"seconds": CANARY}},
                ]
            },
            {"text": f"All done ({CANARY})."},
        )
        run, _ = start_run(user=asha, agent="agent", input={"transaction_id": "TXN-1001"})

        run = drive(run.pk)

        assert run.status == RunStatus.SUCCEEDED, run.error
        steps = {s.tool_name: s for s in Step.objects.filter(run=run, kind="tool")}
        # The credential did its job: the bank answered, the leaky server saw it.
        assert steps["bank__lookup_transaction"].status == StepStatus.SUCCEEDED
        assert steps["bank__lookup_transaction"].result["structured"]["amount"] == 12499
        assert steps["hr__whoami"].result["structured"] == {"you_are": f"Bearer {REDACTED}"}
        assert steps["hr__whoami"].observation == json.dumps({"you_are": f"Bearer {REDACTED}"})
        assert steps["hr__refuse"].status == StepStatus.FAILED and REDACTED in steps["hr__refuse"].error
        assert REDACTED in steps["platform__echo"].observation
        assert steps["platform__sleep"].status == StepStatus.DENIED

        places = {"model requests on the wire": json.dumps(claude.requests)}
        for step in Step.objects.filter(run=run):
            places[f"step {step.seq}"] = json.dumps(
                [step.tool_name, step.arguments, step.request, step.result, step.observation, step.error]
            )
        places["events"] = json.dumps([[e.message, e.data] for e in RunEvent.objects.filter(run=run)])
        places["run"] = json.dumps([run.final_output, run.error, run.input])
        places["logs"] = caplog.text + "".join(str(r.args) for r in caplog.records)
        api = APIClient()
        api.force_authenticate(asha)
        for path in (
            f"/v1/runs/{run.pk}",
            f"/v1/runs/{run.pk}/steps",
            f"/v1/runs/{run.pk}/events",
            "/v1/runs",
        ):
            response = api.get(path)
            assert response.status_code == 200
            places[path] = response.content.decode()
        operator = User.objects.create_superuser(username="ops", password="pw")
        web = APIClient()
        web.force_login(operator)
        admin_pages = _admin_pages(web)
        assert any(f"/runs/run/{run.pk}/" in url for url in admin_pages)
        places.update(admin_pages)

        leaks = [where for where, text in places.items() if CANARY in text or MODEL_KEY in text]
        assert not leaks, f"secrets leaked into: {', '.join(leaks)}"
        assert REDACTED in places["model requests on the wire"]
        assert any("HTTP Request" in r.getMessage() for r in caplog.records)  # logging was captured
    finally:
        bank.stop()
