"""Shapes that cross the tool gateway, independent of the transport (MCP, HTTP, builtin)."""

from __future__ import annotations

from dataclasses import dataclass, field

# The key under which the step's idempotency key travels in MCP `_meta` (and the HTTP header name).
IDEMPOTENCY_META_KEY = "io.agentplatform/idempotency-key"
IDEMPOTENCY_HEADER = "Idempotency-Key"


@dataclass(frozen=True)
class RemoteTool:
    """A tool as a server describes it (untrusted: annotations are hints only)."""

    name: str
    description: str
    input_schema: dict
    annotations: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ToolResult:
    """Normalised result: text for the model, structured content when the server gave one."""

    text: str
    structured: dict | list | None = None
    is_error: bool = False
    # What the call cost by measured usage (run_python), where it differs from the tool's price.
    cost_micros: int | None = None
    # Whose authority the provider was shown, for the audit trails to join (never the token
    # itself): "connection 7 (audience https://…/mcp)" for a user's OAuth connection.
    presented_as: str = ""
    # Files the tool answered (an MCP embedded resource, or a resource link read from the server),
    # stored as artifacts of the step by the transport (tools.run_python.with_files).
    files: tuple[ToolFile, ...] = ()


@dataclass(frozen=True)
class ToolFile:
    uri: str
    media_type: str
    content: bytes


@dataclass(frozen=True)
class McpServerConfig:
    transport: str  # "streamable_http" | "stdio"
    url: str = ""  # streamable_http
    command: tuple[str, ...] = ()  # stdio: argv
    env: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)  # already-decrypted auth headers


class ToolFailed(Exception):
    """The call provably did not take effect (refused before sending, 4xx validation, MCP
    protocol error on a rejected request), or the tool itself reported a failure."""


class ToolUnauthorized(ToolFailed):
    """The server answered 401 before the call ran (an MCP server's handshake): it wants a token.

    `challenge`: its WWW-Authenticate header (RFC 9728: `resource_metadata` says where to start);
    `connection_id`: the user's connection whose token it refused, or None when none was sent."""

    def __init__(self, message: str, *, challenge: str = "", connection_id: int | None = None):
        super().__init__(message)
        self.challenge = challenge
        self.connection_id = connection_id


class ToolNotSent(Exception):
    """The call was not sent: a credential it needs could not be had (the server's OAuth token
    endpoint did not answer usably). Nothing happened at the tool; retried with backoff."""

    def __init__(self, message: str, *, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class ToolOutcomeUnknown(Exception):
    """The request may have reached the provider and its outcome is unknown
    (timeout after sending, connection reset, 5xx, lost session)."""

    def __init__(self, message: str, *, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class ToolInProgress(ToolOutcomeUnknown):
    """The provider has a request with this key and is still working on it (409 for a key in use,
    or a status lookup answering "in progress"): it is waited on and asked again, never re-sent
    while the provider says so (DESIGN.md 5.1)."""
