"""Phase 3: create or update rows, idempotently, inside the one transaction of apply_config."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.contrib.auth.models import Group
from django.contrib.contenttypes.models import ContentType
from guardian.models import GroupObjectPermissionBase, UserObjectPermissionBase
from guardian.shortcuts import assign_perm, remove_perm
from guardian.utils import get_group_obj_perms_model, get_user_obj_perms_model

from agents.models import AgentDefinition, Alias
from agents.services import create_version, move_alias
from agents.spec import validate_spec
from budgets.models import BudgetAccount
from budgets.services import local_day, set_day_limit, set_user_day_limits
from configuration import delegation, reminders, tenant_regions
from configuration.report import ApplyReport
from configuration.rows import assign
from configuration.schema import (
    AGENT_PERMS,
    HTTP_ONLY,
    PERMS,
    REGION_KEYS,
    REMINDER_KEYS,
    TENANT_PERMS,
    TOOL,
    TOOL_DESTINATION,
    Field,
    Item,
    Plan,
    Problems,
)
from core.digests import digest
from llm.models import ModelEndpoint
from notifications.models import Webhook
from tenants.crypto import SecretKeyError
from tenants.models import Secret, Tenant, TenantGroup, User
from tenants.roles import VIEWS_ALL_RUNS, permissions_for
from tenants.tokens import revoke_all
from tools import run_python
from tools.catalog import SyncReport, schema_hash, sync_server, tool_name
from tools.models import Tool, ToolServer
from tools.origins import OriginError, origin_text, same_origin
from tools.services import configure_tool
from tools.types import RemoteTool

# --- phase 3: write ------------------------------------------------------------------------------


@dataclass
class _Context:
    tenant: Tenant
    plan: Plan
    problems: Problems
    report: ApplyReport
    remote: dict[str, list[RemoteTool]]

    def missing(self, kind: str, key: str, path: str, message: str) -> None:
        # Whatever refers to an item left out for its own errors is skipped without a second error.
        if not self.plan.is_dropped(kind, key):
            self.problems.add(path, message)

    def skip(self, kind: str, item: Item) -> None:
        self.plan.drop(kind, item.key)


def write(plan: Plan, remote: dict[str, list[RemoteTool]], problems: Problems) -> ApplyReport:
    assert plan.tenant is not None
    report = ApplyReport(tenant=plan.tenant.key)
    ctx = _Context(_apply_tenant(plan.tenant, report), plan, problems, report, remote)
    tenant_regions.apply(ctx.tenant, plan, problems, report)
    steps: list[tuple[str, Callable[[Item, _Context], None]]] = [
        ("secrets", _apply_secret),
        ("groups", _apply_group),
        ("users", _apply_user),
        ("groups", _apply_group_roles),
        ("users", _apply_user_roles),
        ("model_endpoints", _apply_endpoint),
        ("tool_servers", _apply_server),
        ("tools", _apply_tool),
        ("grants", _apply_grant),
        ("agents", _apply_agent),
        ("grants", _apply_agent_grant),
        ("webhooks", _apply_webhook),
    ]
    for section, apply_item in steps:
        for item in plan.sections[section]:
            apply_item(item, ctx)
    delegation.apply_identity_provider(plan.identity_provider, ctx.tenant, ctx.problems, ctx.report)
    _apply_tenant_grants(plan.tenant, ctx)
    reminders.apply(ctx.tenant, plan, ctx.problems, ctx.report)
    return report


def _apply_tenant(item: Item, report: ApplyReport) -> Tenant:
    values = {
        k: v for k, v in item.values.items() if k not in ("slug", "view_runs", *REMINDER_KEYS, *REGION_KEYS)
    }
    tenant = Tenant.objects.filter(slug=item.key).first()
    if tenant is None:
        values.setdefault("name", item.key)
        tenant = Tenant.objects.create(slug=item.key, **values)
        report.record("tenant", item.key, "created")
        return tenant
    changed = assign(tenant, values)
    report.record("tenant", item.key, "updated" if changed else "unchanged", changed)
    if {"daily_budget_micros", "user_daily_budget_micros"} & set(changed):
        _update_today_limits(tenant, report)
    return tenant


def _update_today_limits(tenant: Tenant, report: ApplyReport) -> None:
    """Today's accounts were opened with the old limit; the new one applies from now on."""
    day = local_day(tenant)
    if BudgetAccount.objects.filter(
        tenant=tenant, day=day, scope=BudgetAccount.Scope.TENANT_DAY
    ).exists() and set_day_limit(tenant, day, tenant.daily_budget_micros):
        report.record("budgets", f"tenant_day {day}", "updated", ["limit"])
    limit = tenant.user_daily_budget_micros
    if limit is None:
        return
    for account in set_user_day_limits(tenant, day, limit):
        assert account.user is not None  # a user_day account is one user's
        report.record("budgets", f"user_day {day} {account.user.username}", "updated", ["limit"])


