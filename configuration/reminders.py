"""`remind_after`, `escalate_after` and `escalate_to` of the tenant and of its tools: checked
against the groups, tools and approval lifetimes as written, and stored as ReminderRule rows
(approvals/reminders.py reads them when an approval is requested). The file owns them: a key
left out of the tenant section means no reminder or escalation, one left out of a tool inherits
the tenant's, and null on a tool turns it off for that tool.
"""

from __future__ import annotations

from dataclasses import dataclass

from approvals.models import ReminderRule
from configuration.report import ApplyReport
from configuration.rows import assign
from configuration.schema import Item, Plan, Problems
from tenants.models import Tenant, TenantGroup
from tools.models import Tool

OFF = 0  # stored on a tool's rule: the tenant's value does not apply to this tool


@dataclass
class _Rule:
    remind: int | None
    escalate: int | None
    group: TenantGroup | None


def apply(tenant: Tenant, plan: Plan, problems: Problems, report: ApplyReport) -> None:
    assert plan.tenant is not None
    before = len(problems)
    groups = {link.name: link for link in TenantGroup.objects.filter(tenant=tenant)}
    base = _tenant_rule(plan.tenant, tenant, groups, plan, problems)
    tools: list[tuple[Tool, _Rule | None]] = []
    for item in plan.sections["tools"]:
        tool = Tool.objects.filter(
            tenant=tenant, server__name=item.values["server"], remote_name=item.values["remote_name"]
        ).first()
        if tool is not None:  # a tool the file could not write is reported where it failed
            tools.append((tool, _tool_rule(item, tool, base, tenant, groups, plan, problems)))
    if len(problems) > before:
        return
    _store(tenant, None, base, tenant.slug, "tenant", report)
    for tool, rule in tools:
        _store(tenant, tool, rule, tool.name, "tools", report)


def _group(name: str | None, path: str, groups: dict, plan: Plan, problems: Problems) -> TenantGroup | None:
    if name is None:
        return None
    if name not in groups and not plan.is_dropped("groups", name):
        problems.add(path, f"no group named {name!r} in this tenant")
    return groups.get(name)


def _tenant_rule(item: Item, tenant: Tenant, groups: dict, plan: Plan, problems: Problems) -> _Rule:
    values = item.values
    rule = _Rule(
        values.get("remind_after_seconds"),
        values.get("escalate_after_seconds"),
        _group(values.get("escalate_to"), "tenant.escalate_to", groups, plan, problems),
    )
    if rule.escalate and values.get("escalate_to") is None:
        problems.add("tenant.escalate_to", "required with escalate_after: the group the approval goes to")
    if values.get("escalate_to") is not None and not rule.escalate:
        problems.add("tenant.escalate_after", "required with escalate_to: when the approval goes to it")
    _check_times(rule, tenant.approval_ttl_seconds, "tenant", "approval_ttl_seconds", problems)
    return rule


def _tool_rule(
    item: Item, tool: Tool, base: _Rule, tenant: Tenant, groups: dict, plan: Plan, problems: Problems
) -> _Rule | None:
    """The tool's own rule (None when it sets none of the keys), checked as merged with the tenant's."""
    values = item.values
    keys = {"remind_after_seconds", "escalate_after_seconds", "escalate_to"} & set(values)
    if not keys:
        own = None
    else:
        own = _Rule(
            _own(values, "remind_after_seconds"),
            _own(values, "escalate_after_seconds"),
            _group(values.get("escalate_to"), f"{item.path}.escalate_to", groups, plan, problems),
        )
    merged = _Rule(
        base.remind if own is None or own.remind is None else own.remind,
        base.escalate if own is None or own.escalate is None else own.escalate,
        own.group if own is not None and own.group is not None else base.group,
    )
    if own is not None and merged.escalate and merged.group is None and "escalate_to" not in values:
        problems.add(f"{item.path}.escalate_to", "required with escalate_after (the tenant names no group)")
    if "escalate_to" in values and not merged.escalate:
        problems.add(
            f"{item.path}.escalate_after",
            "required with escalate_to (the tenant has no escalate_after for this tool to inherit)",
        )
    ttl = tool.approval_ttl_seconds or tenant.approval_ttl_seconds
    _check_times(merged, ttl, item.path, "approval_ttl_seconds", problems)
    return own


def _own(values: dict, key: str) -> int | None:
    if key not in values:
        return None  # inherit the tenant's
    return OFF if values[key] is None else values[key]


def _check_times(rule: _Rule, ttl: int, path: str, ttl_key: str, problems: Problems) -> None:
    if rule.remind and rule.escalate and rule.escalate <= rule.remind:
        problems.add(
            f"{path}.escalate_after", f"must be later than remind_after ({rule.remind} s): remind first"
        )
    for key, seconds in (("remind_after", rule.remind), ("escalate_after", rule.escalate)):
        if seconds and seconds >= ttl:
            problems.add(
                f"{path}.{key}",
                f"must be shorter than the approval's lifetime ({ttl_key} {ttl} s): it would expire first",
            )


def _store(tenant: Tenant, tool: Tool | None, rule: _Rule | None, label: str, kind: str, report) -> None:
    stored = ReminderRule.objects.filter(tenant=tenant, tool=tool).first()
    if rule is None or (rule.remind is None and rule.escalate is None and rule.group is None):
        if stored is not None:
            stored.delete()
            report.record(kind, label, "updated", ["reminders removed"])
        return
    values = {
        "remind_after_seconds": rule.remind,
        "escalate_after_seconds": rule.escalate,
        "escalate_to": rule.group,
    }
    if stored is None:
        ReminderRule.objects.create(tenant=tenant, tool=tool, **values)
        report.record(kind, label, "updated", ["reminders"])
        return
    changed = assign(stored, values)
    if changed:
        report.record(kind, label, "updated", [name.removesuffix("_seconds") for name in changed])
