"""Calling a tool: the built-in tools, HTTP tools and MCP servers (tools/mcp_client.py), and the
status lookup of reconcilable providers.

Error contract: dispatch raises ToolFailed when the call provably did not happen (refused
connection, 4xx, a URL off the server's origin) and ToolOutcomeUnknown when it may have;
ToolInProgress when the provider still holds the key of an earlier attempt. A server's secret
goes only to the origin of its configured URL, and redirects are never followed.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from collections.abc import Callable
from typing import TypeVar

import httpx

from connections import services as connections
from core.cookies import no_cookies
from runs.models import Step
from tenants.crypto import redact, redact_obj
from tenants.models import Secret
from tools import client_credentials, run_python
from tools.builtin import BUILTINS
from tools.models import Tool, ToolServer
from tools.origins import origin_text, same_origin
from tools.types import (
    IDEMPOTENCY_HEADER,
    McpServerConfig,
    ToolFailed,
    ToolInProgress,
    ToolOutcomeUnknown,
    ToolResult,
    ToolUnauthorized,
)

T = TypeVar("T")


def _secret_header(server: ToolServer) -> dict:
    if not server.secret_id:
        return {}
    value = Secret.objects.get(pk=server.secret_id).reveal()
    return {server.auth_header or "Authorization": f"{server.auth_scheme} {value}".strip()}


def mcp_config(server: ToolServer, *, authority: dict | None = None) -> McpServerConfig:
    return McpServerConfig(
        transport=server.transport or ToolServer.Transport.STREAMABLE_HTTP,
        url=server.url,
        command=tuple(server.command or ()),
        headers={**_secret_header(server), **(authority or {})},
    )


def dispatch(
    step: Step,
    *,
    send_by: float | None = None,
    authority_headers: dict | None = None,
    authority_meta: dict | None = None,
) -> ToolResult:
    """Send the call. Raises ToolFailed (provably not done) or ToolOutcomeUnknown.

    `authority_headers` and `authority_meta` are the user's authority for this attempt
    (authority.credentials.for_call, docs/authority.md): headers on the HTTP request, entries of
    the MCP request's `_meta`. Like the server's secret they go to its configured origin only.

    `send_by` (time.monotonic()) is when the caller's lease runs out: a worker paused between
    committing the call and sending it (SIGSTOP, a long GC, a starved CPU) may wake after another
    worker took the run over and asked the provider "not found"; sending then would apply the
    call a second time. The check sits just before the request goes out.
    """
    tool = step.tool
    if tool is None:
        raise ToolFailed(f"step {step.seq} names no tool")
    server = tool.server
    if server.kind == ToolServer.Kind.BUILTIN and tool.remote_name == run_python.NAME:
        _before_sending(send_by)
        return run_python.call(step)
    arguments = step.arguments or {}
    if server.kind == ToolServer.Kind.BUILTIN:
        _before_sending(send_by)
        builtin = BUILTINS.get(tool.remote_name)
        if builtin is None:
            raise ToolFailed(f"no builtin tool {tool.remote_name}")
        try:
            return builtin.run(arguments)
        except Exception as exc:
            raise ToolFailed(f"{tool.name} failed: {type(exc).__name__}: {exc}") from None
    if server.kind == ToolServer.Kind.HTTP:
        return _http_call(server, tool, step, send_by, authority_headers or {})
    from tools import mcp_client  # the MCP SDK takes seconds to import: only processes that call MCP pay

    config, connection_id, presented_as = _mcp_config_as_user(server, step, authority=authority_headers)

    def call(config: McpServerConfig) -> ToolResult:
        _before_sending(send_by)
        return mcp_client.call_tool(
            config,
            tool.remote_name,
            arguments,
            idempotency_key=step.idempotency_key,
            timeout=tool.timeout_seconds,
            meta=authority_meta,
        )

    try:
        result = with_server_token(server, config, call)
    except ToolUnauthorized as exc:
        raise _unauthorized(server, exc, connection_id) from None
    if presented_as:
        result = dataclasses.replace(result, presented_as=presented_as)
    return run_python.with_files(step, result) if result.files else result


def with_server_token(server: ToolServer, config: McpServerConfig, call: Callable[[McpServerConfig], T]) -> T:
    """`call(config)`, with the platform's own OAuth token where the server takes one
    (tools/client_credentials.py); after a 401 to that token, once more with a new one (the 401
    means the tool did not run: tools/mcp_client.py). A second 401 is a failure of the call, not
    a sign that the server wants each user's token: the server is not marked protected."""
    token = client_credentials.authorization(server)
    if not token:
        return call(config)
    for attempt in (1, 2):
        value = token["Authorization"].removeprefix("Bearer ")
        try:
            answer = call(dataclasses.replace(config, headers={**config.headers, **token}))
        except ToolUnauthorized:
            client_credentials.forget(server, token)
            if attempt == 2:
                raise ToolFailed(
                    f"denied: {server.name} refused the platform's OAuth token (HTTP 401) twice, the "
                    "second time a newly fetched one; not called"
                ) from None
            token = client_credentials.authorization(server)
            continue
        except (ToolFailed, ToolOutcomeUnknown) as exc:
            # A server that echoes the request puts the token in its error: never in a run record.
            exc.args = (redact(str(exc), [value]),)
            raise
        if isinstance(answer, ToolResult):
            return dataclasses.replace(
                answer, text=redact(answer.text, [value]), structured=redact_obj(answer.structured, [value])
            )
        return answer
    raise AssertionError("unreachable")