def _apply_secret(item: Item, ctx: _Context) -> None:
    secret = Secret.objects.filter(tenant=ctx.tenant, name=item.key).first()
    plaintext = item.values["value"]
    if secret is None:
        secret = Secret(tenant=ctx.tenant, name=item.key)
        secret.set_value(plaintext)
        secret.save()
        ctx.report.record("secrets", item.key, "created")
    elif secret.reveal() != plaintext:
        # Fernet is randomised: re-encrypting an unchanged value would look like a change.
        secret.set_value(plaintext)
        secret.save(update_fields=["ciphertext", "updated_at"])
        ctx.report.record("secrets", item.key, "updated", ["value"])
    else:
        ctx.report.record("secrets", item.key, "unchanged")


def _apply_group(item: Item, ctx: _Context) -> None:
    if TenantGroup.objects.filter(tenant=ctx.tenant, name=item.key).exists():
        ctx.report.record("groups", item.key, "unchanged")
        return
    # Django group names are global, so the tenant's slug keeps tenants apart.
    group, _ = Group.objects.get_or_create(name=f"{ctx.tenant.slug}:{item.key}")
    if TenantGroup.objects.filter(group=group).exists():
        ctx.problems.add(
            f"{item.path}.name", f"the auth group {group.name!r} belongs to another tenant group"
        )
        ctx.skip("groups", item)
        return
    TenantGroup.objects.create(group=group, tenant=ctx.tenant, name=item.key)
    ctx.report.record("groups", item.key, "created")


def _tenant_groups(names: list[str], path: str, ctx: _Context) -> list[Group] | None:
    found = {
        link.name: link.group
        for link in TenantGroup.objects.filter(tenant=ctx.tenant, name__in=names).select_related("group")
    }
    ok = True
    for i, name in enumerate(names):
        if name not in found:
            ctx.missing("groups", name, f"{path}[{i}]", f"no group named {name!r}")
            ok = False
    return [found[name] for name in names] if ok else None


def _apply_user(item: Item, ctx: _Context) -> None:
    values = {k: v for k, v in item.values.items() if k not in ("username", "roles")}
    if "is_staff" not in values and _roles_of_user(item, ctx.plan):
        values["is_staff"] = True  # every role works in the admin
    password = values.pop("password", None)
    names = values.pop("groups", None)
    groups = None if names is None else _tenant_groups(names, f"{item.path}.groups", ctx)
    user = User.objects.filter(username=item.key).first()
    foreign = user is not None and user.tenant_id != ctx.tenant.pk
    if foreign:
        ctx.problems.add(f"{item.path}.username", "this username belongs to another tenant or to an operator")
    if foreign or (names is not None and groups is None):
        ctx.skip("users", item)
        return
    if user is None:
        user, changed = _create_user(item.key, values, password, ctx.tenant), None
    else:
        changed = _update_user(user, values, password)
    if groups is not None and _set_memberships(user, groups, ctx.tenant) and changed is not None:
        changed.append("groups")
    outcome = "created" if changed is None else ("updated" if changed else "unchanged")
    ctx.report.record("users", item.key, outcome, changed or ())


def _create_user(username: str, values: dict, password: str | None, tenant: Tenant) -> User:
    user = User(username=username, tenant=tenant, **values)
    if password:
        user.set_password(password)
    else:
        user.set_unusable_password()
    user.save()
    return user


def _update_user(user: User, values: dict, password: str | None) -> list[str]:
    changed = assign(user, values)
    # Hashes are salted: only a password that no longer matches is hashed again.
    if password and not user.check_password(password):
        user.set_password(password)
        user.save(update_fields=["password"])
        changed.append("password")
    if "password" in changed or ("is_active" in changed and not user.is_active):
        revoke_all(user=user)
    return changed


