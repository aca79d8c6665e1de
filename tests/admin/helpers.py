"""Builders for admin tests: supervisors with the usual model permissions, runs parked on approval."""

from __future__ import annotations

from django.contrib.auth.models import Group, Permission

from approvals.models import Approval
from runs.models import RunStatus
from runs.services import start_run
from tests import factories
from tests.conftest import drive

# What a supervisor's group holds in the model-permission sense; approve_tool comes per tool.
SUPERVISOR_PERMS = [
    "tenants.view_tenant",
    "tenants.view_secret",
    "tenants.add_secret",
    "tenants.change_secret",
    "agents.view_agentdefinition",
    "agents.view_agentversion",
    "tools.view_tool",
    "tools.change_tool",
    "runs.view_run",
    "runs.change_run",
    "budgets.view_reservation",
    "budgets.change_reservation",
]


def make_supervisor(tenant, username: str):
    user = factories.make_user(tenant, username, staff=True)
    group = Group.objects.filter(name=f"{tenant.slug}:supervisors").first() or factories.make_group(
        tenant, "supervisors"
    )
    if not group.permissions.exists():
        for label in SUPERVISOR_PERMS:
            app, codename = label.split(".")
            group.permissions.add(Permission.objects.get(content_type__app_label=app, codename=codename))
    user.groups.add(group)
    factories.grant_view_runs(tenant, group)
    return user


def echo_call_agent(tenant, tool, *, name: str, arguments: dict):
    """An agent that calls `tool` once with `arguments`, then answers "done"."""
    endpoint = factories.make_endpoint(
        tenant,
        name=f"{name}-model",
        config={
            "turns": [
                {"text": "Let me do that.", "tool_calls": [{"name": tool.name, "arguments": arguments}]},
                {"text": "done"},
            ]
        },
    )
    return factories.make_agent(tenant, name=name, tools=[tool], endpoint=endpoint)


def park_on_approval(requester, agent: str) -> Approval:
    """Start a run of `agent` as `requester` and drive it until it waits for approval."""
    run, _ = start_run(user=requester, agent=agent, input={"case": agent})
    run = drive(run.pk)
    assert run.status == RunStatus.WAITING_APPROVAL, (run.status, run.error)
    return Approval.objects.select_related("tool", "run").get(run=run)
