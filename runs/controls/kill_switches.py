"""Kill switches: an operator's stop on a tenant, an agent, a tool or a model endpoint.

    flip(actor, scope, target, on, reason)   turn a switch on or off (audited: KillSwitchChange);
                                             off resumes the runs it paused, oldest pause first,
                                             at pausing.RESUME_PER_SECOND
    refuse_start(tenant, agent_id)           services.start_run: a killed tenant or agent starts
                                             no run (423, naming the switch, who set it and why)
    killed(tool_id= | endpoint_id=)          before every call is reserved and sent: the claim
                                             (a new call, an approved one, a retry or a status
                                             lookup) and mark_after_lookup (a resend after a
                                             lookup found nothing); a killed tool or endpoint is
                                             never called
    pause_by(run, switch)                    what the engine does then: the run is paused with the
                                             switch as its reason; or, for a tool call never sent
                                             whose tenant chose so (answers_unavailable), the
                                             call is answered as unavailable and the model goes on

The probe is one statement on the partial index `kill_switch_on` (empty while no switch is on).
A call already committed as `dispatching` before a switch went on is in flight and finishes; no
call after that is sent. A call that was sent before (a retry of an unknown outcome, one a
person asked to retry) always pauses: the model must not hear "unavailable" about a call that
may have happened.

Who may flip (may_flip): platform operators everywhere; a tenant's supervisors (who may pause its
runs) every switch of their tenant; a tenant's operators (the `operator` role: tools.change_tool,
llm.change_modelendpoint) the switches of their tenant's tools and model endpoints, which they
configure, but not a whole tenant or agent. Every flip is kept (KillSwitchChange) and written to
the admin's Recent actions (runs/controls/audit.py).
"""

from __future__ import annotations

from django.db import transaction
from django.db.models import Model, Q
from django.utils import timezone

from agents.models import AgentDefinition
from core.errors import DomainError, Forbidden
from llm.models import ModelEndpoint
from runs.controls import audit, pausing
from runs.models import ClaimReads, KillSwitch, KillSwitchChange, Run, RunStatus
from runs.transitions import atomic_with_events, lock_run, record_event, transition_run
from tenants.models import Tenant, User
from tools.models import Tool

Scope = KillSwitch.Scope


def target_of(scope: str, name: str, tenant: Tenant):
    """The switch's target by name within the tenant (a tenant by its slug)."""
    found = {
        Scope.TENANT: lambda: Tenant.objects.filter(pk=tenant.pk, slug=name).first(),
        Scope.AGENT: lambda: AgentDefinition.objects.filter(tenant=tenant, name=name).first(),
        Scope.TOOL: lambda: Tool.objects.filter(tenant=tenant, name=name).first(),
        Scope.ENDPOINT: lambda: ModelEndpoint.objects.filter(tenant=tenant, name=name).first(),
    }[Scope(scope)]()
    if found is None:
        raise DomainError(f"no {scope} {name} in {tenant.slug}", fields={"target": [f"no such {scope}"]})
    return found


# The model permission (of the tenant's `operator` role) that lets a tenant's staff flip a scope's
# switches without being a supervisor: they configure these targets already.
CONFIGURES = {Scope.TOOL: "tools.change_tool", Scope.ENDPOINT: "llm.change_modelendpoint"}


def scopes_for(user, tenant_id) -> list[str]:
    """The scopes whose switches `user` may flip in the tenant (empty: none)."""
    if user is None or not user.is_active:
        return []
    if pausing.may_pause(user, tenant_id):
        return list(Scope.values)
    if not user.is_staff or tenant_id is None or user.tenant_id != tenant_id:
        return []
    return [scope for scope, perm in CONFIGURES.items() if user.has_perm(perm)]


def may_flip(user, tenant_id, scope: str | None = None) -> bool:
    """Whether `user` may flip the tenant's switches of `scope` (any scope, if None)."""
    scopes = scopes_for(user, tenant_id)
    return bool(scopes) if scope is None else scope in scopes


def require_may_flip(user, tenant_id, scope: str | None = None) -> None:
    if not may_flip(user, tenant_id, scope):
        raise Forbidden(
            "only platform operators and the tenant's supervisors may flip this switch "
            "(and the tenant's operators its tools' and model endpoints' switches)",
            code="not_permitted",
        )


def target_names(scope: str, tenant_id: int | None) -> list[str]:
    """The names a switch of `scope` can name (the admin's pickers), in the tenant or, for None,
    in every tenant; a tenant by its slug."""
    model: type[Model]
    model, field = {
        Scope.TENANT: (Tenant, "slug"),
        Scope.AGENT: (AgentDefinition, "name"),
        Scope.TOOL: (Tool, "name"),
        Scope.ENDPOINT: (ModelEndpoint, "name"),
    }[Scope(scope)]
    rows = model._default_manager.all()
    if tenant_id is not None:
        rows = rows.filter(pk=tenant_id) if model is Tenant else rows.filter(tenant_id=tenant_id)
    return list(rows.order_by(field).values_list(field, flat=True).distinct())