def _set_memberships(user: User, groups: list[Group], tenant: Tenant) -> bool:
    """Make the user's groups of this tenant exactly `groups`; other groups are not ours to touch."""
    current = set(user.groups.filter(tenant_link__tenant=tenant))
    wanted = set(groups)
    user.groups.remove(*(current - wanted))
    user.groups.add(*(wanted - current))
    return current != wanted


def _secret_ref(values: dict, path: str, ctx: _Context, key: str = "secret", at: str = "secret") -> bool:
    """Replace the secret's name by the row; False when it names no secret of the tenant."""
    if values.get(key) is None:
        return True
    name = values[key]
    values[key] = Secret.objects.filter(tenant=ctx.tenant, name=name).first()
    if values[key] is None:
        ctx.missing("secrets", name, f"{path}.{at}", f"no secret named {name!r}")
        return False
    return True


def _upsert(
    model: type[ModelEndpoint] | type[ToolServer], kind: str, item: Item, values: dict, ctx: _Context
) -> Any:
    obj = model.objects.filter(tenant=ctx.tenant, name=item.key).first()
    if obj is None:
        obj = model.objects.create(tenant=ctx.tenant, name=item.key, **values)
        ctx.report.record(kind, item.key, "created")
        return obj
    changed = assign(obj, values)
    ctx.report.record(kind, item.key, "updated" if changed else "unchanged", changed)
    ctx.report.restored(kind, item.key, [name for name in changed if name in model.DESTINATION_FIELDS])
    return obj


def _apply_endpoint(item: Item, ctx: _Context) -> None:
    values = {k: v for k, v in item.values.items() if k != "name"}
    if not _secret_ref(values, item.path, ctx):
        ctx.skip("model_endpoints", item)
        return
    _upsert(ModelEndpoint, "model_endpoints", item, values, ctx)


def _apply_server(item: Item, ctx: _Context) -> None:
    values = {k: v for k, v in item.values.items() if k not in ("name", "discover", "delegation")}
    if not _secret_ref(values, item.path, ctx) or not _secret_ref(
        values, item.path, ctx, "oauth_client_secret", "oauth.client_secret"
    ):
        ctx.skip("tool_servers", item)
        return
    server = _upsert(ToolServer, "tool_servers", item, values, ctx)
    delegation.apply_delegation(server, item.values.get("delegation"), item.key, ctx.report)
    if item.key not in ctx.remote:
        return
    remote = ctx.remote[item.key]
    _record_sync(server, sync_server(server, remote), ctx)
    if server.status_tool and server.status_tool not in {tool.name for tool in remote}:
        ctx.problems.add(f"{item.path}.status_tool", f"the server lists no tool named {server.status_tool!r}")


def _record_sync(server: ToolServer, sync: SyncReport, ctx: _Context) -> None:
    for remote_name in sync.added:
        ctx.report.record("tools", tool_name(server, remote_name), "created")
    for remote_name in sync.unchanged:
        ctx.report.record("tools", tool_name(server, remote_name), "unchanged")
    for remote_name in sync.quarantined:
        name = tool_name(server, remote_name)
        ctx.report.record("tools", name, "updated", ["quarantined"])
        ctx.report.notes.append(
            f"tool {name} changed on the server and is quarantined until an admin releases it"
        )
    for remote_name in sync.differs:
        name = tool_name(server, remote_name)
        ctx.report.record("tools", name, "updated", ["quarantined"])
        ctx.report.notes.append(
            f"tool {name} is declared in this file, but {server.name} lists it with another description "
            "or input schema: it is quarantined, the declaration kept (the reason shows the server's)"
        )
    for remote_name in sync.missing:
        ctx.report.notes.append(f"tool {tool_name(server, remote_name)} is no longer listed by {server.name}")
    listed = {item.key for item in ctx.plan.sections["tools"]}
    for remote_name in sync.added:
        name = tool_name(server, remote_name)
        if name not in listed:
            ctx.report.notes.append(f"tool {name} was discovered and stays disabled until configured")


