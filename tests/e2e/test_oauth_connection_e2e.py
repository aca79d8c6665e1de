"""Issue 25, done when (3): a run that needs the user's OAuth connection to an MCP server waits, the
user connects (the authorization code flow against a real authorization server, followed the way a
browser would), the run resumes by itself on a real worker and finishes; a revoked connection
denies the next call."""

from __future__ import annotations

import httpx
import pytest
from rest_framework.test import APIClient

from notifications.models import Delivery, Event, Webhook
from notifications.services import scan
from runs.models import Run, RunStatus, Step, StepStatus
from tests import factories
from tests.connections.conftest import statements_tool
from tests.oauth_servers import OAuthServers
from tests.servers import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def _status(run_id) -> str:
    return Run.objects.values_list("status", flat=True).get(pk=run_id)


def test_a_run_waits_for_the_connection_resumes_on_a_worker_and_a_revoke_denies_the_next_call(
    tenant, asha, ravi, workers, live_server, settings
):
    servers = OAuthServers().start()
    platform = httpx.Client(base_url=live_server.url, timeout=20)
    try:
        settings.PUBLIC_BASE_URL = live_server.url
        workers("w1", env={"PUBLIC_BASE_URL": live_server.url})
        hook = Webhook(
            tenant=tenant,
            name="desk",
            url="http://127.0.0.1:9/hook",
            events=[Event.RUN_WAITING_AUTHORIZATION],
        )
        hook.set_signing_secret("whsec-test")
        hook.save()
        tool = statements_tool(tenant, servers.mcp_url, users=[asha])
        # The second month's statements need a supervisor's approval: the run waits there, and
        # asha disconnects meanwhile.
        tool.approval_policy = (
            '@approval("February\'s statements wait for a supervisor")\n'
            f'permit (principal, action == Action::"{tool.name}", resource)\n'
            'when { !(context.arguments has month && context.arguments.month != "2026-02") };'
        )
        tool.save()
        factories.grant(tool, approve=[ravi])
        factories.make_agent(
            tenant,
            name="cards-agent",
            tools=[tool],
            turns=[
                {"tool_calls": [{"name": tool.name, "arguments": {"month": "2026-01"}}]},
                {"tool_calls": [{"name": tool.name, "arguments": {"month": "2026-02"}}]},
                {"text": "done"},
            ],
        )
        token = platform.post("/v1/auth/token", json={"username": "asha", "password": "pw"}).json()["token"]
        platform.headers["Authorization"] = f"Bearer {token}"

        started = platform.post(
            "/v1/runs", json={"agent": "cards-agent", "input": {}}, headers={"Idempotency-Key": "r1"}
        )
        assert started.status_code == 201, started.text
        run_id = started.json()["id"]

        wait_for(lambda: _status(run_id) == RunStatus.WAITING_AUTHORIZATION, what="the run to wait for asha")
        events = platform.get(f"/v1/runs/{run_id}/events").json()
        link = next(
            e["data"]["connect_url"] for e in events if e.get("data", {}).get("to") == "waiting_authorization"
        )
        assert link == f"{live_server.url}/admin/connections/connection/connect/{tool.server_id}/"
        scan()
        delivery = Delivery.objects.get(webhook=hook, event=Event.RUN_WAITING_AUTHORIZATION)
        assert delivery.payload["connect_url"] == link and delivery.payload["user"] == "asha"
        assert servers.calls() == []

        # asha connects, as the console does: the authorization URL from the API, then her browser.
        authorization_url = platform.post("/v1/connections", json={"server": "cards"}).json()[
            "authorization_url"
        ]
        assert "code_challenge_method=S256" in authorization_url and "resource=" in authorization_url
        with httpx.Client(follow_redirects=True, timeout=20) as browser:
            sign_in = browser.get(authorization_url)
            request = sign_in.url.params["request"]
            back = browser.post(
                f"{servers.issuer}/login",
                data={"request": request, "username": "asha", "password": "asha-password"},
            )
        assert back.status_code == 200 and str(back.url).startswith(
            f"{live_server.url}/v1/connections/callback"
        )
        assert back.json() == {
            "connected": True,
            "server": "cards",
            "scopes": "statements:read",
            "runs_resumed": 1,
        }

        wait_for(
            lambda: _status(run_id) == RunStatus.WAITING_APPROVAL, what="the first call, then the approval"
        )
        assert [(c["subject"], c["resource"]) for c in servers.calls()] == [("asha", servers.mcp_url)]

        (connection,) = platform.get("/v1/connections").json()
        assert platform.delete(f"/v1/connections/{connection['id']}").json()["status"] == "revoked"
        supervisor = APIClient()
        supervisor.force_authenticate(ravi)
        (approval,) = supervisor.get("/v1/approvals").json()["results"]
        assert (
            supervisor.post(
                f"/v1/approvals/{approval['id']}/approve", {"reason": "ok"}, format="json"
            ).status_code
            == 200
        )

        wait_for(lambda: _status(run_id) == RunStatus.SUCCEEDED, what="the run to finish")
        (second,) = [  # found in Python: the arguments are sealed at rest
            s
            for s in Step.objects.filter(run_id=run_id, kind="tool")
            if (s.arguments or {}).get("month") == "2026-02"
        ]
        assert second.status == StepStatus.DENIED and "revoked" in second.error
        assert len(servers.calls()) == 1  # the revoked connection sent nothing
    finally:
        platform.close()  # its kept-alive connection would hold a server thread's database session
        servers.stop()
