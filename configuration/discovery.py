"""Phase 2: list the tools of MCP and builtin servers, before the write transaction opens."""

from __future__ import annotations

import dataclasses
from typing import Any

from configuration.convert import JSON_DEPTH_MAX, TEXT_MAX
from configuration.schema import Item, Plan, Problems
from core.parsers import check_json, text_problem
from tenants.crypto import redact
from tenants.models import Secret
from tools import client_credentials
from tools.catalog import fetch_remote
from tools.models import ToolServer
from tools.types import McpServerConfig, RemoteTool, ToolFailed, ToolNotSent

# --- phase 2: discover (network, outside any transaction) ----------------------------------------


def discover(plan: Plan, problems: Problems) -> dict[str, list[RemoteTool]]:
    """List the tools of MCP servers with discover: true and of builtin servers."""
    remote: dict[str, list[RemoteTool]] = {}
    slug = plan.tenant.key if plan.tenant else ""
    for item in list(plan.sections.get("tool_servers", [])):
        kind = item.values["kind"]
        default = kind == ToolServer.Kind.BUILTIN
        if kind == ToolServer.Kind.HTTP or not item.values.get("discover", default):
            continue
        if kind == ToolServer.Kind.BUILTIN:
            remote[item.key] = fetch_remote(ToolServer(name=item.key, kind=kind))
            continue
        fetched = _discover_mcp(item, plan, slug, problems)
        if fetched is None:
            plan.sections["tool_servers"].remove(item)
            plan.drop("tool_servers", item.key)
        else:
            remote[item.key] = fetched
    return remote


def _discover_mcp(item: Item, plan: Plan, slug: str, problems: Problems) -> list[RemoteTool] | None:
    from tools import mcp_client  # the MCP SDK is only needed here, as in tools.catalog

    existing = ToolServer.objects.filter(tenant__slug=slug, name=item.key).select_related("secret").first()
    secret_name = item.values.get("secret", existing.secret.name if existing and existing.secret else None)
    try:
        secret = _secret_plaintext(secret_name, plan, slug)
    except LookupError:
        assert secret_name is not None  # no name is no secret, never a missing one
        if not plan.is_dropped("secrets", secret_name):
            problems.add(f"{item.path}.secret", f"no secret named {secret_name!r}")
        return None
    config = server_config(item.values, existing, secret)
    where = "command" if config.transport == ToolServer.Transport.STDIO else "url"
    hidden = [secret] if secret else []
    try:
        oauth = _oauth_settings(item, plan, slug)
    except LookupError as missing:
        if not plan.is_dropped("secrets", str(missing.args[0])):
            problems.add(f"{item.path}.oauth.client_secret", f"no secret named {missing.args[0]!r}")
        return None
    if oauth is not None:
        hidden.append(oauth.client_secret)
        try:
            token = client_credentials.fetch(oauth)
        except (ToolFailed, ToolNotSent) as exc:
            problems.add(f"{item.path}.oauth", f"cannot get a token: {redact(str(exc), hidden)}")
            return None
        hidden.append(token)
        config = dataclasses.replace(config, headers={**config.headers, "Authorization": f"Bearer {token}"})
    try:
        listed = mcp_client.list_tools(config)
    except Exception as exc:  # any failure to list means the file cannot be applied as written
        message = redact(str(exc), hidden)
        problems.add(f"{item.path}.{where}", f"cannot list the server's tools: {message}")
        return None
    refused = [(tool.name, problem) for tool in listed for problem in [_remote_problem(tool)] if problem]
    for name, problem in refused:
        problems.add(f"{item.path}.{where}", f"the server's tool {name[:200]!r}: {problem}")
    return None if refused else listed


def _oauth_settings(item: Item, plan: Plan, slug: str) -> client_credentials.OAuthSettings | None:
    """The server's OAuth settings as this file gives them (None: no oauth block). Raises
    LookupError(name) when its client secret names no secret."""
    values = item.values
    if not values.get("oauth_token_url"):
        return None
    client_secret = _secret_plaintext(values["oauth_client_secret"], plan, slug)
    assert client_secret is not None  # a name was given: a secret or LookupError
    return client_credentials.OAuthSettings(
        token_url=values["oauth_token_url"],
        client_id=values["oauth_client_id"],
        client_secret=client_secret,
        scopes=tuple(values.get("oauth_scopes") or ()),
        audience=values.get("oauth_audience", ""),
        client_auth=values.get("oauth_client_auth") or "basic",
    )


def _remote_problem(tool: RemoteTool) -> str | None:
    """What the catalogue cannot store of a listed tool (the server is not trusted to be sensible)."""
    for label, value, limit in (("name", tool.name, 200), ("description", tool.description, TEXT_MAX)):
        if len(value) > limit:
            return f"its {label} is longer than {limit} characters"
        problem = text_problem(value)
        if problem:
            return f"its {label} {problem}"
    schema_problem = check_json(tool.input_schema, max_depth=JSON_DEPTH_MAX)
    if schema_problem:
        return f"its input schema at {schema_problem[0] or 'the top'}: {schema_problem[1]}"
    return None


def _secret_plaintext(name: str | None, plan: Plan, slug: str) -> str | None:
    """The value the secret will have once applied: from this file, else as stored."""
    if name is None:
        return None
    if name in plan.secret_values:
        return plan.secret_values[name]
    stored = Secret.objects.filter(tenant__slug=slug, name=name).first()
    if stored is None:
        raise LookupError(name)
    return stored.reveal()


def server_config(values: dict, existing: ToolServer | None, secret: str | None) -> McpServerConfig:
    """Like tools.transports.mcp_config, for a server that may not be saved yet.

    The secret is passed as plaintext because it may be new in this file, so not yet stored.
    """

    def pick(key: str, default: Any) -> Any:
        return values[key] if key in values else getattr(existing, key, default)

    headers = {}
    if secret is not None:
        scheme = pick("auth_scheme", "Bearer")
        headers[pick("auth_header", "Authorization") or "Authorization"] = f"{scheme} {secret}".strip()
    return McpServerConfig(
        transport=pick("transport", ToolServer.Transport.STREAMABLE_HTTP),
        url=pick("url", ""),
        command=tuple(pick("command", ())),
        headers=headers,
    )