def _apply_tool(item: Item, ctx: _Context) -> None:
    values = {k: v for k, v in item.values.items() if k not in REMINDER_KEYS}  # configuration/reminders.py
    server_name, remote_name = values.pop("server"), values.pop("remote_name")
    if ctx.plan.is_dropped("tool_servers", server_name):
        # Its server was left out for its own errors: the stored row is not what the file means.
        ctx.skip("tools", item)
        return
    server = ToolServer.objects.filter(tenant=ctx.tenant, name=server_name).first()
    if server is None:
        ctx.missing(
            "tool_servers", server_name, f"{item.path}.server", f"no tool server named {server_name!r}"
        )
        ctx.skip("tools", item)
        return
    if not _tool_fields_fit(server, values, item.path, ctx):
        ctx.skip("tools", item)
        return
    tool = Tool.objects.filter(server=server, remote_name=remote_name).first()
    if tool is None and server.kind == ToolServer.Kind.HTTP:
        _create_http_tool(server, remote_name, values, ctx)
        return
    if server.user_oauth and not _declaration_fits(tool, values, item.path, ctx):
        ctx.skip("tools", item)
        return
    if tool is None and server.user_oauth:
        tool = _create_declared_tool(server, remote_name, values, ctx)
    if tool is None:
        hint = "" if server_name in ctx.remote else " (is discover: true set on the server?)"
        ctx.problems.add(
            f"{item.path}.name", f"server {server_name!r} has no tool named {remote_name!r}{hint}"
        )
        ctx.skip("tools", item)
        return
    if not _sandbox_fits(tool, values, item.path, ctx):
        ctx.skip("tools", item)
        return
    # Every tool in the file gets its destination from the file: stored URLs that differ
    # (set in the admin, say) are put back and reported.
    values = {**TOOL_DESTINATION, **values}
    changed = configure_tool(tool, values)
    ctx.report.record("tools", tool.name, "updated" if changed else "unchanged", changed)
    ctx.report.restored("tools", tool.name, [name for name in changed if name in Tool.DESTINATION_FIELDS])
    if tool.quarantined and values.get("enabled"):
        ctx.report.notes.append(f"tool {tool.name} is enabled but quarantined: an admin must release it")


def _tool_fields_fit(server: ToolServer, values: dict, path: str, ctx: _Context) -> bool:
    if server.kind == ToolServer.Kind.HTTP:
        ok = True
        if "input_schema" not in values:
            ctx.problems.add(f"{path}.input_schema", "required for http tools")
            ok = False
        for key in Tool.DESTINATION_FIELDS:
            # The server's secret is only ever sent to the server's origin (tools.origins).
            url = values.get(key, "").replace("{key}", "k")
            if url and not same_origin(url, server.url):
                ctx.problems.add(
                    f"{path}.{key}",
                    f"must be on the origin of server {server.name!r} ({_origin_or_none(server.url)})",
                )
                ok = False
        return ok
    declared = ("description", "input_schema") if server.user_oauth else ()
    wrong = [key for key in HTTP_ONLY if key in values and key not in declared]
    for key in wrong:
        source = "builtin" if server.kind == ToolServer.Kind.BUILTIN else "discovered from the mcp server"
        if server.kind == ToolServer.Kind.MCP and key in ("description", "input_schema"):
            source += " (or declared in this file when the server has user_oauth: true)"
        ctx.problems.add(f"{path}.{_file_key(key)}", f"only for http tools; {server.kind} tools are {source}")
    return not wrong


def _sandbox_fits(tool: Tool, values: dict, path: str, ctx: _Context) -> bool:
    """run_python's `sandbox` (limits and prices) is the file's, like a destination; its price,
    the reservation of each call, is what those limits can cost unless the file asks for more.
    Any other tool has no sandbox."""
    if not (tool.server.kind == ToolServer.Kind.BUILTIN and tool.remote_name == run_python.NAME):
        if "sandbox" in values:
            ctx.problems.add(f"{path}.sandbox", f"only for {run_python.NAME}: this tool runs no code")
            return False
        return True
    values.setdefault("sandbox", {})
    probe = copy.copy(tool)
    probe.sandbox = values["sandbox"]
    probe.timeout_seconds = values.get("timeout_seconds", tool.timeout_seconds)
    needed = run_python.reservation_micros(probe)
    if values.get("price_micros", needed) < needed:
        ctx.problems.add(
            f"{path}.price",
            f"must be at least {needed / 1_000_000:.6f}: what this tool's sandbox limits can cost at its "
            "prices (each call reserves its price before it runs); leave price out to have it set so",
        )
        return False
    values.setdefault("price_micros", needed)
    return True


def _origin_or_none(url: str) -> str:
    try:
        return origin_text(url)
    except OriginError:
        return "it has no http(s) URL"


def _file_key(target: str) -> str:
    return next(key for key, rule in TOOL.items() if isinstance(rule, Field) and rule.target == target)


