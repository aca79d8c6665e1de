"""Pause and resume: an operator's hold on a run, taken at a step boundary, and its release.

    pause_run(run_id, actor, reason, until)   a run no worker holds is paused now; one whose call
                                              is in flight gets `pause_requested`: its record (or
                                              the next claim: decisions.Pause) pauses it once the
                                              call's outcome is recorded, so nothing is lost
    resume_run(run_id, actor, reason)         a paused run goes on where it stopped; a pause that
                                              was only requested is withdrawn
    pause_matching / resume_matching          the same for every run a filter matches, audited as
                                              one BulkAction plus one event per run; resumes are
                                              sent at RESUME_PER_SECOND (no thundering herd)

A paused run is a row: no lease, no message (one still queued is dropped by the claim, which finds
the run paused), no open reservation. Approvals can still be decided (the step moves, the run
stays paused; resume dispatches it with the usual fresh checks) and keep their expiry.

The deadline is the tenant's choice (Tenant.paused_time_counts). By default a pause does not
count toward max_wall_seconds: on resume `deadline_at` moves later by the time the run spent
paused, and the sweeper never stops a paused run for its deadline. A tenant that counts paused
time keeps the deadline, and the sweeper stops a run still paused when it passes.

`paused_until`: a pause given an end time is resumed by the sweeper once it has passed
(resume_due, a beat pass: the run holds no worker meanwhile). A pause without one waits for a
person, or for the switch that took it to go off; nothing else wakes a paused run.

Who may: platform operators (superusers) everywhere; a tenant's supervisors (staff holding the
tenant's view_runs) for their tenant's runs; nobody else.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

from django.db.models import Exists, OuterRef, QuerySet
from django.utils import timezone

from core.errors import Conflict, DomainError, Forbidden
from runs.controls import audit
from runs.models import OPEN, TERMINAL, BulkAction, Run, RunStatus, Step, StepKind
from runs.queueing import enqueue
from runs.transitions import atomic_with_events, lock_run, record_event, transition_run, update_row
from tenants.models import Tenant
from tenants.permissions import holds

RESUME_PER_SECOND = 20.0
BULK_MAX = 10_000  # one action moves at most this many runs; the count says how many it did


def may_pause(user, tenant_id) -> bool:
    """Platform operators everywhere; the tenant's supervisors for the tenant; nobody else."""
    if user is None or not user.is_active:
        return False
    if user.is_superuser:
        return True
    return bool(
        user.is_staff
        and tenant_id is not None
        and user.tenant_id == tenant_id
        and holds(user, "view_runs", Tenant, tenant_id)
    )


def require_may_pause(user, tenant_id) -> None:
    if not may_pause(user, tenant_id):
        raise Forbidden(
            "only platform operators and the tenant's supervisors may pause or resume runs",
            code="not_permitted",
        )


def pause_run(
    *, run_id, actor, reason: str, until: dt.datetime | None = None, bulk: int | None = None
) -> Run:
    """Pause the run now, or at its step boundary if a call is in flight. An already paused (or
    pause-requested) run is answered as it is; an ended or cancelling one is refused (409)."""
    _check_until(until)
    with atomic_with_events():
        run = lock_run(run_id)
        _pause(run, actor=actor, reason=reason, until=until, bulk=bulk)
    return run


def _check_until(until: dt.datetime | None) -> None:
    if until is not None and until <= timezone.now():
        raise DomainError("the pause would end before it began", fields={"until": ["must be in the future"]})


