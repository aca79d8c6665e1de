"""Writes on runs: admission, guarded transitions with events, cancellation, enqueueing."""
from __future__ import annotations

import datetime as dt
import hashlib
import json

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from agentplatform.errors import Conflict, DomainError
from runs.models import (READY, RUN_TRANSITIONS, STEP_TRANSITIONS, TERMINAL, WAITING, Run, RunEvent,
                         RunStatus, Step, StepStatus)

DEFAULT_LIMITS = {
    "max_steps": 50,
    "max_tool_calls": 25,
    "max_wall_seconds": 24 * 3600,
    "max_output_tokens": 1024,
    "max_cost_micros": 2_000_000,
}
LIMIT_CAPS = {
    "max_steps": "max_steps_cap",
    "max_tool_calls": "max_tool_calls_cap",
    "max_wall_seconds": "max_wall_seconds_cap",
    "max_output_tokens": "max_output_tokens_cap",
    "max_cost_micros": "max_cost_micros_cap",
}


class IllegalTransition(Conflict):
    def __init__(self, what: str, old: str, new: str):
        super().__init__(f"{what} cannot go from {old} to {new}", code="illegal_transition")


def canonical_json(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def digest(value) -> str:
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()


def effective_limits(spec_limits: dict, tenant) -> dict:
    """The version's limits, filled with defaults and capped by the tenant: never unbounded."""
    limits = {}
    for name, default in DEFAULT_LIMITS.items():
        cap = getattr(tenant, LIMIT_CAPS[name])
        limits[name] = min(int(spec_limits.get(name, min(default, cap))), cap)
    return limits


def record_event(run_id, kind: str, message: str = "", *, step_seq: int | None = None,
                 actor=None, **data) -> RunEvent:
    return RunEvent.objects.create(run_id=run_id, kind=kind, message=message, step_seq=step_seq,
                                   actor=actor, data=data)


def transition_run(run: Run, to: str, *, message: str = "", actor=None, event_data: dict | None = None,
                   **fields) -> None:
    """Move a run from its current status to `to`, or raise. One conditional UPDATE plus an event."""
    old = run.status
    if to not in RUN_TRANSITIONS[old]:
        raise IllegalTransition("run", old, to)
    now = timezone.now()
    if to in TERMINAL:
        fields.setdefault("finished_at", now)
    if to in TERMINAL or to in WAITING:
        # Nobody works on a run that waits or has ended: the next claim must not find a lease.
        fields.update(lease_token=None, lease_expires_at=None)
    if not Run.objects.filter(pk=run.pk, status=old).update(status=to, **fields):
        raise IllegalTransition("run", old, to)
    run.status = to
    for name, value in fields.items():
        setattr(run, name, value)
    record_event(run.pk, "status", message or f"{old} → {to}", actor=actor,
                 **{"from": old, "to": to, **(event_data or {})})


def transition_step(step: Step, to: str, *, message: str = "", actor=None, **fields) -> None:
    old = step.status
    if to not in STEP_TRANSITIONS.get(old, set()):
        raise IllegalTransition("step", old, to)
    if not Step.objects.filter(pk=step.pk, status=old).update(status=to, **fields):
        raise IllegalTransition("step", old, to)
    step.status = to
    for name, value in fields.items():
        setattr(step, name, value)
    label = step.tool_name or step.kind
    record_event(step.run_id, "step", message or f"step {step.seq} {label}: {old} → {to}",
                 step_seq=step.seq, actor=actor, **{"from": old, "to": to, "step_kind": step.kind,
                                                    "tool": step.tool_name})


def enqueue(run_id, *, countdown: float | None = None, **fields) -> None:
    """Schedule one advance of the run after the current transaction commits.

    `fields` are written in the same UPDATE as last_enqueued_at (the engine clears its lease here).
    """
    from runs.tasks import advance_run

    now = timezone.now()
    Run.objects.filter(pk=run_id).update(last_enqueued_at=now, **fields)
    # The message carries its enqueue time: a message older than the run's latest enqueue is
    # superseded (the claim drops it), so duplicates never fork the run into two message chains.
    # robust: with the broker down the commit stands (a started run is not answered with a 500)
    # and the sweeper sends the message again later; the error is logged.
    transaction.on_commit(lambda: advance_run.apply_async((str(run_id), now.isoformat()), countdown=countdown),
                          robust=True)


def resend(run_id, *, enqueued_at) -> None:
    """Send the run's last message again, unchanged: if the first copy was only slow, whichever
    copy arrives first moves the run, and the other is then older than the run's next message."""
    from runs.tasks import advance_run

    transaction.on_commit(lambda: advance_run.apply_async((str(run_id), enqueued_at.isoformat())), robust=True)


def lock_run(run_id) -> Run:
    return Run.objects.select_for_update(of=("self",)).select_related("tenant", "version").get(pk=run_id)


def end_run(run: Run, status: str, *, reason: str = "", error: str = "", actor=None,
            message: str = "") -> None:
    """Finish a run: skip steps that will never run and void approvals that can no longer be used."""
    from approvals.services import void_open_approvals

    fields = {"stop_reason": reason, "error": error}
    transition_run(run, status, actor=actor, message=message, event_data={"reason": reason, "error": error},
                   **fields)
    for step in Step.objects.filter(run=run, status__in=READY | {StepStatus.AWAITING_APPROVAL}):
        transition_step(step, StepStatus.SKIPPED, message=f"step {step.seq} skipped: run {status}")
    void_open_approvals(run, reason=f"run {status}" + (f" ({reason})" if reason else ""))


# --- Admission -------------------------------------------------------------------------------

def _check_quotas(*, tenant, user, now: dt.datetime) -> None:
    from budgets.services import local_day, next_local_midnight, tenant_day_account

    active = Run.objects.filter(tenant=tenant).exclude(status__in=TERMINAL).count()
    if active >= tenant.max_active_runs:
        raise DomainError(f"tenant has {active} active runs (quota {tenant.max_active_runs})",
                          code="active_run_quota_exceeded", status=429, retry_after=30)
    recent = Run.objects.filter(created_by=user, created_at__gte=now - dt.timedelta(minutes=1)).count()
    if recent >= tenant.max_starts_per_minute:
        raise DomainError(f"{recent} runs started in the last minute (limit {tenant.max_starts_per_minute})",
                          code="start_rate_exceeded", status=429, retry_after=60)
    account = tenant_day_account(tenant, local_day(tenant, now))
    if account.remaining_micros <= 0:
        wait = int((next_local_midnight(tenant, now) - now).total_seconds()) + 1
        raise DomainError("the tenant's budget for today is spent", code="tenant_budget_exhausted",
                          status=429, retry_after=wait)


def start_run(*, user, agent: str, alias: str | None = None, version: int | None = None,
              input, metadata: dict | None = None, idempotency_key: str | None = None) -> tuple[Run, bool]:
    """Admit a run as `user`. Returns (run, created); replays the same run for a repeated key."""
    from agents.selectors import resolve_version
    from budgets.services import create_run_account

    tenant = user.tenant
    if tenant is None:
        raise DomainError("user belongs to no tenant", code="no_tenant", status=403)
    metadata = metadata or {}
    request_hash = digest({"agent": agent, "alias": alias, "version": version, "input": input,
                           "metadata": metadata})
    if idempotency_key:
        existing = Run.objects.filter(tenant=tenant, created_by=user, idempotency_key=idempotency_key).first()
        if existing is not None:
            if existing.request_hash != request_hash:
                raise DomainError("this Idempotency-Key was used with a different request body",
                                  code="idempotency_key_reused", status=422)
            return existing, False
    pinned = resolve_version(tenant=tenant, agent=agent, alias=alias, version=version)
    now = timezone.now()
    limits = effective_limits(pinned.spec.get("limits", {}), tenant)
    try:
        with transaction.atomic():
            # Admissions of one tenant queue on its row, so two starts cannot both pass a quota only
            # one of them fits. NO KEY: inserts that merely reference the tenant are not blocked.
            type(tenant).objects.select_for_update(no_key=True).filter(pk=tenant.pk).exists()
            _check_quotas(tenant=tenant, user=user, now=now)
            run = Run.objects.create(
                tenant=tenant, created_by=user, agent=pinned.agent, version=pinned, input=input,
                metadata=metadata, limits=limits, idempotency_key=idempotency_key or None,
                request_hash=request_hash, deadline_at=now + dt.timedelta(seconds=limits["max_wall_seconds"]))
            create_run_account(run=run, limit_micros=limits["max_cost_micros"])
            record_event(run.pk, "created", f"run created by {user.username} on {pinned}",
                         actor=user, agent=pinned.agent.name, version=pinned.number,
                         alias=alias or "", limits=limits)
            enqueue(run.pk)
    except IntegrityError:
        raise Conflict("a request with this Idempotency-Key is in progress",
                       code="idempotency_key_in_flight") from None
    return run, True


def cancel_run(*, run_id, actor, reason: str = "") -> Run:
    """Cancel now if no worker holds the run; otherwise the holder cancels when it records.

    Either way no model or tool call starts after this commits: dispatch re-checks the flag
    under the same row lock.
    """
    with transaction.atomic():
        run = lock_run(run_id)
        if run.status == RunStatus.CANCELLED:
            return run
        if run.is_terminal:
            raise Conflict(f"run is already {run.status}", code="run_finished")
        Run.objects.filter(pk=run.pk).update(cancel_requested=True)
        run.cancel_requested = True
        record_event(run.pk, "cancel_requested", reason or "cancel requested", actor=actor)
        leased = run.lease_token is not None and run.lease_expires_at > timezone.now()
        if not leased:
            end_run(run, RunStatus.CANCELLED, actor=actor, message="cancelled")
    return run


def bump_counters(run: Run, **counters: int) -> None:
    Run.objects.filter(pk=run.pk).update(**{name: F(name) + n for name, n in counters.items()})
    for name, n in counters.items():
        setattr(run, name, getattr(run, name) + n)


def lease_seconds_for(timeout: float) -> int:
    return int(timeout) + settings.LEASE_MARGIN_SECONDS