def _declaration_fits(tool: Tool | None, values: dict, path: str, ctx: _Context) -> bool:
    """A tool of a server that needs each user's token is declared here: a new one needs its input
    schema; one the server itself listed (discovery that could read the list) keeps the server's
    description and schema, and a declaration that says otherwise is refused, not copied over."""
    if tool is None:
        if "input_schema" not in values:
            ctx.problems.add(
                f"{path}.input_schema",
                "required: this server's tools are declared in this file (user_oauth: true; "
                "its list needs a user's token)",
            )
            return False
        return True
    if tool.declared:
        return True
    ok = True
    for key in ("description", "input_schema"):
        if key in values and values[key] != getattr(tool, key):
            ctx.problems.add(
                f"{path}.{key}",
                f"differs from what server {tool.server.name!r} lists for {tool.remote_name!r}; "
                "leave it out to keep the server's, or make it the same",
            )
            ok = False
    return ok


def _create_declared_tool(server: ToolServer, remote_name: str, values: dict, ctx: _Context) -> Tool:
    description = values.get("description", "")
    tool = Tool.objects.create(
        tenant=ctx.tenant,
        server=server,
        name=tool_name(server, remote_name),
        remote_name=remote_name,
        description=description,
        input_schema=values["input_schema"],
        schema_hash=schema_hash(description, values["input_schema"]),
        declared=True,
    )
    ctx.report.record("tools", tool.name, "created")
    return tool


def _create_http_tool(server: ToolServer, remote_name: str, values: dict, ctx: _Context) -> None:
    values.setdefault("description", "")
    Tool.objects.create(
        tenant=ctx.tenant,
        server=server,
        name=tool_name(server, remote_name),
        remote_name=remote_name,
        schema_hash=schema_hash(values["description"], values["input_schema"]),
        **values,
    )
    ctx.report.record("tools", tool_name(server, remote_name), "created")


# --- grants ---


def _apply_grant(item: Item, ctx: _Context) -> None:
    """grants[] with tool: use_tool and approve_tool on the tool (agents' grants come after agents)."""
    if "tool" not in item.values:
        return
    tool = Tool.objects.filter(tenant=ctx.tenant, name=item.key).first()
    if tool is None:
        ctx.missing("tools", item.key, f"{item.path}.tool", f"no tool named {item.key!r}")
        return
    _set_grants(tool, tool.name, PERMS, item.values, item.path, ctx)


def _apply_agent_grant(item: Item, ctx: _Context) -> None:
    """grants[] with agent: run_agent on the agent, once the file's agents exist."""
    if "agent" not in item.values:
        return
    name = item.values["agent"]
    agent = AgentDefinition.objects.filter(tenant=ctx.tenant, name=name).first()
    if agent is None:
        ctx.missing("agents", name, f"{item.path}.agent", f"no agent named {name!r}")
        return
    _set_grants(agent, agent.name, AGENT_PERMS, item.values, item.path, ctx)


def _apply_tenant_grants(item: Item, ctx: _Context) -> None:
    """tenant.view_runs: who reads every run of the tenant (others read the runs they started)."""
    holders = _view_runs_holders(item, ctx.plan)
    if holders is not None:
        _set_grants(ctx.tenant, ctx.tenant.slug, TENANT_PERMS, {"view_runs": holders}, item.path, ctx)


def _set_grants(obj: Any, label: str, verbs: dict[str, str], values: dict, path: str, ctx: _Context) -> None:
    """Make the object permissions `verbs` on `obj` exactly the holders the file names."""
    wanted = _wanted_grants(values, verbs, path, ctx)
    if wanted is None:
        return
    app = obj._meta.app_label
    current = _current_grants(obj, list(verbs.values()))
    for key in sorted(wanted.keys() - current.keys()):
        perm, holder, who = wanted[key]
        assign_perm(f"{app}.{perm}", holder, obj)
        ctx.report.record("grants", f"{label} {perm} {who}", "created")
    for key in sorted(current.keys() - wanted.keys()):
        perm, holder, who = current[key]
        remove_perm(f"{app}.{perm}", holder, obj)
        ctx.report.record("grants", f"{label} {perm} {who}", "removed")
    for key in sorted(wanted.keys() & current.keys()):
        perm, _, who = wanted[key]
        ctx.report.record("grants", f"{label} {perm} {who}", "unchanged")