def _pause(run: Run, *, actor, reason: str, until, bulk: int | None) -> bool:
    """With `run` locked: True if this call paused it or asked for its pause."""
    if run.status == RunStatus.PAUSED or run.pause_requested:
        return False
    if run.is_terminal:
        raise Conflict(f"run is already {run.status}: there is nothing to pause", code="run_finished")
    if run.cancel_requested:
        raise Conflict("run is being cancelled: there is nothing to pause", code="run_cancelling")
    who: dict[str, Any] = dict(
        paused_by=actor, pause_reason=reason, paused_until=until, paused_by_switch=None
    )
    data: dict[str, Any] = {
        "reason": reason,
        "until": until.isoformat() if until else None,
        "bulk_action": bulk,
    }
    if run.lease_token is not None:
        # A worker holds the run (or held it and was lost): the call in flight is recorded first,
        # then its record or the next claim pauses the run (decisions.Pause). A lost worker's
        # run is re-sent by the sweeper as usual; its claim recovers the call, then pauses.
        update_row(Run, run.pk, pause_requested=True, **who)
        for name, value in who.items():
            setattr(run, name, value)
        run.pause_requested = True
        record_event(
            run.pk,
            "pause_requested",
            f"pause requested by {actor.username}: {reason} (taken once the call in flight is recorded)",
            actor=actor,
            **data,
        )
        audit.logged(actor, run, f"Pause requested (taken once the call in flight is recorded): {reason}")
        return True
    # No worker holds it: a message still queued finds it paused and is dropped by the claim.
    message = f"paused by {actor.username}: {reason}"
    transition_run(run, RunStatus.PAUSED, actor=actor, message=message, paused_at=timezone.now(), **who)
    record_event(run.pk, "paused", message, actor=actor, at_step_boundary=False, **data)
    audit.logged(actor, run, f"Paused: {reason}")
    return True


def resume_run(
    *, run_id, actor, reason: str = "", countdown: float | None = None, bulk: int | None = None
) -> Run:
    """Resume a paused run where it stopped (or withdraw a pause not yet taken); 409 otherwise."""
    with atomic_with_events():
        run = lock_run(run_id)
        if not _resume(run, actor=actor, reason=reason, countdown=countdown, bulk=bulk):
            raise Conflict(
                f"run is {run.status}, not paused: there is nothing to resume", code="run_not_paused"
            )
    return run


def _who(actor) -> str:
    return actor.username if actor is not None else "the platform"


def _resume(run: Run, *, actor, reason: str, countdown: float | None, bulk: int | None) -> bool:
    cleared: dict[str, Any] = dict(
        pause_requested=False,
        paused_by=None,
        paused_at=None,
        pause_reason="",
        paused_until=None,
        paused_by_switch=None,
    )
    data: dict[str, Any] = {"reason": reason, "bulk_action": bulk}
    if run.status != RunStatus.PAUSED:
        if not run.pause_requested:
            return False
        update_row(Run, run.pk, **cleared)
        for name, value in cleared.items():
            setattr(run, name, value)
        record_event(
            run.pk,
            "resumed",
            f"pause withdrawn by {_who(actor)} before it was taken" + (f": {reason}" if reason else ""),
            actor=actor,
            withdrawn=True,
            **data,
        )
        audit.logged(actor, run, "Pause withdrawn before it was taken" + (f": {reason}" if reason else ""))
        return True
    now = timezone.now()
    paused_for = now - run.paused_at if run.paused_at else dt.timedelta(0)
    fields: dict[str, Any] = dict(cleared)
    if run.deadline_at is not None and not run.tenant.paused_time_counts:
        # The tenant's choice (module docstring): by default a pause does not count.
        fields["deadline_at"] = run.deadline_at + paused_for
    if run.admitted_at is None:
        to = RunStatus.WAITING_BUDGET  # never admitted: admitted in order of arrival by the sweeper
    elif run.started_at is None:
        to = RunStatus.QUEUED
    else:
        to = RunStatus.RUNNING  # the claim decides again from the step log: it goes on where it stopped
    message = f"resumed by {_who(actor)}" + (f": {reason}" if reason else "")
    transition_run(run, to, actor=actor, message=message, **fields)
    record_event(
        run.pk, "resumed", message, actor=actor, paused_seconds=round(paused_for.total_seconds(), 3), **data
    )
    audit.logged(actor, run, "Resumed" + (f": {reason}" if reason else ""))
    if to != RunStatus.WAITING_BUDGET:
        enqueue(run.pk, countdown=countdown)
    return True


