"""An MCP tool that answers a file: an embedded resource, or a resource link the platform reads
back from the same server (resources/read), becomes an artifact of the step; the model sees its
description and id. A local MCP server on 127.0.0.1 counts the reads it served."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import mcp_types as types
import pytest
import uvicorn
from mcp.server.lowlevel import Server

from artifacts.models import Artifact
from artifacts.services import content_of
from runs.models import Step
from runs.services import start_run
from tests import factories
from tests.conftest import drive
from tests.servers import wait_for
from tools.catalog import refresh
from tools.mcp_client import call_tool
from tools.models import Tool, ToolServer
from tools.types import McpServerConfig

CARD = "txn_id,amount\nT1,100\nT2,250\n"
LEDGER = "txn_id,amount\nT1,100\n"


def build(reads: list[str]) -> Server[Any]:
    async def on_list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        schema = {"type": "object", "properties": {}}
        return types.ListToolsResult(tools=[types.Tool(name="export", input_schema=schema)])

    async def on_call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        return types.CallToolResult(
            content=[
                types.TextContent(text="exported 2 files"),
                types.EmbeddedResource(
                    resource=types.TextResourceContents(
                        uri="bank://exports/card.csv", mime_type="text/csv", text=CARD
                    )
                ),
                types.ResourceLink(name="ledger", uri="bank://exports/ledger.csv", mime_type="text/csv"),
                types.ResourceLink(name="gone", uri="bank://exports/gone.csv", mime_type="text/csv"),
            ]
        )

    async def on_read_resource(ctx: Any, params: types.ReadResourceRequestParams) -> types.ReadResourceResult:
        reads.append(str(params.uri))
        if str(params.uri).endswith("gone.csv"):
            raise ValueError("no such export")
        return types.ReadResourceResult(
            contents=[types.TextResourceContents(uri=params.uri, mime_type="text/csv", text=LEDGER)]
        )

    return Server(
        "files",
        version="1.0",
        on_list_tools=on_list_tools,
        on_call_tool=on_call_tool,
        on_read_resource=on_read_resource,
    )


@pytest.fixture
def files_server() -> Iterator[tuple[str, list[str]]]:
    reads: list[str] = []
    app = build(reads).streamable_http_app(streamable_http_path="/mcp")
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1, lifespan="on")
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=20)
    yield f"http://127.0.0.1:{port}/mcp", reads
    server.should_exit = True
    thread.join(10)


def test_the_client_returns_embedded_and_linked_files_and_keeps_an_unreadable_link(files_server):
    url, reads = files_server
    result = call_tool(
        McpServerConfig(transport="streamable_http", url=url), "export", {}, idempotency_key="k1", timeout=10
    )
    assert [(f.uri, f.media_type, f.content) for f in result.files] == [
        ("bank://exports/card.csv", "text/csv", CARD.encode()),
        ("bank://exports/ledger.csv", "text/csv", LEDGER.encode()),
    ]
    assert reads == ["bank://exports/ledger.csv", "bank://exports/gone.csv"]
    assert "exported 2 files" in result.text and "[resource link: bank://exports/gone.csv]" in result.text
    assert CARD not in result.text


@pytest.mark.django_db(transaction=True)
def test_an_mcp_tools_files_become_artifacts_the_model_sees_described(files_server, tenant, asha):
    url, _ = files_server
    server = ToolServer.objects.create(
        tenant=tenant,
        name="files",
        kind=ToolServer.Kind.MCP,
        transport=ToolServer.Transport.STREAMABLE_HTTP,
        url=url,
    )
    refresh(server)
    tool = Tool.objects.get(server=server, remote_name="export")
    Tool.objects.filter(pk=tool.pk).update(enabled=True, effect_class="read_only", timeout_seconds=10)
    factories.grant(tool, use=[asha])
    factories.make_agent(
        tenant, tools=[tool], turns=[{"tool_calls": [{"name": tool.name, "arguments": {}}]}, {"text": "done"}]
    )
    run, _ = start_run(user=asha, agent="agent", input={})
    run = drive(run.pk)
    assert run.status == "succeeded"
    step = Step.objects.get(run=run, tool_name=tool.name)
    stored = {a.name: a for a in Artifact.objects.filter(run=run, step=step)}
    assert set(stored) == {"card.csv", "ledger.csv"}
    assert content_of(stored["card.csv"]) == CARD.encode() and stored["card.csv"].source == "tool"
    assert f"artifact {stored['ledger.csv'].pk}: ledger.csv (text/csv" in step.observation
    assert "T2,250" in step.observation  # the first lines of the description, not a whole export
    assert [f["name"] for f in step.result["structured"]["files"]] == ["card.csv", "ledger.csv"]