GrantKey = tuple[str, str, int]  # (codename, "user" | "group", pk)


def _wanted_grants(
    values: dict, verbs: dict[str, str], path: str, ctx: _Context
) -> dict[GrantKey, tuple] | None:
    wanted: dict[GrantKey, tuple] = {}
    ok = True
    for verb, perm in verbs.items():
        for i, holder in enumerate(values.get(verb, [])):
            found = _holder(holder, f"{path}.{verb}[{i}]", ctx)
            if found is None:
                ok = False
            else:
                wanted[(perm, holder.split(":")[0], found.pk)] = (perm, found, holder)
    return wanted if ok else None


def _holder(holder: str, path: str, ctx: _Context) -> User | Group | None:
    kind, _, name = holder.partition(":")
    if kind == "user":
        user = User.objects.filter(tenant=ctx.tenant, username=name).first()
        if user is None:
            ctx.missing("users", name, path, f"no user named {name!r} in this tenant")
        return user
    link = TenantGroup.objects.filter(tenant=ctx.tenant, name=name).select_related("group").first()
    if link is None:
        ctx.missing("groups", name, path, f"no group named {name!r}")
    return link.group if link else None


def _current_grants(obj: Any, codenames: list[str]) -> dict[GrantKey, tuple]:
    """Direct object permissions on `obj`, read from guardian's tables (no checker cache)."""
    lookup = {
        "content_type": ContentType.objects.get_for_model(type(obj)),
        "object_pk": str(obj.pk),
        "permission__codename__in": codenames,
    }
    user_perms, group_perms = get_user_obj_perms_model(obj), get_group_obj_perms_model(obj)
    # guardian types both as type[Model]; they are its user and group permission models
    assert issubclass(user_perms, UserObjectPermissionBase)
    assert issubclass(group_perms, GroupObjectPermissionBase)
    current: dict[GrantKey, tuple] = {}
    for user_row in user_perms.objects.filter(**lookup).select_related("user", "permission"):
        current[(user_row.permission.codename, "user", user_row.user_id)] = (
            user_row.permission.codename,
            user_row.user,
            f"user:{user_row.user.username}",
        )
    for group_row in group_perms.objects.filter(**lookup).select_related("group", "permission"):
        link = TenantGroup.objects.filter(group=group_row.group).first()
        current[(group_row.permission.codename, "group", group_row.group_id)] = (
            group_row.permission.codename,
            group_row.group,
            f"group:{link.name if link else group_row.group.name}",
        )
    return current


# --- roles (tenants/roles.py) ---


def _roles_of_user(item: Item, plan: Plan) -> set[str]:
    """The user's own roles and those of the groups the file puts them in."""
    roles = set(item.values.get("roles", []))
    names = set(item.values.get("groups") or [])
    for group in plan.sections["groups"]:
        if group.key in names:
            roles |= set(group.values.get("roles", []))
    return roles


def _apply_group_roles(item: Item, ctx: _Context) -> None:
    """groups[].roles: the group's model permissions become exactly those of its roles."""
    if "roles" not in item.values:
        return
    link = TenantGroup.objects.filter(tenant=ctx.tenant, name=item.key).select_related("group").first()
    if link is not None and _set_role_permissions(link.group.permissions, item.values["roles"]):
        ctx.report.record("groups", item.key, "updated", ["roles"])


def _apply_user_roles(item: Item, ctx: _Context) -> None:
    """users[].roles: the user's own model permissions become exactly those of their roles."""
    if "roles" not in item.values:
        return
    user = User.objects.filter(tenant=ctx.tenant, username=item.key).first()
    if user is not None and _set_role_permissions(user.user_permissions, item.values["roles"]):
        ctx.report.record("users", item.key, "updated", ["roles"])


def _set_role_permissions(permissions, roles: list[str]) -> bool:
    """Make a user's or group's model permissions exactly the roles' (a removed role's go)."""
    wanted = set(permissions_for(roles))
    current = set(permissions.all())
    permissions.remove(*(current - wanted))
    permissions.add(*(wanted - current))
    return current != wanted