def _mcp_config_as_user(
    server: ToolServer, step: Step, *, authority: dict | None = None
) -> tuple[McpServerConfig, int | None, str]:
    """The server's config; for a server that asks for each user's own token (connections/), with
    the run's user's access token, refreshed first if due. A user without a usable connection is
    refused here, before anything is sent."""
    config = mcp_config(server, authority=authority)
    if server.oauth_token_url:  # the platform's own token (with_server_token), not the user's
        return config, None, ""
    if getattr(server, "protection", None) is None:  # as the claim read it on this instance
        return config, None, ""
    # The run the engine attached to the step (the claim's): no read of it per call.
    user_id = step.run.created_by_id
    try:
        connection_id, token, audience = connections.token_for_call(user_id=user_id, server=server)
    except connections.ConnectionUnusable as exc:
        raise ToolFailed(f"denied before sending: {exc}") from None
    headers = {**config.headers, "Authorization": f"Bearer {token}"}
    presented = f"connection {connection_id} (audience {audience})"
    return dataclasses.replace(config, headers=headers), connection_id, presented


def _unauthorized(server: ToolServer, exc: ToolUnauthorized, connection_id: int | None) -> ToolUnauthorized:
    """A 401 to the user's own token ends that connection: its next call is denied."""
    if connection_id is not None:
        connections.refused_by_server(connection_id, server=server)
    return ToolUnauthorized(str(exc), challenge=exc.challenge, connection_id=connection_id)


def http_tool_url(server: ToolServer, tool: Tool) -> str:
    return tool.http_url or f"{server.url.rstrip('/')}/{tool.remote_name}"


def http_status_url(server: ToolServer, tool: Tool, key: str) -> str:
    return (tool.status_url or f"{server.url.rstrip('/')}/status/{{key}}").replace("{key}", key)


def off_origin(server: ToolServer, url: str) -> str | None:
    """Why `url` must not be called with the server's secret, or None.

    The secret (and the idempotency key) belong to the origin of the server's configured URL;
    a tool URL elsewhere is refused even for a server without a secret, so that no tool field
    can aim the platform at another host.
    """
    if same_origin(url, server.url):
        return None
    try:
        where = origin_text(server.url)
    except ValueError:
        where = "(no valid server URL)"
    return f"refused before sending: the URL of this call is not on server {server.name}'s origin {where}"


# An idle connection is let go after a second, well inside the keep-alive of common servers
# (gunicorn's is 2 s): a request sent on a connection the server is closing would end unanswered,
# an unknown outcome made by the platform itself rather than by the provider.
_LIMITS = httpx.Limits(max_connections=256, max_keepalive_connections=64, keepalive_expiry=1.0)


def _client() -> httpx.Client:
    return _client_of(os.getpid())


@functools.cache
def _client_of(pid: int) -> httpx.Client:
    """One client per process, its connections kept alive between calls to a server: a client
    per call (httpx.post) built a TLS context, a pool and a TCP connection every time, about a
    millisecond of a tool step's CPU (docs/performance.md). Keyed by process so that a forked
    worker never shares its parent's sockets. Redirects are never followed (httpx's default, said
    here because it matters): the secret goes to the configured origin and nowhere else."""
    return httpx.Client(
        verify=httpx.create_ssl_context(),
        limits=_LIMITS,
        follow_redirects=False,
        cookies=no_cookies(),  # shared by every tenant's calls
    )


def _before_sending(send_by: float | None) -> None:
    if send_by is not None and time.monotonic() >= send_by:
        raise ToolFailed(
            "not sent: this worker's lease ran out before the call went out (the process was paused "
            "or starved); another worker may hold the run now"
        )


