"""Reads of runs, always scoped to the caller's tenant (another tenant's run answers 404)."""

from __future__ import annotations

import uuid

from agentplatform.errors import NotFound
from runs.models import Run, RunEvent, Step
from tenants.permissions import may_view_all_runs


def runs_for(user, *, status: str | None = None, agent: str | None = None, created_by: str | None = None):
    """The runs `user` may read: every run of the tenant with view_runs, else the ones they started."""
    runs = Run.objects.filter(tenant_id=user.tenant_id).select_related(
        "agent", "version", "created_by", "budget"
    )
    if not may_view_all_runs(user):
        runs = runs.filter(created_by_id=user.pk)
    if status:
        runs = runs.filter(status=status)
    if agent:
        runs = runs.filter(agent__name=agent)
    if created_by:
        runs = runs.filter(created_by__username=created_by)
    return runs


def get_run(user, run_id) -> Run:
    try:
        return runs_for(user).get(pk=uuid.UUID(str(run_id)))
    except (Run.DoesNotExist, ValueError):  # a malformed id is a 404 too
        raise NotFound("run") from None


def steps_of(run: Run):
    return Step.objects.filter(run=run).select_related("tool").order_by("seq")


def events_of(run: Run, *, after: int | None = None):
    """The run's events in order; `after`: only those with a larger seq (the API's event id)."""
    events = RunEvent.objects.filter(run=run).select_related("actor").order_by("seq")
    return events.filter(seq__gt=after) if after else events
