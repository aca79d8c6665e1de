"""What one tool call presents of the user's authority: the assertion, and where the server is
behind token exchange, the IdP's access token for the user (DESIGN.md 7.1, docs/authority.md).

`for_call` is the only entry point; the engine calls it once per attempt just before sending, after
the gateway's own checks passed (delegation is a second lock, never a replacement of the first),
and the transport places what it returns. It reads a few short rows and then releases the
database connection, so the call itself holds none. Each attempt gets a fresh assertion with a `jti` of
its own; the step's idempotency key is its `idempotency_key` claim, the same on a retry and a status lookup.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TypeVar, cast

from approvals.models import Approval, ApprovalStatus
from authority import assertions, exchange
from authority.models import Delegation
from runs.models import Run, Step
from tenants.crypto import redact, redact_obj
from tools.models import ToolServer
from tools.origins import origin_text
from tools.types import ToolResult

_T = TypeVar("_T")

# The key of the assertion in an MCP request's `_meta` (beside the idempotency key).
ASSERTION_META_KEY = "io.agentplatform/assertion"
DEFAULT_HEADER = "Agent-Assertion"


@dataclass(frozen=True)
class Credentials:
    """Placed by the transport: `headers` on the HTTP request (HTTP tools, MCP over HTTP), `meta`
    in the MCP request's `_meta`. `presented` is what the run's events record (never a token)."""

    headers: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    presented: dict = field(default_factory=dict)
    values: tuple[str, ...] = ()

    def scrub(self, value: _T) -> _T:
        """`value` (text, JSON, or a tool result) with every presented credential redacted: a
        provider that echoes its request must not hand a token to the model or the step log."""
        if not self.values:
            return value
        if isinstance(value, str):
            return cast(_T, redact(value, self.values))
        if isinstance(value, ToolResult):
            return dataclasses.replace(
                value,
                text=redact(value.text, self.values),
                structured=redact_obj(value.structured, self.values),
            )
        return redact_obj(value, self.values)


NONE = Credentials()


def delegation_of(server: ToolServer) -> Delegation | None:
    """The server's delegation settings: as the claim read them with the tool where it did (the
    dispatch check, a retry), else read now. None: assertion mode with the defaults."""
    return getattr(server, "delegation", None)  # a cached None, or no row, raises AttributeError


def audience_of(server: ToolServer, delegation: Delegation | None) -> str:
    if delegation is not None and delegation.audience:
        return delegation.audience
    if server.url:
        try:
            return origin_text(server.url)
        except ValueError:
            pass
    return f"urn:agentplatform:tool-server:{server.tenant_id}:{server.name}"


def for_call(
    step: Step, *, status_lookup: bool = False, run: Run | None = None, approved: bool = True
) -> Credentials:
    """The credentials of this attempt. Raises AuthorityRefused or AuthorityUnavailable (from the
    IdP) before anything is sent.

    `run`: the run as the claim read it (with its tenant, user, agent and version: what an
    assertion names of a run never changes); None reads it. `approved`: False when the call was
    proposed and dispatched without an approval (the claim knows): no approval is looked for."""
    tool = step.tool
    if tool is None or tool.server.kind == ToolServer.Kind.BUILTIN:
        return NONE
    server = tool.server
    delegation = delegation_of(server)
    audience = audience_of(server, delegation)
    facts = _facts(step, tool.remote_name, run=run, approved=approved)
    signed = assertions.sign(facts, audience=audience, status_lookup=status_lookup)
    presented: dict[str, object] = {
        "mode": delegation.mode if delegation else Delegation.Mode.ASSERTION,
        "jti": signed.jti,
        "idempotency_key": step.idempotency_key,
        "subject": signed.subject,
        "audience": audience,
        "key_id": signed.key_id,
    }
    values = [signed.token]
    header = delegation.header if delegation is not None else DEFAULT_HEADER
    headers = {header: signed.token} if header else {}
    meta = {ASSERTION_META_KEY: signed.token} if delegation is None or delegation.mcp_meta else {}
    if delegation is not None and delegation.mode == Delegation.Mode.TOKEN_EXCHANGE:
        run = step.run
        token = exchange.access_token(
            tenant_id=run.tenant_id,
            user_id=run.created_by_id,
            audience=audience,
            scopes=delegation.scopes,
            subject_token=signed.token,
        )
        headers["Authorization"] = f"Bearer {token.token}"
        values.append(token.token)
        presented.update(
            token_subject=token.subject,
            token_scope=exchange.scope_key(delegation.scopes),
            token_from_cache=token.cached,
        )
    elif server.kind == ToolServer.Kind.MCP and delegation is not None and delegation.mcp_authorization:
        headers["Authorization"] = f"Bearer {signed.token}"
    if server.kind == ToolServer.Kind.HTTP:
        meta = {}
    exchange.release_connection()
    return Credentials(headers=headers, meta=meta, presented=presented, values=tuple(values))


def _facts(step: Step, remote_name: str, *, run: Run | None, approved: bool) -> assertions.CallFacts:
    if run is None:
        run = Run.objects.select_related("tenant", "created_by", "agent", "version").get(pk=step.run_id)
    step.run = run
    approval = (
        Approval.objects.filter(
            step_id=step.pk,
            status__in=[ApprovalStatus.APPROVED, ApprovalStatus.CONSUMED],
            decided_by__isnull=False,
        )
        .select_related("decided_by")
        .first()
        if approved
        else None
    )
    return assertions.CallFacts(
        tenant=run.tenant.slug,
        user=run.created_by.get_username(),
        agent=run.agent.name,
        version=run.version.number,
        run_id=str(run.pk),
        step=step.seq,
        tool=remote_name,
        arguments=step.arguments or {},
        idempotency_key=step.idempotency_key,
        attempt=max(step.attempts, 1),
        approval_id=str(approval.pk) if approval else None,
        approver=approval.decided_by.get_username() if approval and approval.decided_by else None,
        approval_digest=approval.digest if approval else None,
    )