def _http_call(
    server: ToolServer, tool: Tool, step: Step, send_by: float | None, authority: dict
) -> ToolResult:
    url = http_tool_url(server, tool)
    refusal = off_origin(server, url)
    if refusal:
        raise ToolFailed(refusal)
    headers = {IDEMPOTENCY_HEADER: step.idempotency_key, **_secret_header(server), **authority}
    _before_sending(send_by)
    try:
        response = _client().post(
            url,
            json=step.arguments,
            headers=headers,
            timeout=httpx.Timeout(tool.timeout_seconds, connect=min(5.0, tool.timeout_seconds)),
        )
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise ToolFailed(f"could not connect to {server.name}: {type(exc).__name__}") from None
    except httpx.HTTPError as exc:
        raise ToolOutcomeUnknown(f"{type(exc).__name__} after sending to {server.name}") from None
    if response.status_code >= 500:
        raise ToolOutcomeUnknown(
            f"{server.name} answered {response.status_code}", retry_after=_retry_after(response)
        )
    if response.status_code == 409 and step.attempts > 1:
        # A repeat of a call whose first attempt went unanswered: the provider still holds the
        # key ("in use"), so that attempt is alive. Wait for it; a second send could double it.
        raise ToolInProgress(
            f"{server.name} answered 409: the request with this key is still in progress",
            retry_after=_retry_after(response),
        )
    if response.status_code >= 400:
        raise ToolFailed(f"{server.name} refused the call ({response.status_code}): {response.text[:500]}")
    if response.is_redirect:
        _redirected(server, response)
    return _http_result(response, step)


def _redirected(server: ToolServer, response: httpx.Response) -> None:
    """A redirect is not followed. 307/308 say the request was not handled here (a failure);
    after any other redirect the provider may have acted, so the outcome is unknown."""
    where = response.headers.get("Location", "")
    note = (
        f"{server.name} redirected the call ({response.status_code}); not followed: calls and secrets go only "
        f"to the server's configured origin"
    )
    if not same_origin(str(response.url.join(where)), server.url):
        note += ", and the redirect pointed elsewhere"
    if response.status_code in (307, 308):
        raise ToolFailed(note)
    raise ToolOutcomeUnknown(note)


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers.get("Retry-After", ""))
    except ValueError:
        return None


def _http_result(response: httpx.Response, step: Step | None = None) -> ToolResult:
    if step is not None and run_python.is_file_answer(response.headers.get("Content-Type", "")):
        return run_python.file_result(
            step,
            response.content,
            response.headers.get("Content-Type", ""),
            response.headers.get("Content-Disposition", ""),
        )
    try:
        body = response.json()
    except ValueError:
        return ToolResult(text=response.text)
    return ToolResult(text=json.dumps(body, ensure_ascii=False), structured=body)


def lookup_status(
    step: Step, *, authority_headers: dict | None = None, authority_meta: dict | None = None
) -> ToolResult | None:
    """Ask a reconcilable provider whether the call with this key happened. None: it did not.

    The lookup carries the user's authority like the call (`purpose: status_lookup`, the same
    `idempotency_key` claim, a `jti` of its own)."""
    tool = step.tool
    if tool is None:
        raise ToolOutcomeUnknown(f"step {step.seq} names no tool to ask")
    server = tool.server
    if server.kind == ToolServer.Kind.HTTP:
        url = http_status_url(server, tool, step.idempotency_key)
        refusal = off_origin(server, url)
        if refusal:
            # Nothing is learnt about the call itself: its outcome stays unknown.
            raise ToolOutcomeUnknown(f"status lookup {refusal}")
        try:
            response = _client().get(
                url,
                headers={**_secret_header(server), **(authority_headers or {})},
                timeout=tool.timeout_seconds,
            )
        except httpx.HTTPError as exc:
            raise ToolOutcomeUnknown(f"status lookup failed: {type(exc).__name__}") from None
        if response.status_code == 409:
            raise ToolInProgress(
                "status lookup answered 409: in progress", retry_after=_retry_after(response)
            )
        if response.status_code >= 300:
            raise ToolOutcomeUnknown(
                f"status lookup answered {response.status_code} (redirects are not followed)"
            )
        try:
            body = response.json()
        except ValueError:
            raise ToolOutcomeUnknown("status lookup answered something other than JSON") from None
    elif server.kind == ToolServer.Kind.MCP and server.status_tool:
        from tools import mcp_client  # the MCP SDK takes seconds to import: only processes that call MCP pay

        config, connection_id, _ = _mcp_config_as_user(server, step, authority=authority_headers)
        try:
            answer = with_server_token(
                server,
                config,
                lambda config: mcp_client.call_tool(
                    config,
                    server.status_tool,
                    {"idempotency_key": step.idempotency_key},
                    idempotency_key=f"{step.idempotency_key}:status",
                    timeout=tool.timeout_seconds,
                    meta=authority_meta,
                ),
            )
        except ToolUnauthorized as exc:
            raise _unauthorized(server, exc, connection_id) from None
        body = answer.structured if isinstance(answer.structured, dict) else json.loads(answer.text or "{}")
    else:
        raise ToolOutcomeUnknown(f"{tool.name} has no status lookup configured")
    if not isinstance(body, dict):
        raise ToolOutcomeUnknown("status lookup answered something other than a JSON object")
    if body.get("in_progress") is True or body.get("status") == "in_progress":
        raise ToolInProgress("status lookup: the request with this key is still in progress")
    if not body.get("found"):
        return None
    result = body.get("result")
    return ToolResult(text=json.dumps(result, ensure_ascii=False), structured=result)
