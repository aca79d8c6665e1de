"""Writes on the tool catalogue that more than one entry point needs (admin, `manage.py apply`)."""

from __future__ import annotations

from django.db.models import F

from approvals import tool_rules
from tools.catalog import schema_hash
from tools.models import Tool


def configure_tool(tool: Tool, values: dict) -> list[str]:
    """Apply settings to a tool; returns the names of the fields that changed.

    A new approval rule (approvals/tool_rules.py, checked by the caller) bumps policy_version, so
    approvals granted under the old rule no longer match the digest of the call; the same rule in
    another layout changes nothing. Quarantine is never cleared here: releasing it is a
    person's decision (tools.catalog.release_quarantine).
    """
    changes = {
        name: value
        for name, value in values.items()
        if name != "approval_policy" and getattr(tool, name) != value
    }
    if "approval_policy" in values and not tool_rules.same(tool.approval_policy, values["approval_policy"]):
        changes["approval_policy"] = values["approval_policy"]
        changes["policy_version"] = F("policy_version") + 1
    if {"description", "input_schema"} & set(changes):
        changes["schema_hash"] = schema_hash(
            values.get("description", tool.description), values.get("input_schema", tool.input_schema)
        )
    if changes:
        Tool.objects.filter(pk=tool.pk).update(**changes)
    return [name for name in changes if name not in ("policy_version", "schema_hash")]
