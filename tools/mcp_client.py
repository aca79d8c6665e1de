"""Synchronous MCP client for the tool gateway (official `mcp` SDK v2, called from worker threads).

Every call opens its own connection and event loop (`anyio.run`), so concurrent calls from
many threads share nothing.

Protocol versions: the client uses the SDK's `mode="legacy"` handshake (`initialize`, then
`Mcp-Session-Id` on streamable HTTP). It offers `2025-11-25` (SDK `LATEST_HANDSHAKE_VERSION`)
and accepts a server's counter-offer of any of `2024-11-05`, `2025-03-26`, `2025-06-18`,
`2025-11-25` (SDK `HANDSHAKE_PROTOCOL_VERSIONS`); anything else fails the handshake. The SDK
also knows the stateless `2026-07-28` era (`server/discover`, no handshake), which its default
`mode="auto"` would probe for first; we do not use it.

Error contract for `call_tool`:
- `ToolFailed`: `tools/call` provably did not run: the handshake failed (connection refused,
  HTTP 4xx, bad protocol version, timeout), the `tools/call` POST could not connect
  or got a non-404 4xx, or the server answered with a JSON-RPC rejection (invalid params,
  unknown tool, method not found, ...), or it was refused before sending because its URL was
  not on the server's configured origin (the session's headers carry the server's secret).
  `ToolUnauthorized` (a `ToolFailed`) when the handshake or the `tools/call` POST met HTTP 401:
  the credential was refused and the tool did not run (`list_tools` raises it on a 401 too).
- `ToolOutcomeUnknown`: the request may have been processed: timeout after sending, connection
  reset / stream closed, HTTP 5xx, 404 (session lost), JSON-RPC internal or unrecognised errors.
- `ToolResult(is_error=True)`: the tool ran and reported a failure (`isError: true`).
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
import httpx2
import mcp_types as mt
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from tools.origins import same_origin
from tools.types import (
    IDEMPOTENCY_META_KEY,
    McpServerConfig,
    RemoteTool,
    ToolFailed,
    ToolFile,
    ToolOutcomeUnknown,
    ToolResult,
    ToolUnauthorized,
)

logger = logging.getLogger(__name__)

ANNOTATION_KEYS = ("readOnlyHint", "destructiveHint", "idempotentHint", "openWorldHint")
MAX_TOOL_PAGES = 100

# JSON-RPC errors that mean "the server refused the request". Everything else (INTERNAL_ERROR,
# REQUEST_TIMEOUT, CONNECTION_CLOSED, PARSE_ERROR - which the SDK also synthesises for a garbled
# response - and server-defined codes) leaves the outcome open.
REJECTION_CODES = frozenset(
    {
        mt.INVALID_PARAMS,
        mt.METHOD_NOT_FOUND,
        mt.INVALID_REQUEST,
        mt.HEADER_MISMATCH,
        mt.UNSUPPORTED_PROTOCOL_VERSION,
        mt.MISSING_REQUIRED_CLIENT_CAPABILITY,
        mt.URL_ELICITATION_REQUIRED,
    }
)

# Extra wall-clock allowance on top of the per-request timeout for connect, teardown and
# stdio process start/stop, so a wedged transport cannot hang a worker forever.
HARD_DEADLINE_SLACK = 15.0

_T = TypeVar("_T")


# --- public API -------------------------------------------------------------------------


def list_tools(config: McpServerConfig, *, timeout: float = 30) -> list[RemoteTool]:
    """All tools the server lists (every page). Any failure raises ToolFailed: listing has no effect."""
    tap = _HttpTap()
    try:
        return _run(_list_tools(config, timeout, tap), timeout)
    except ToolFailed:
        raise
    except Exception as exc:
        if 401 in tap.statuses.values():
            raise ToolUnauthorized(
                f"the MCP server asks for authorization (HTTP 401), tools not listed{tap.note()}",
                challenge=tap.challenge,
            ) from exc
        raise ToolFailed(f"tools/list failed{tap.note()}: {_describe(exc)}") from exc


def call_tool(
    config: McpServerConfig,
    name: str,
    arguments: dict,
    *,
    idempotency_key: str,
    timeout: float,
    meta: dict | None = None,
) -> ToolResult:
    """Call one tool, sending `idempotency_key` (and `meta`: the user's authority) in the request
    `_meta`; see the module docstring."""
    tap = _HttpTap()
    progress = _Progress()
    meta = {**(meta or {}), IDEMPOTENCY_META_KEY: idempotency_key}
    try:
        result = _run(_call_tool(config, name, arguments, meta, timeout, tap, progress), timeout)
    except (ToolFailed, ToolOutcomeUnknown):
        raise
    except Exception as exc:
        raise _classify(exc, progress, tap) from exc
    return normalise_result(result, progress.linked)


def normalise_result(result: mt.CallToolResult, linked: dict[str, ToolFile] | None = None) -> ToolResult:
    """The result as the platform keeps it. Embedded resources, and the resource links read back
    from the server (`linked`, by URI), become files (stored as artifacts by the transport, which
    adds each one's description); the text names them, never carries their content."""
    linked = linked or {}
    files = [_embedded_file(b) for b in result.content if isinstance(b, mt.EmbeddedResource)]
    files += [linked[b.uri] for b in result.content if isinstance(b, mt.ResourceLink) and b.uri in linked]
    parts = [_block_text(block) for block in result.content]
    structured = result.structured_content if isinstance(result.structured_content, dict | list) else None
    text = "\n".join(parts)
    if not text and structured is not None:
        text = json.dumps(structured)
    return ToolResult(text=text, structured=structured, is_error=bool(result.is_error), files=tuple(files))


def _embedded_file(block: mt.EmbeddedResource) -> ToolFile:
    return _contents_file(block.resource)


def _contents_file(contents) -> ToolFile:
    if isinstance(contents, mt.BlobResourceContents):
        content = base64.b64decode(contents.blob)
    else:
        content = contents.text.encode()
    return ToolFile(uri=str(contents.uri), media_type=contents.mime_type or "", content=content)


def _block_text(block: mt.ContentBlock) -> str:
    # Binary payloads are summarised: the model gets text, and base64 blobs would only burn tokens.
    if isinstance(block, mt.TextContent):
        return block.text
    if isinstance(block, mt.ImageContent):
        return f"[image: {block.mime_type}]"
    if isinstance(block, mt.AudioContent):
        return f"[audio: {block.mime_type}]"
    if isinstance(block, mt.ResourceLink):
        return f"[resource link: {block.uri}]"
    if isinstance(block, mt.EmbeddedResource):
        mime = block.resource.mime_type or "unknown type"
        return f"[resource: {block.resource.uri} ({mime})]"
    return f"[{getattr(block, 'type', 'unknown')} content]"


# --- connection -------------------------------------------------------------------------


def _run(coro: Awaitable[_T], timeout: float) -> _T:
    async def bounded() -> _T:
        with anyio.fail_after(timeout + HARD_DEADLINE_SLACK):
            return await coro

    return anyio.run(bounded)


@asynccontextmanager
async def _connect(config: McpServerConfig, timeout: float, tap: _HttpTap) -> AsyncIterator[Client]:
    """An initialised client session (legacy handshake), torn down on exit."""
    if config.transport == "streamable_http":
        # Our own httpx2 client so config.headers (auth from secrets) ride on every request; its
        # read timeout sits above `timeout` so the SDK's request timeout fires first.
        http = httpx2.AsyncClient(
            headers=dict(config.headers),
            timeout=httpx2.Timeout(timeout, connect=min(timeout, 10.0), read=timeout + 5.0),
            transport=tap.wrap(httpx2.AsyncHTTPTransport(), only_to=config.url),
        )
        async with (
            http,
            Client(
                streamable_http_client(config.url, http_client=http),
                mode="legacy",
                cache=None,
                read_timeout_seconds=timeout,
            ) as client,
        ):
            yield client
    elif config.transport == "stdio":
        if not config.command:
            raise ToolFailed("stdio server config has no command")
        params = StdioServerParameters(
            command=config.command[0], args=list(config.command[1:]), env=dict(config.env) or None
        )
        async with Client(
            stdio_client(params), mode="legacy", cache=None, read_timeout_seconds=timeout
        ) as client:
            yield client
    else:
        raise ToolFailed(f"unsupported MCP transport: {config.transport!r}")


async def _list_tools(config: McpServerConfig, timeout: float, tap: _HttpTap) -> list[RemoteTool]:
    tools: list[RemoteTool] = []
    seen_cursors: set[str] = set()
    cursor: str | None = None
    async with _connect(config, timeout, tap) as client:
        for _ in range(MAX_TOOL_PAGES):
            page = await client.list_tools(cursor=cursor)
            tools.extend(_remote_tool(t) for t in page.tools)
            cursor = page.next_cursor
            if cursor is None:
                return tools
            if cursor in seen_cursors:
                raise ToolFailed(f"tools/list pagination loops on cursor {cursor!r}")
            seen_cursors.add(cursor)
    raise ToolFailed(f"tools/list returned more than {MAX_TOOL_PAGES} pages")


def _remote_tool(tool: mt.Tool) -> RemoteTool:
    hints = tool.annotations.model_dump(by_alias=True, exclude_none=True) if tool.annotations else {}
    return RemoteTool(
        name=tool.name,
        description=tool.description or "",
        input_schema=dict(tool.input_schema),
        annotations={k: hints[k] for k in ANNOTATION_KEYS if k in hints},
    )


@dataclass
class _Progress:
    """How far a call got; decides ToolFailed vs ToolOutcomeUnknown."""

    call_sent: bool = False
    result: mt.CallToolResult | None = None
    linked: dict[str, ToolFile] = field(default_factory=dict)


MAX_LINKS = 20


async def _read_links(client: Client, result: mt.CallToolResult, timeout: float) -> dict[str, ToolFile]:
    """Read the result's resource links back from the same server (resources/read), never from a
    URL of the link's choosing: the platform fetches nothing but the server it was configured
    with. The call has happened by now, so a link that cannot be read stays a link in the text."""
    linked: dict[str, ToolFile] = {}
    links = [b for b in result.content if isinstance(b, mt.ResourceLink)][:MAX_LINKS]
    for link in links:
        try:
            read = await client.session.send_request(
                mt.ReadResourceRequest(params=mt.ReadResourceRequestParams(uri=link.uri)),
                mt.ReadResourceResult,
                request_read_timeout_seconds=timeout,
            )
        except Exception as exc:
            logger.warning("resources/read of %s failed: %s", link.uri, _describe(exc))
            continue
        if read.contents:
            found = _contents_file(read.contents[0])
            linked[link.uri] = ToolFile(
                uri=found.uri, media_type=found.media_type or link.mime_type or "", content=found.content
            )
    return linked


async def _call_tool(
    config: McpServerConfig,
    name: str,
    arguments: dict,
    meta: dict,
    timeout: float,
    tap: _HttpTap,
    progress: _Progress,
) -> mt.CallToolResult:
    try:
        async with _connect(config, timeout, tap) as client:
            request = mt.CallToolRequest(
                # Validated from a dict: `_meta` is the field's wire name (an alias the constructor's types omit).
                params=mt.CallToolRequestParams.model_validate(
                    {"name": name, "arguments": arguments, "_meta": meta}
                )
            )
            progress.call_sent = True
            # session.send_request, not Client.call_tool: the latter re-lists tools after a
            # successful call to validate output schemas, an extra round trip that could fail
            # after the effect has already happened.
            progress.result = await client.session.send_request(
                request, mt.CallToolResult, request_read_timeout_seconds=timeout
            )
            progress.linked = await _read_links(client, progress.result, timeout)
    except Exception:
        if progress.result is None:
            raise
        # The answer arrived; a failure while closing the session must not turn it into an error.
        logger.warning("MCP session teardown failed after %s returned", name, exc_info=True)
    assert progress.result is not None
    return progress.result


# --- error classification ---------------------------------------------------------------


@dataclass
class _HttpTap:
    """Records what happened to each JSON-RPC method's POST at the HTTP layer.

    The SDK folds HTTP failures into synthetic JSON-RPC errors (any 4xx/5xx becomes
    INTERNAL_ERROR, a 404 becomes "Session terminated"), so the status has to be observed here.
    """

    statuses: dict[str, int] = field(default_factory=dict)
    retry_after: dict[str, float] = field(default_factory=dict)
    connect_failed: set[str] = field(default_factory=set)
    refused: list[str] = field(default_factory=list)  # URLs not sent: another origin than the server's
    challenge: str = ""  # WWW-Authenticate of a 401 (RFC 9728: where the server's auth starts)

    def wrap(self, inner: httpx2.AsyncBaseTransport, *, only_to: str) -> httpx2.AsyncBaseTransport:
        return _TapTransport(inner, self, only_to)

    def note(self) -> str:
        """The HTTP errors seen, for messages: the SDK's own text for them is generic."""
        failed = [f"{m}: HTTP {s}" for m, s in self.statuses.items() if s >= 400]
        failed += [f"refused to send to {url}: not the server's origin" for url in self.refused]
        return " (" + ", ".join(failed) + ")" if failed else ""

    def record(self, method: str | None, response: httpx2.Response) -> None:
        if method is None:
            return
        self.statuses[method] = response.status_code
        if response.status_code == 401:
            self.challenge = response.headers.get("www-authenticate", "")[:2000]
        if (ra := _parse_retry_after(response.headers.get("retry-after"))) is not None:
            self.retry_after[method] = ra


class _TapTransport(httpx2.AsyncBaseTransport):
    def __init__(self, inner: httpx2.AsyncBaseTransport, tap: _HttpTap, only_to: str):
        self._inner, self._tap, self._only_to = inner, tap, only_to

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        method = _jsonrpc_method(request)
        if not same_origin(str(request.url), self._only_to):
            # The session's headers carry the server's secret: they go to its configured origin
            # only, whatever URL the SDK (a redirect, an endpoint event) would send them to.
            self._tap.refused.append(str(request.url.copy_with(query=None)))
            raise httpx2.ConnectError("refused before sending: not the server's configured origin")
        try:
            response = await self._inner.handle_async_request(request)
        except (httpx2.ConnectError, httpx2.ConnectTimeout):
            if method is not None:
                self._tap.connect_failed.add(method)
            raise
        self._tap.record(method, response)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


def _jsonrpc_method(request: httpx2.Request) -> str | None:
    if request.method != "POST":
        return None
    try:
        body = json.loads(request.content)
    except (ValueError, httpx2.RequestNotRead):
        return None
    method = body.get("method") if isinstance(body, dict) and "id" in body else None
    return method if isinstance(method, str) else None


def _parse_retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _leaf_errors(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaf_errors(sub)]
    return [exc]


def _describe(exc: BaseException) -> str:
    leaves = _leaf_errors(exc)
    return "; ".join(f"{type(e).__name__}: {e}" for e in leaves) or type(exc).__name__


def _classify(exc: Exception, progress: _Progress, tap: _HttpTap) -> Exception:
    detail = _describe(exc)
    if not progress.call_sent and tap.statuses.get("initialize") == 401:
        return ToolUnauthorized(
            f"the MCP server asks for authorization (HTTP 401), tool not called{tap.note()}",
            challenge=tap.challenge,
        )
    if not progress.call_sent:
        return ToolFailed(f"MCP handshake failed, tool not called{tap.note()}: {detail}")
    call = "tools/call"
    if tap.refused and call not in tap.statuses:
        return ToolFailed(f"tools/call refused before sending{tap.note()}")
    if call in tap.connect_failed:
        return ToolFailed(f"could not connect to send tools/call: {detail}")
    status = tap.statuses.get(call)
    if status is not None and status >= 500:
        return ToolOutcomeUnknown(
            f"tools/call got HTTP {status}: {detail}", retry_after=tap.retry_after.get(call)
        )
    if status == 404:
        return ToolOutcomeUnknown(f"MCP session lost during tools/call (HTTP 404): {detail}")
    if status == 202:
        # Accepted without an answer: the server may still be running the call.
        return ToolOutcomeUnknown(f"tools/call accepted (HTTP 202) without a response: {detail}")
    if status == 401:
        # The token was refused after the handshake took it (it expired in between, or was
        # revoked): the call did not run, and a caller with a new token may send it again.
        return ToolUnauthorized(
            f"tools/call rejected with HTTP 401, tool not called{tap.note()}", challenge=tap.challenge
        )
    if status is not None and status >= 400:
        return ToolFailed(f"tools/call rejected with HTTP {status}: {detail}")
    mcp_errors = [e for e in _leaf_errors(exc) if isinstance(e, MCPError)]
    if mcp_errors and all(e.code in REJECTION_CODES for e in mcp_errors):
        return ToolFailed(f"server rejected tools/call: {detail}")
    return ToolOutcomeUnknown(f"tools/call outcome unknown: {detail}")
