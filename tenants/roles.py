"""Roles: the named sets of Django model permissions a tenant's people get from the config file.

A role answers "which admin pages may this person open and what may they change there"; rows
stay limited to the tenant (tenants.admin_site.scope), and object permissions still decide
per object: approving a call needs approve_tool on its tool, starting a run run_agent on its agent.
The table in docs/configuration.md lists the same permissions; tests/configuration/test_apply_roles.py
checks that every page the admin links to opens for the role that sees the link.
"""

from __future__ import annotations

from django.contrib.auth.models import Permission
from django.db.models import Q

# Every role works in the admin, so a user with a role is staff (unless the file says otherwise,
# which is an error).
ROLES: dict[str, tuple[str, ...]] = {
    # Watches runs, decides approvals (with approve_tool on the tool), resolves calls whose outcome
    # is unknown (same grant), cancels runs, reads usage and clears the holds of lost model calls
    # (README: reconciled by a supervisor), reads datasets and evaluations and adds finished runs
    # to datasets (a run that went wrong becomes a case). Also holds the tenant's view_runs object
    # permission (every run of the tenant, not only their own).
    "supervisor": (
        "tenants.view_tenant",
        "runs.view_run",
        "runs.change_run",
        "approvals.view_approval",
        "agents.view_agentdefinition",
        "agents.view_agentversion",
        "tools.view_tool",
        "budgets.view_reservation",
        "budgets.change_reservation",
        "evals.view_dataset",
        "evals.view_datasetversion",
        "evals.view_case",
        "evals.change_dataset",
        "evals.view_evaluation",
        "evals.view_caseresult",
    ),
    # Follows the runs they may see (their own; every run with tenant.view_runs) and the agent
    # versions those runs pin.
    "support": (
        "runs.view_run",
        "agents.view_agentdefinition",
        "agents.view_agentversion",
    ),
    # Runs the tenant's setup: reviews and configures tools (not where calls go: the file owns
    # destinations), syncs servers, rotates secrets, moves aliases (and so gates and canaries: a
    # canary is started, promoted or rolled back on its alias), sets budgets and clears holds, and
    # keeps the datasets that gate releases.
    "operator": (
        "tenants.view_tenant",
        "tenants.change_tenant",
        "tenants.view_secret",
        "tenants.add_secret",
        "tenants.change_secret",
        "tools.view_toolserver",
        "tools.change_toolserver",
        "tools.view_tool",
        "tools.change_tool",
        "llm.view_modelendpoint",
        "llm.change_modelendpoint",
        "agents.view_agentdefinition",
        "agents.view_agentversion",
        "agents.view_alias",
        "agents.change_alias",
        "runs.view_run",
        "budgets.view_reservation",
        "budgets.change_reservation",
        "connections.manage_connections",
        "evals.view_dataset",
        "evals.view_datasetversion",
        "evals.view_case",
        "evals.change_dataset",
        "evals.view_evaluation",
        "evals.view_caseresult",
    ),
}

# The role whose holders read every run of the tenant (object permission tenants.view_runs).
VIEWS_ALL_RUNS = "supervisor"


def role_names() -> list[str]:
    return list(ROLES)


def permission_labels(roles: list[str]) -> set[str]:
    """The `app.codename` labels the roles give together."""
    return {label for role in roles for label in ROLES[role]}


def permissions_for(roles: list[str]) -> list[Permission]:
    """The Permission rows of the roles, in a stable order."""
    labels = permission_labels(roles)
    if not labels:
        return []
    match = Q()
    for label in labels:
        app, codename = label.split(".")
        match |= Q(content_type__app_label=app, codename=codename)
    found = list(Permission.objects.filter(match).select_related("content_type").order_by("pk"))
    # A renamed model would otherwise silently shrink a role.
    assert len(found) == len(labels), sorted(
        labels - {f"{p.content_type.app_label}.{p.codename}" for p in found}
    )
    return found
