"""Reads of runs, always scoped to the caller's tenant (another tenant's run answers 404)."""

from __future__ import annotations

import uuid

from agents.models import AgentDefinition
from core.errors import NotFound
from runs.models import Run, RunEvent, Step
from tenants.models import User
from tenants.permissions import may_view_all_runs


def runs_for(
    user,
    *,
    status: str | None = None,
    agent: str | None = None,
    created_by: str | None = None,
    evaluation: bool | None = False,
):
    """The runs `user` may read: every run of the tenant with view_runs, else the ones they started.

    `evaluation`: False (lists, search, the desk) leaves out evaluations' runs (evals/), which are
    not the tenant's work; None takes both (a run looked up by its id, as an evaluation links it).
    """
    runs = Run.objects.filter(tenant_id=user.tenant_id).select_related(
        "agent", "version", "created_by", "budget"
    )
    if evaluation is not None:
        runs = runs.filter(evaluation=evaluation)
    if not may_view_all_runs(user):
        runs = runs.filter(created_by_id=user.pk)
    if status:
        runs = runs.filter(status=status)
    # Names are turned into ids first: with a literal id PostgreSQL plans against the
    # (tenant, agent | creator, created_at) index and knows how many rows to expect; through a
    # join it guesses, and for a name with no runs walked the tenant's whole history (1.8 s at a
    # million runs, bench/run_search.py).
    if agent:
        runs = runs.filter(
            agent_id=_id_or_none(AgentDefinition.objects.filter(tenant_id=user.tenant_id, name=agent))
        )
    if created_by:
        runs = runs.filter(
            created_by_id=_id_or_none(User.objects.filter(tenant_id=user.tenant_id, username=created_by))
        )
    return runs


def _id_or_none(queryset):
    return queryset.values_list("pk", flat=True).first()


def get_run(user, run_id) -> Run:
    run = _visible(user, run_id).first()
    if run is None:
        raise NotFound("run")
    return run


def visible_run_id(user, run_id) -> uuid.UUID:
    """The id of a run `user` may see, or NotFound, without reading (and opening) its content:
    for the views that need only to know that (the live stream, opened by a thousand clients)."""
    found = _id_or_none(_visible(user, run_id))
    if found is None:
        raise NotFound("run")
    return found


def _visible(user, run_id):
    """The run `run_id` if `user` may see it (an empty queryset if not); NotFound for a malformed id."""
    try:
        return runs_for(user, evaluation=None).filter(pk=uuid.UUID(str(run_id)))
    except ValueError:  # a malformed id is a 404 too
        raise NotFound("run") from None


def steps_of(run: Run):
    return Step.objects.filter(run=run).select_related("tool").order_by("seq")


def events_of(run: Run, *, after: int | None = None):
    """The run's events in order; `after`: only those with a larger seq (the API's event id)."""
    events = RunEvent.objects.filter(run=run).select_related("actor").order_by("seq")
    return events.filter(seq__gt=after) if after else events
