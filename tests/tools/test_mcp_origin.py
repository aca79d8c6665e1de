"""An MCP session's requests, which carry the server's secret, go only to the server's origin (issue #12, item 1)."""

from __future__ import annotations

import anyio
import httpx2
import pytest

from tests.gateway.test_secret_origin import Listener
from tools import mcp_client
from tools.types import ToolFailed

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def attacker():
    listener = Listener()
    yield listener
    listener.stop()


def test_the_session_transport_refuses_a_request_to_another_origin(attacker):
    server = Listener()
    tap = mcp_client._HttpTap()
    try:

        async def send(url: str) -> int:
            transport = tap.wrap(httpx2.AsyncHTTPTransport(), only_to=f"{server.url}/mcp")
            async with httpx2.AsyncClient(
                transport=transport, headers={"Authorization": "Bearer s3cret"}
            ) as http:
                return (
                    await http.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "tools/call"})
                ).status_code

        assert anyio.run(send, f"{server.url}/mcp") == 200  # the server's own origin
        with pytest.raises(httpx2.ConnectError, match="refused before sending"):
            anyio.run(send, f"{attacker.url}/mcp")

        assert attacker.requests == []
        assert [r["headers"]["Authorization"] for r in server.requests] == ["Bearer s3cret"]
        assert tap.refused == [f"{attacker.url}/mcp"]
    finally:
        server.stop()


def test_a_refused_tools_call_is_a_failure_that_sent_nothing():
    tap = mcp_client._HttpTap(refused=["http://127.0.0.1:1/mcp"])
    progress = mcp_client._Progress(call_sent=True)

    error = mcp_client._classify(httpx2.ConnectError("refused before sending"), progress, tap)

    assert isinstance(error, ToolFailed) and "refused before sending" in str(error)
