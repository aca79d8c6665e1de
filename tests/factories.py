"""Builders for test data: a tenant with an agent user, a supervisor and builtin tools."""

from __future__ import annotations

from decimal import Decimal

from django.contrib.auth.models import Group
from guardian.shortcuts import assign_perm

from agents.models import AgentDefinition, Alias
from agents.services import create_version
from llm.models import ModelEndpoint
from tenants.models import Tenant, TenantGroup, User
from tools.catalog import refresh
from tools.models import Tool, ToolServer


def make_tenant(slug: str = "acme", **fields) -> Tenant:
    return Tenant.objects.create(slug=slug, name=slug.title(), **fields)


def make_user(
    tenant: Tenant, username: str, *, staff: bool = False, password: str = "pw", view_runs: bool | None = None
) -> User:
    """A user of the tenant. Staff users in these tests are supervisors: they hold view_runs on the
    tenant (read every run) unless `view_runs` says otherwise."""
    user = User.objects.create_user(username=username, password=password, tenant=tenant, is_staff=staff)
    if staff if view_runs is None else view_runs:
        grant_view_runs(tenant, user)
    return user


def grant_view_runs(tenant: Tenant, *holders) -> None:
    for who in holders:
        assign_perm("tenants.view_runs", who, tenant)


def grant_run_agent(agent: AgentDefinition, *holders) -> None:
    for who in holders:
        assign_perm("agents.run_agent", who, agent)


def make_group(tenant: Tenant, name: str) -> Group:
    group = Group.objects.create(name=f"{tenant.slug}:{name}")
    TenantGroup.objects.create(group=group, tenant=tenant, name=name)
    return group


def make_endpoint(
    tenant: Tenant,
    *,
    name: str = "scripted",
    kind: str = "scripted",
    config: dict | None = None,
    base_url: str = "",
    secret=None,
    **fields,
) -> ModelEndpoint:
    prices = {
        "price_input": Decimal("3"),
        "price_cached_input": Decimal("0.3"),
        "price_cache_write": Decimal("3.75"),
        "price_output": Decimal("15"),
    }
    prices.update(fields)
    return ModelEndpoint.objects.create(
        tenant=tenant,
        name=name,
        kind=kind,
        base_url=base_url,
        model="test-model",
        config=config or {},
        secret=secret,
        **prices,
    )


def make_builtin_tools(tenant: Tenant, *, effect: str = "read_only", **fields) -> dict[str, Tool]:
    server = ToolServer.objects.create(tenant=tenant, name="platform", kind=ToolServer.Kind.BUILTIN)
    refresh(server)
    Tool.objects.filter(server=server).update(enabled=True, effect_class=effect, **fields)
    return {t.remote_name: t for t in Tool.objects.filter(server=server)}


def grant(tool: Tool, *, use=(), approve=()) -> None:
    for who in use:
        assign_perm("tools.use_tool", who, tool)
    for who in approve:
        assign_perm("tools.approve_tool", who, tool)


def make_agent(
    tenant: Tenant,
    *,
    name: str = "agent",
    tools=(),
    turns=(),
    endpoint: ModelEndpoint | None = None,
    alias: str = "prod",
    runners=None,
    **spec_fields,
):
    """A version of agent `name` (created if new) behind `alias`.

    `runners`: users or groups granted run_agent on the agent; None grants it to every user the
    tenant has at this point, which is what most tests want (pass () to grant nobody).
    """
    endpoint = (
        endpoint
        or ModelEndpoint.objects.filter(tenant=tenant).first()
        or make_endpoint(tenant, config={"turns": list(turns)})
    )
    if turns and endpoint.kind == "scripted":
        endpoint.config = {**endpoint.config, "turns": list(turns)}
        endpoint.save()
    spec = {
        "model": endpoint.name,
        "instructions": "You help bank support agents.",
        "tools": [t.name if isinstance(t, Tool) else t for t in tools],
        **spec_fields,
    }
    version, _ = create_version(tenant=tenant, agent=name, spec=spec)
    Alias.objects.update_or_create(agent=version.agent, name=alias, defaults={"version": version})
    grant_run_agent(version.agent, *(User.objects.filter(tenant=tenant) if runners is None else runners))
    return version


def refund_rule(tool: str) -> str:
    """The story's refund rule: above INR 5,000, or in another currency (or either one missing),
    a supervisor approves."""
    return (
        '@approval("refunds above INR 5,000, or in another currency, wait for a supervisor")\n'
        f'permit (principal, action == Action::"{tool}", resource)\n'
        "when {\n"
        "  !(context.arguments has amount && context.arguments.amount <= 5000) ||\n"
        '  !(context.arguments has currency && context.arguments.currency == "INR")\n'
        "};"
    )


BANK_SETTINGS = {
    "lookup_transaction": {"effect_class": "read_only"},
    "search_tickets": {"effect_class": "read_only"},
    "issue_refund": {"effect_class": "idempotent", "approval_policy": refund_rule},
    "send_customer_email": {"effect_class": "unsafe"},
    "transfer_funds": {"effect_class": "unsafe", "approval_policy": "always"},
    "refund_status": {"effect_class": "read_only"},
    "search": {"effect_class": "read_only"},
}


def make_bank_tools(tenant: Tenant, url: str, *, name: str = "bank", **server_fields) -> dict[str, Tool]:
    """The example bank MCP server's tools, discovered, then enabled with the story's settings."""
    server = ToolServer.objects.create(
        tenant=tenant,
        name=name,
        kind=ToolServer.Kind.MCP,
        transport=ToolServer.Transport.STREAMABLE_HTTP,
        url=url,
        status_tool="refund_status",
        **server_fields,
    )
    refresh(server)
    tools = {t.remote_name: t for t in Tool.objects.filter(server=server)}
    for remote, settings in BANK_SETTINGS.items():
        # A rule names its tool's action: the refund rule is written for this server's tool.
        settings = {k: v(tools[remote].name) if callable(v) else v for k, v in settings.items()}
        # settle_seconds 0: the example bank applies and shows a call before answering it.
        Tool.objects.filter(pk=tools[remote].pk).update(
            enabled=True, timeout_seconds=10, price_micros=1000, settle_seconds=0, **settings
        )
        tools[remote].refresh_from_db()
    return tools
