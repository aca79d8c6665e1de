"""Every stored approval rule in the retired expression language becomes Cedar, once.

    tools.Tool.approval_policy     `amount > 5000 or currency != 'INR'` becomes one Cedar permit
                                   annotated @approval for the tool's calls (id <tool>.approval);
                                   `never` and `always` stay: they are Cedar shorthands now
    agents.AgentVersion.spec       each entry of `approval_overrides` likewise (id
                                   <tool>.approval.override); the version keeps its id and number
                                   (runs and aliases still name it) and its content_hash is
                                   computed again over the converted spec, so that re-applying the
                                   converted file finds the version instead of publishing a copy

A rule with no exact Cedar equivalent is stored as its nearest stricter Cedar policy, which is
what it was already evaluated as, and reported with why; a stored text that is no rule at all
(it could only ever fail) becomes `always`. No call is decided differently after the migration
than before it, so no tool's policy_version moves and approvals already granted still cover
their calls. Approvals keep the rule they recorded when they were asked (their `policy`), as it
was written then. One line per converted rule is printed, with the Cedar it became.

Irreversible: the code that read the old language is gone.
"""

import io
import sys

import cedarpy
from django.db import migrations

from approvals.migrations import _retired_rules as retired
from core.digests import digest


def _cedar(text: str, *, tool: str, policy_id: str) -> tuple[str, str]:
    """(the rule to store, why it is not an exact conversion or "")."""
    word = text.strip()
    if word in ("never", "always"):
        return word, ""
    try:
        return retired.to_cedar(text, tool=tool, policy_id=policy_id), ""
    except retired.Unconvertible as exc:
        return exc.nearest, f"{exc.detail}; stored as the nearest stricter Cedar policy"
    except retired.PolicyError as exc:
        return "always", f"does not parse ({exc}); stored as always"


def _is_retired(text: str) -> bool:
    """Not a shorthand and not Cedar (no text of the old language parses as Cedar, nor the reverse)."""
    if text.strip() in ("never", "always"):
        return False
    try:
        cedarpy.policies_to_json_str(text)
    except ValueError:
        return True
    return False


def convert(Tool, AgentVersion, write) -> dict:
    """Convert the stored rules of these models (the migration's, or the current ones in tests)."""
    counts = {"tools": 0, "overrides": 0, "versions": 0, "not exact": 0}

    def report(what: str, old: str, new: str, why: str) -> None:
        counts["not exact"] += bool(why)
        write(f"  {'NOT EXACT ' if why else ''}{what}: {old.strip()}\n")
        if why:
            write(f"    {why}\n")
        write("".join(f"    {line}\n" for line in new.splitlines()))

    for tool in Tool.objects.select_related("tenant").order_by("pk"):
        if not _is_retired(tool.approval_policy or "never"):
            continue
        new, why = _cedar(tool.approval_policy, tool=tool.name, policy_id=f"{tool.name}.approval")
        Tool.objects.filter(pk=tool.pk).update(approval_policy=new)
        counts["tools"] += 1
        report(f"tool {tool.name} of {tool.tenant.slug}", tool.approval_policy, new, why)
    for version in AgentVersion.objects.select_related("agent__tenant").order_by("pk"):
        overrides = version.spec.get("approval_overrides") if isinstance(version.spec, dict) else None
        if not isinstance(overrides, dict):
            continue
        converted = {}
        for name, rule in overrides.items():
            if isinstance(rule, str) and not _is_retired(rule):
                converted[name] = rule
                continue
            new, why = _cedar(str(rule), tool=str(name), policy_id=f"{name}.approval.override")
            converted[name] = new
            counts["overrides"] += 1
            where = f"{version.agent.tenant.slug}/{version.agent.name} v{version.number}"
            report(f"override of {name} in {where}", str(rule), new, why)
        if converted != overrides:
            spec = {**version.spec, "approval_overrides": converted}
            AgentVersion.objects.filter(pk=version.pk).update(spec=spec, content_hash=digest(spec))
            counts["versions"] += 1
    if counts["tools"] or counts["overrides"]:
        write(
            f"  approval rules now in Cedar: {counts['tools']} tool rule(s), {counts['overrides']} "
            f"override(s) in {counts['versions']} agent version(s); {counts['not exact']} not exact\n"
        )
    return counts


def forwards(apps, schema_editor) -> None:
    printed = io.StringIO()
    convert(apps.get_model("tools", "Tool"), apps.get_model("agents", "AgentVersion"), printed.write)
    if printed.getvalue():
        # migrate has written "Applying approvals.0006...", and writes " OK" next.
        sys.stdout.write("\n" + printed.getvalue())


class Migration(migrations.Migration):
    dependencies = [
        ("approvals", "0005_reminders"),
        ("agents", "0003_agent_run_agent_permission"),
        ("tools", "0004_sandbox_limits"),
    ]

    operations = [migrations.RunPython(forwards, elidable=False)]