def _view_runs_holders(item: Item, plan: Plan) -> list[str] | None:
    """tenant.view_runs plus every user and group of the file with the supervisor role; None (leave
    the stored holders) when the file gives neither view_runs nor any roles."""
    listed = item.values.get("view_runs")
    people = [("user", user) for user in plan.sections["users"]]
    people += [("group", group) for group in plan.sections["groups"]]
    if listed is None and not any("roles" in entry.values for _, entry in people):
        return None
    supervisors = [
        f"{kind}:{entry.key}" for kind, entry in people if VIEWS_ALL_RUNS in entry.values.get("roles", [])
    ]
    return list(dict.fromkeys([*(listed or []), *supervisors]))


# --- agents ---


def _apply_agent(item: Item, ctx: _Context) -> None:
    definition, created = AgentDefinition.objects.get_or_create(tenant=ctx.tenant, name=item.key)
    ctx.report.record("agents", item.key, "created" if created else "unchanged")
    stored = [
        _apply_version(definition, spec, f"{item.path}.versions[{j}]", ctx)
        for j, spec in enumerate(item.values.get("versions", []))
    ]
    if not all(stored):
        return  # the numbers the aliases name may belong to the versions that failed
    for alias, number in item.values.get("aliases", {}).items():
        _apply_alias(definition, alias, number, f"{item.path}.aliases.{alias}", ctx)


def _apply_version(definition: AgentDefinition, spec: dict, path: str, ctx: _Context) -> bool:
    errors = validate_spec(spec, ctx.tenant)
    if errors:
        for key, messages in errors.items():
            if not _reported_elsewhere(spec, key, ctx):
                for message in messages:
                    ctx.problems.add(path if key == "spec" else f"{path}.{key}", message)
        return False
    # Any earlier version with this content counts, not only the latest as in create_version,
    # so that re-applying [v1, v2] does not store v1 again as v3.
    existing = definition.versions.filter(content_hash=digest(spec)).order_by("number").first()
    if existing is not None:
        ctx.report.record("versions", f"{definition.name} v{existing.number}", "unchanged")
        return True
    version, _ = create_version(tenant=ctx.tenant, agent=definition.name, spec=spec)
    ctx.report.record("versions", f"{definition.name} v{version.number}", "created")
    return True


def _reported_elsewhere(spec: dict, key: str, ctx: _Context) -> bool:
    """A spec naming an endpoint or tool that was left out for its own errors."""
    if key == "model":
        return ctx.plan.is_dropped("model_endpoints", str(spec.get("model")))
    match = re.fullmatch(r"tools\[(\d+)\]", key)
    return match is not None and ctx.plan.is_dropped("tools", str(spec["tools"][int(match.group(1))]))


def _apply_alias(definition: AgentDefinition, alias: str, number: int, path: str, ctx: _Context) -> None:
    label = f"{definition.name}@{alias}"
    if not definition.versions.filter(number=number).exists():
        ctx.problems.add(path, f"agent {definition.name!r} has no version {number}")
        return
    current = Alias.objects.filter(agent=definition, name=alias).select_related("version").first()
    if current is not None and current.version.number == number:
        ctx.report.record("aliases", label, "unchanged")
        return
    move_alias(tenant=ctx.tenant, agent=definition.name, alias=alias, version=number)
    ctx.report.record("aliases", label, "created" if current is None else "updated", [f"v{number}"])


# --- webhooks ---


def _apply_webhook(item: Item, ctx: _Context) -> None:
    """A webhook's URL passed the egress check before this phase (configuration/egress.py)."""
    values = {k: v for k, v in item.values.items() if k not in ("name", "signing_secret")}
    secret = item.values["signing_secret"]
    hook = Webhook.objects.filter(tenant=ctx.tenant, name=item.key).first()
    if hook is None:
        hook = Webhook(tenant=ctx.tenant, name=item.key, **values)
        hook.set_signing_secret(secret)
        hook.save()
        ctx.report.record("webhooks", item.key, "created")
        return
    changed = assign(hook, values)
    if not _same_signing_secret(hook, secret):
        # Fernet is randomised: re-encrypting an unchanged secret would look like a change.
        hook.set_signing_secret(secret)
        hook.save(update_fields=["signing_ciphertext", "updated_at"])
        changed.append("signing_secret")
    ctx.report.record("webhooks", item.key, "updated" if changed else "unchanged", changed)
    ctx.report.restored("webhooks", item.key, [name for name in changed if name in ("url", "signing_secret")])


def _same_signing_secret(hook: Webhook, secret: str) -> bool:
    try:
        return hook.signing_secret() == secret
    except SecretKeyError:
        return False  # stored under a retired key: the file's value replaces it