def resume_due(now: dt.datetime) -> int:
    """The sweeper's pass: resume every pause whose `paused_until` has passed, the earliest end
    first, at RESUME_PER_SECOND. A run that is still paused when its turn comes was not resumed
    meanwhile by a person; one paused again since (a new end, or none) is left as it is."""
    count = 0
    for run_id in (
        Run.objects.filter(status=RunStatus.PAUSED, paused_until__lte=now)
        .order_by("paused_until", "created_at")
        .values_list("pk", flat=True)[:BULK_MAX]
    ):
        with atomic_with_events():
            run = lock_run(run_id)
            if run.status != RunStatus.PAUSED or run.paused_until is None or run.paused_until > now:
                continue
            count += _resume(
                run,
                actor=None,
                reason=f"the pause ended at {run.paused_until.isoformat()}",
                countdown=count / RESUME_PER_SECOND,
                bulk=None,
            )
    return count


# --- in bulk ------------------------------------------------------------------------------------

FILTERS = ("tenant", "agent", "version", "tool", "endpoint", "created_by", "status", "created_before")


def matching(filters: dict, *, kind: str) -> QuerySet:
    """The runs a bulk action of `kind` moves: live and not paused (pause), paused or
    pause-requested (resume), live and not already being cancelled (cancel); narrowed by the
    filters (names as the API takes them), in order of arrival (resume: oldest pause first).

    `tool`: runs whose next or pending call is to it (an open tool step of that name).
    """
    resuming = kind == BulkAction.Kind.RESUME
    runs = Run.objects.exclude(status__in=TERMINAL)
    if resuming:
        runs = runs.filter(status=RunStatus.PAUSED) | runs.filter(pause_requested=True)
    elif kind == BulkAction.Kind.CANCEL:
        runs = runs.filter(cancel_requested=False)
    else:
        runs = runs.exclude(status=RunStatus.PAUSED).filter(pause_requested=False, cancel_requested=False)
    if filters.get("tenant"):
        runs = runs.filter(tenant__slug=filters["tenant"])
    if filters.get("agent"):
        runs = runs.filter(agent__name=filters["agent"])
    if filters.get("version"):
        runs = runs.filter(version__number=filters["version"])
    if filters.get("endpoint"):
        runs = runs.filter(version__model_endpoint__name=filters["endpoint"])
    if filters.get("created_by"):
        runs = runs.filter(created_by__username=filters["created_by"])
    if filters.get("status"):
        runs = runs.filter(status=filters["status"])
    if filters.get("created_before"):
        runs = runs.filter(created_at__lt=filters["created_before"])
    if filters.get("tool"):
        runs = runs.filter(
            Exists(
                Step.objects.filter(
                    run=OuterRef("pk"), kind=StepKind.TOOL, status__in=OPEN, tool_name=filters["tool"]
                )
            )
        )
    return runs.order_by("paused_at" if resuming else "created_at", "created_at")


PREVIEW_SAMPLE = 10


def preview(*, actor, kind: str, filters: dict) -> tuple[dict, int, list]:
    """What a bulk action of `kind` would move now, before anyone commits to it: the filters as
    the actor may use them, how many runs match (at most BULK_MAX are moved) and the first few."""
    filters, _ = scope_filters(filters, actor)
    runs = matching(filters, kind=kind)
    return filters, runs.count(), list(runs.select_related("agent", "created_by")[:PREVIEW_SAMPLE])


