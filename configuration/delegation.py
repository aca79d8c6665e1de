"""Phase 3 for delegated authority: each server's delegation and the tenant's identity provider
(authority/, docs/authority.md), owned by the file like a server's URL: what the file omits is
removed, so the stored rows are always what the file says."""

from __future__ import annotations

from authority.models import Delegation, IdentityProvider
from configuration.report import ApplyReport
from configuration.rows import assign
from configuration.schema import Item, Problems
from tenants.models import Secret, Tenant
from tools.models import ToolServer

DEFAULTS = {
    "mode": Delegation.Mode.ASSERTION,
    "audience": "",
    "scopes": [],
    "header": "Agent-Assertion",
    "mcp_meta": True,
    "mcp_authorization": False,
}


def apply_delegation(server: ToolServer, values: dict | None, label: str, report: ApplyReport) -> None:
    stored = Delegation.objects.filter(server=server).first()
    if values is None:
        if stored is not None:
            stored.delete()
            report.record("tool_servers", label, "updated", ["delegation removed"])
        return
    wanted = {**DEFAULTS, **values}
    if stored is None:
        Delegation.objects.create(server=server, **wanted)
        report.record("tool_servers", label, "updated", ["delegation"])
        return
    changed = assign(stored, wanted)
    if changed:
        report.record("tool_servers", label, "updated", [f"delegation.{name}" for name in changed])


def apply_identity_provider(
    item: Item | None, tenant: Tenant, problems: Problems, report: ApplyReport
) -> None:
    stored = IdentityProvider.objects.filter(tenant=tenant).first()
    if item is None:
        if stored is not None:
            stored.delete()
            report.record("tenant", tenant.slug, "updated", ["identity_provider removed"])
        return
    values = dict(item.values)
    for key in ("client_id", "client_secret"):
        secret = Secret.objects.filter(tenant=tenant, name=values[key]).first()
        if secret is None:
            problems.add(f"identity_provider.{key}", f"no secret named {values[key]!r}")
            return
        values[key] = secret
    values.setdefault("timeout_seconds", 10.0)
    if stored is None:
        IdentityProvider.objects.create(tenant=tenant, **values)
        report.record("tenant", tenant.slug, "updated", ["identity_provider"])
        return
    changed = assign(stored, values)
    if changed:
        report.record("tenant", tenant.slug, "updated", [f"identity_provider.{name}" for name in changed])
