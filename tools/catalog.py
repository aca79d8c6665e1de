"""The tenant's tool catalogue: discovered tools start disabled; changed tools are quarantined.

fetch_remote() talks to the server (never call it inside a transaction); sync_server() only
writes rows, so callers fetch first and then sync in one short transaction.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

from django.db import transaction
from django.utils import timezone

from connections import services as connections
from tenants.crypto import redact, redact_obj
from tenants.secrets import known_secrets
from tools.builtin import BUILTINS
from tools.models import EffectClass, Tool, ToolServer
from tools.transports import mcp_config, with_server_token
from tools.types import RemoteTool


@dataclass
class SyncReport:
    added: list[str] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    # Declared tools (Tool.declared) the server lists with another description or input schema:
    # quarantined, the declaration kept, for a person to compare.
    differs: list[str] = field(default_factory=list)


def schema_hash(description: str, input_schema: dict) -> str:
    payload = json.dumps({"description": description, "input_schema": input_schema}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def tool_name(server: ToolServer, remote_name: str) -> str:
    # Provider APIs accept [a-zA-Z0-9_-] in function names, so the separator is "__", not ".".
    return f"{server.name}__{remote_name}"


def fetch_remote(server: ToolServer, user_id: int | None = None) -> list[RemoteTool]:
    """The server's tool list. A server that takes each user's token (user_oauth) is listed with
    `user_id`'s connection (the admin syncing with their own); without one it answers 401."""
    if server.kind == ToolServer.Kind.BUILTIN:
        return [
            RemoteTool(name, b.description, b.input_schema, {"readOnlyHint": name != "sleep"})
            for name, b in sorted(BUILTINS.items())
        ]
    if server.kind == ToolServer.Kind.MCP:
        from tools import mcp_client  # the MCP SDK takes seconds to import: only MCP servers need it

        config = mcp_config(server)
        if server.user_oauth and user_id is not None:
            _, token, _ = connections.token_for_call(user_id=user_id, server=server)
            headers = {**config.headers, "Authorization": f"Bearer {token}"}
            return mcp_client.list_tools(dataclasses.replace(config, headers=headers))
        return with_server_token(server, config, mcp_client.list_tools)
    return []  # http tools are declared in the tenant configuration


def sync_server(server: ToolServer, remote: list[RemoteTool]) -> SyncReport:
    report = SyncReport()
    existing = {t.remote_name: t for t in Tool.objects.filter(server=server)}
    # Descriptions and schemas go to the model verbatim; a server could echo the credential we
    # send it into them.
    secrets = known_secrets(server.tenant_id)
    remote = [
        RemoteTool(r.name, redact(r.description, secrets), redact_obj(r.input_schema, secrets), r.annotations)
        for r in remote
    ]
    for item in remote:
        digest = schema_hash(item.description, item.input_schema)
        tool = existing.get(item.name)
        if tool is None:
            Tool.objects.create(
                tenant_id=server.tenant_id,
                server=server,
                name=tool_name(server, item.name),
                remote_name=item.name,
                description=item.description,
                input_schema=item.input_schema,
                schema_hash=digest,
                annotations=dict(item.annotations),
                enabled=False,
                effect_class=EffectClass.UNSAFE,
            )
            report.added.append(item.name)
        elif tool.declared and tool.schema_hash != digest:
            Tool.objects.filter(pk=tool.pk).update(
                quarantined=True,
                annotations=dict(item.annotations),
                quarantine_reason=f"the server lists this tool with another description or input schema "
                f"than the configuration declares (seen {timezone.now():%Y-%m-%d %H:%M} UTC); the "
                f"declaration is kept: compare, correct the file, and re-enable it. The server's: "
                f"{json.dumps({'description': item.description, 'input_schema': item.input_schema})[:2000]}",
            )
            report.differs.append(item.name)
        elif tool.schema_hash and tool.schema_hash != digest:
            Tool.objects.filter(pk=tool.pk).update(
                quarantined=True,
                description=item.description,
                input_schema=item.input_schema,
                schema_hash=digest,
                annotations=dict(item.annotations),
                quarantine_reason=f"the server changed this tool's description or input schema "
                f"on {timezone.now():%Y-%m-%d %H:%M} UTC; review and re-enable it",
            )
            report.quarantined.append(item.name)
        else:
            Tool.objects.filter(pk=tool.pk).update(
                annotations=dict(item.annotations),
                schema_hash=digest,
                description=item.description,
                input_schema=item.input_schema,
            )
            report.unchanged.append(item.name)
    report.missing = sorted(set(existing) - {r.name for r in remote})
    ToolServer.objects.filter(pk=server.pk).update(last_synced_at=timezone.now())
    return report


def refresh(server: ToolServer, user_id: int | None = None) -> SyncReport:
    if server.kind == ToolServer.Kind.HTTP:
        # Declared, not discovered: there is no server-side list to compare with (syncing an
        # empty list would report every declared tool as missing).
        return SyncReport(
            unchanged=sorted(Tool.objects.filter(server=server).values_list("remote_name", flat=True))
        )
    remote = fetch_remote(server, user_id)
    with transaction.atomic():
        return sync_server(server, remote)


def release_quarantine(tool: Tool) -> None:
    """A person reviewed the change: offer and allow the tool again, with its new schema."""
    Tool.objects.filter(pk=tool.pk).update(quarantined=False, quarantine_reason="")