def scope_filters(filters: dict, actor) -> tuple[dict, Tenant | None]:
    """The filters as the actor may use them: a supervisor's are held to their own tenant."""
    filters = {k: v for k, v in filters.items() if k in FILTERS and v not in (None, "")}
    if filters.get("version") and not filters.get("agent"):
        raise DomainError(
            "a version is a number within one agent: give agent too", fields={"version": ["needs agent"]}
        )
    if actor.is_superuser:
        tenant = Tenant.objects.filter(slug=filters["tenant"]).first() if filters.get("tenant") else None
        if filters.get("tenant") and tenant is None:
            raise DomainError("no such tenant", fields={"tenant": ["no tenant with this slug"]})
        return filters, tenant
    require_may_pause(actor, actor.tenant_id)
    tenant = Tenant.objects.get(pk=actor.tenant_id)
    if filters.get("tenant") and filters["tenant"] != tenant.slug:
        raise Forbidden("a supervisor may pause or resume only their own tenant's runs", code="not_permitted")
    filters["tenant"] = tenant.slug
    return filters, tenant


def pause_matching(*, actor, reason: str, filters: dict, until: dt.datetime | None = None) -> BulkAction:
    """Pause every run the filters match (each at its step boundary); answers the audit record."""
    return _bulk(BulkAction.Kind.PAUSE, actor=actor, reason=reason, filters=filters, until=until)


def resume_matching(*, actor, reason: str, filters: dict) -> BulkAction:
    """Resume every paused run the filters match, oldest pause first, RESUME_PER_SECOND at most."""
    return _bulk(BulkAction.Kind.RESUME, actor=actor, reason=reason, filters=filters)


def _bulk(kind: str, *, actor, reason: str, filters: dict, until=None) -> BulkAction:
    _check_until(until)
    if kind == BulkAction.Kind.RESUME:

        def move(run: Run, action: int, count: int) -> bool:
            return _resume(run, actor=actor, reason=reason, countdown=count / RESUME_PER_SECOND, bulk=action)

    else:

        def move(run: Run, action: int, count: int) -> bool:
            return _pause(run, actor=actor, reason=reason, until=until, bulk=action)

    return run_bulk(kind, actor=actor, reason=reason, filters=filters, move=move)


def run_bulk(
    kind: str, *, actor, reason: str, filters: dict, move: Callable[[Run, int, int], bool]
) -> BulkAction:
    """Audit one BulkAction and apply `move(run, action id, moved so far)` to each matching run,
    with the run locked; answers the action with the count of runs moved (also runs.controls.cancelling)."""
    if not reason.strip():
        raise DomainError("say why", fields={"reason": ["a reason is required"]})
    filters, tenant = scope_filters(filters, actor)
    stored = {k: (v.isoformat() if isinstance(v, dt.datetime) else v) for k, v in filters.items()}
    action = BulkAction.objects.create(kind=kind, tenant=tenant, actor=actor, reason=reason, filters=stored)
    count = 0
    # One short transaction per run, each with its row locked: a worker recording a call waits
    # for one run at a time, never for the whole action.
    for run_id in matching(filters, kind=kind).values_list("pk", flat=True)[:BULK_MAX]:
        try:
            with atomic_with_events():
                moved = move(lock_run(run_id), action.pk, count)
        except (Conflict, Run.DoesNotExist):
            continue  # it ended (or was cancelled) between the query and its lock
        count += moved
    action.count = count
    BulkAction.objects.filter(pk=action.pk).update(count=count)
    return action


class PausersOnly:
    """For the admin pages of pausing's own records (bulk actions, kill switches): only whoever may
    pause the tenant's runs sees or adds them. The admin asks every model's permissions on its
    login page too, for an anonymous user: no."""

    def _may(self, request) -> bool:
        user = request.user
        if not user.is_authenticated or not user.is_active:
            return False
        return may_pause(user, user.tenant_id)

    def has_module_permission(self, request):
        return self._may(request)

    def has_view_permission(self, request, obj=None):
        return self._may(request)

    def has_add_permission(self, request):
        return self._may(request)
