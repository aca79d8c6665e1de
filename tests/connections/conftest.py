from __future__ import annotations

from urllib.parse import urlparse

import pytest
from rest_framework.test import APIClient

from tests import factories
from tests.oauth_servers import OAuthServers
from tools.models import Tool, ToolServer

PASSWORDS = {"asha": "asha-password", "ravi": "ravi-password"}


@pytest.fixture
def oauth_bank():
    servers = OAuthServers().start()
    yield servers
    servers.stop()


def statements_tool(tenant, mcp_url: str, users=()) -> Tool:
    """The protected server's one tool, configured as apply would after a reviewer enabled it (its
    list is not readable without a user's token, so it is not synced here)."""
    server = ToolServer.objects.create(
        tenant=tenant,
        name="cards",
        kind=ToolServer.Kind.MCP,
        transport=ToolServer.Transport.STREAMABLE_HTTP,
        url=mcp_url,
    )
    tool = Tool.objects.create(
        tenant=tenant,
        server=server,
        name="cards__list_statements",
        remote_name="list_statements",
        input_schema={"type": "object", "properties": {"month": {"type": "string"}}},
        enabled=True,
        effect_class="read_only",
        timeout_seconds=10,
        price_micros=1000,
    )
    factories.grant(tool, use=list(users))
    return tool


def statements_agent(tenant, tool: Tool, *, calls: int = 1):
    turns = [
        {"tool_calls": [{"name": tool.name, "arguments": {"month": f"2026-{i + 1:02d}"}}]}
        for i in range(calls)
    ]
    return factories.make_agent(tenant, name="cards-agent", tools=[tool], turns=[*turns, {"text": "done"}])


def connect(user, servers: OAuthServers, *, client: APIClient | None = None) -> dict:
    """The user connects the server: the API's authorization URL, the browser's sign-in, the callback."""
    api = client or APIClient()
    if client is None:
        api.force_authenticate(user)
    started = api.post("/v1/connections", {"server": "cards"}, format="json")
    assert started.status_code == 201, started.content
    back = servers.sign_in(started.json()["authorization_url"], user.username, PASSWORDS[user.username])
    parsed = urlparse(back)
    answered = APIClient().get(f"{parsed.path}?{parsed.query}")
    assert answered.status_code == 200, answered.content
    return answered.json()