def flip(*, actor, tenant: Tenant, scope: str, target: str, on: bool, reason: str) -> KillSwitchChange:
    if not reason.strip():
        raise DomainError("say why", fields={"reason": ["a reason is required"]})
    require_may_flip(actor, tenant.pk, scope)
    obj = target_of(scope, target, tenant)
    with transaction.atomic():
        switch, created = KillSwitch.objects.select_for_update().get_or_create(
            scope=scope,
            target_id=obj.pk,
            defaults={
                "tenant": tenant,
                "target_name": target,
                "on": on,
                "changed_by": actor,
                "reason": reason,
                "changed_at": timezone.now(),
            },
        )
        KillSwitch.objects.filter(pk=switch.pk).update(
            on=on, changed_by=actor, reason=reason, changed_at=timezone.now()
        )
        switch.on, switch.changed_by, switch.reason = on, actor, reason
        change = KillSwitchChange.objects.create(switch=switch, on=on, actor=actor, reason=reason)
        audit.logged(actor, switch, f"Turned {'on' if on else 'off'}: {reason}", added=created)
    if not on:
        change.runs_resumed = _resume_paused_by(switch, actor=actor, reason=reason)
        KillSwitchChange.objects.filter(pk=change.pk).update(runs_resumed=change.runs_resumed)
    return change


def _resume_paused_by(switch: KillSwitch, *, actor, reason: str) -> int:
    count = 0
    for run_id in (
        Run.objects.filter(paused_by_switch=switch, status=RunStatus.PAUSED)
        .order_by("paused_at", "created_at")
        .values_list("pk", flat=True)
    ):
        with atomic_with_events():
            run = lock_run(run_id)
            if run.status != RunStatus.PAUSED or run.paused_by_switch_id != switch.pk:
                continue  # resumed, or paused again by a person, meanwhile
            count += pausing._resume(
                run,
                actor=actor,
                reason=f"kill switch {switch.scope} {switch.target_name} turned off: {reason}",
                countdown=count / pausing.RESUME_PER_SECOND,
                bulk=None,
            )
    return count


def describe(switch: KillSwitch) -> str:
    who = switch.changed_by.username if switch.changed_by is not None else "an operator"
    return f"kill switch on {switch.scope} {switch.target_name}, set by {who}: {switch.reason}"


def refuse_start(tenant: Tenant, agent_id: int) -> None:
    """A run of a killed tenant or agent is not started (423, with the switch's who and why)."""
    switch = (
        KillSwitch.objects.filter(on=True)
        .filter(Q(scope=Scope.TENANT, target_id=tenant.pk) | Q(scope=Scope.AGENT, target_id=agent_id))
        .select_related("changed_by")
        .first()
    )
    if switch is not None:
        raise DomainError(f"no new runs: {describe(switch)}", code="kill_switch_on", status=423)


def killed(
    *, tool_id: int | None = None, endpoint_id: int | None = None, reads: ClaimReads | None = None
) -> KillSwitch | None:
    """The switch that is on for this tool (or endpoint), if any: probed before every call is
    reserved and sent (the claim, and runs.engine.dispatch.mark_after_lookup before a resend).

    `reads`: what the claim read with the run's lock; when no tool or endpoint switch of the
    tenant was on then, there is nothing to probe."""
    scope, target = (Scope.TOOL, tool_id) if tool_id is not None else (Scope.ENDPOINT, endpoint_id)
    if target is None:
        return None
    if reads is not None and not reads.switches_on:
        return None  # read with the run's lock: no tool or endpoint switch of its tenant is on
    return (
        KillSwitch.objects.filter(on=True, scope=scope, target_id=target).select_related("changed_by").first()
    )


def answers_unavailable(run: Run) -> bool:
    """The tenant's choice for a killed tool's call never sent (Tenant.on_killed_tool): answer it
    as unavailable and let the model go on, instead of pausing the run."""
    return run.tenant.on_killed_tool == Tenant.OnKilledTool.UNAVAILABLE


def pause_by(run: Run, switch: KillSwitch) -> None:
    """With `run` locked, before anything is reserved: the run is paused with the switch as its
    reason (and holds no lease: transition_run drops it); turning the switch off resumes it."""
    if run.pause_requested:
        # A person asked first: theirs is the pause taken (who, why, until), and turning the
        # switch off does not undo it.
        who: dict = {"paused_by_id": run.paused_by_id, "pause_reason": run.pause_reason}
        who.update(paused_until=run.paused_until, paused_by_switch=None)
    else:
        who = dict(paused_by=switch.changed_by, pause_reason=describe(switch), paused_until=None)
        who.update(paused_by_switch=switch)
    message = f"paused: {who['pause_reason']}"
    transition_run(
        run, RunStatus.PAUSED, message=message, pause_requested=False, paused_at=timezone.now(), **who
    )
    actor_id = run.paused_by_id if run.pause_requested else switch.changed_by_id
    record_event(
        run.pk,
        "paused",
        message,
        actor=User(pk=actor_id) if actor_id else None,
        reason=who["pause_reason"],
        until=who["paused_until"].isoformat() if who["paused_until"] else None,
        kill_switch=switch.pk,
        at_step_boundary=True,
    )
