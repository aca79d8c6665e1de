"""Writes on runs: admission, guarded transitions with events, cancellation, enqueueing, and what an
approval's request, decision, withdrawal or expiry does to its run (approvals/services.py decides
and moves the approval; the run's step, status and events are written here)."""

from __future__ import annotations

import datetime as dt
import functools
import threading
import uuid
from contextlib import contextmanager

from celery import current_app
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from agentplatform import sql
from agentplatform.digests import digest
from agentplatform.errors import Conflict, DomainError, Forbidden, IllegalTransition
from agents.models import AgentVersion
from agents.selectors import resolve_version
from agents.spec import DEFAULT_LIMITS, LIMIT_CAPS
from approvals import services as approvals
from approvals.models import Approval
from budgets.services import create_run_account
from llm.models import ModelEndpoint
from observability import observe
from runs import admission, statements
from runs.models import (
    READY,
    RUN_TRANSITIONS,
    STEP_TRANSITIONS,
    TERMINAL,
    WAITING,
    Run,
    RunEvent,
    RunStatus,
    Step,
    StepKind,
    StepStatus,
    StopReason,
)
from tenants.models import Tenant, User
from tenants.permissions import may_run_agent


def effective_limits(spec_limits: dict, tenant) -> dict:
    """The version's limits, filled with defaults and capped by the tenant: never unbounded."""
    limits = {}
    for name, default in DEFAULT_LIMITS.items():
        cap = getattr(tenant, LIMIT_CAPS[name])
        limits[name] = min(int(spec_limits.get(name, min(default, cap))), cap)
    return limits


_batch = threading.local()


def record_event(
    run_id, kind: str, message: str = "", *, step_seq: int | None = None, actor=None, **data
) -> RunEvent:
    """Append an event; inside `atomic_with_events` it is inserted with the others at the end."""
    event = RunEvent(
        run_id=run_id,
        kind=kind,
        message=message,
        step_seq=step_seq,
        actor=actor,
        data=data,
        at=timezone.now(),
    )
    pending = getattr(_batch, "events", None)
    if pending is None:
        write_events([event])
    else:
        pending.append(event)
    return event


def write_events(events: list[RunEvent]) -> None:
    """Number the events per run, in order, and INSERT each run's in one statement.

    An event's `seq` is its number within its run (what the API shows as its id). The statement
    (runs.statements.write_run) moves the run's counter and inserts in one round trip; the
    counter's UPDATE holds the run row until commit, so writers of one run number in turn (the
    engine already holds that row anyway).
    """
    _flush(events, {})


def _flush(events: list[RunEvent], run_writes: dict) -> None:
    by_run: dict = {run_id: [] for run_id in run_writes}
    for event in events:
        by_run.setdefault(event.run_id, []).append(event)
    for run_id, of_run in by_run.items():
        sets, adds = run_writes.get(run_id, ({}, {}))
        statements.write_run(run_id, of_run, sets=sets, adds=adds)


def write_run_at_end(run: Run, *, adds: dict | None = None, **values) -> None:
    """Write columns of a run the caller holds locked: inside `atomic_with_events` in the one
    statement that writes its events at the end of the transaction, else now.

    For columns nothing in the transaction reads back from the database (the lease, the step
    counters, the enqueue time); `run` (the instance) is updated at once.
    """
    adds = adds or {}
    for name, value in values.items():
        setattr(run, name, value)
    for name, n in adds.items():
        setattr(run, name, getattr(run, name) + n)
    _write_run_at_end(run.pk, adds, values)


def _write_run_at_end(run_id, adds: dict, values: dict) -> None:
    pending = getattr(_batch, "run_writes", None)
    if pending is None:
        statements.write_run(run_id, [], sets=values, adds=adds)
        return
    sets, added = pending.setdefault(run_id, ({}, {}))
    sets.update(values)
    for name, n in adds.items():
        added[name] = added.get(name, 0) + n


@contextmanager
def atomic_with_events():
    """A transaction whose events are inserted in one statement, in order, just before it commits
    (with the run columns deferred to then: write_run_at_end).

    An event written inside is not visible to queries inside (nothing here reads events back).
    Nested inside another such block, it joins the outer one.
    """
    if getattr(_batch, "events", None) is not None:
        with transaction.atomic():
            yield
        return
    _batch.events = pending = []
    _batch.run_writes = run_writes = {}
    try:
        with transaction.atomic():
            yield
            _batch.events = _batch.run_writes = None
            _flush(pending, run_writes)  # one statement per run, in order
    finally:
        _batch.events = _batch.run_writes = None


def transition_run(
    run: Run, to: str, *, message: str = "", actor=None, event_data: dict | None = None, **fields
) -> None:
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
    if not _update(Run, run.pk, where={"status": old}, status=to, **fields):
        raise IllegalTransition("run", old, to)
    run.status = to
    for name, value in fields.items():
        setattr(run, name, value)
    record_event(
        run.pk,
        "status",
        message or f"{old} → {to}",
        actor=actor,
        **{"from": old, "to": to, **(event_data or {})},
    )
    observe.run_moved(run, old, to, reason=fields.get("stop_reason", ""), message=message)


def transition_step(step: Step, to: str, *, message: str = "", actor=None, **fields) -> None:
    old = step.status
    if to not in STEP_TRANSITIONS.get(old, set()):
        raise IllegalTransition("step", old, to)
    if not _update(Step, step.pk, where={"status": old}, status=to, **fields):
        raise IllegalTransition("step", old, to)
    step.status = to
    for name, value in fields.items():
        setattr(step, name, value)
    label = step.tool_name or step.kind
    record_event(
        step.run_id,
        "step",
        message or f"step {step.seq} {label}: {old} → {to}",
        step_seq=step.seq,
        actor=actor,
        **{"from": old, "to": to, "step_kind": step.kind, "tool": step.tool_name},
    )
    observe.step_moved(step, old, to, error=fields.get("error", ""), message=message)


def _update(model, pk, *, where: dict | None = None, **values) -> int:
    """One conditional UPDATE by primary key; in SQL written here unless a value is an expression."""
    if any(hasattr(v, "resolve_expression") for v in values.values()):
        return model.objects.filter(pk=pk, **(where or {})).update(**values)
    return sql.update(model, pk, where=where, **values)


def enqueue(run_id, *, countdown: float | None = None, **fields) -> None:
    """Schedule one advance of the run after the current transaction commits.

    `fields` are written in the same UPDATE as last_enqueued_at (the engine clears its lease here).
    """
    now = timezone.now()
    if getattr(_batch, "run_writes", None) is not None and not any(
        hasattr(v, "resolve_expression") for v in fields.values()
    ):
        _write_run_at_end(run_id, {}, {"last_enqueued_at": now, **fields})  # with the events
    else:
        _update(Run, run_id, last_enqueued_at=now, **fields)
    # The message carries its enqueue time: a message older than the run's latest enqueue is
    # superseded (the claim drops it), so duplicates never fork the run into two message chains.
    # robust: with the broker down the commit stands (a started run is not answered with a 500)
    # and the sweeper sends the message again later; the error is logged.
    transaction.on_commit(
        lambda: _advance_run((str(run_id), now.isoformat())).apply_async(countdown=countdown), robust=True
    )


def resend(run_id, *, enqueued_at) -> None:
    """Send the run's last message again, unchanged: if the first copy was only slow, whichever
    copy arrives first moves the run, and the other is then older than the run's next message."""
    transaction.on_commit(
        lambda: _advance_run((str(run_id), enqueued_at.isoformat())).apply_async(), robust=True
    )


def _advance_run(args: tuple):
    """The engine's task message, named rather than imported: runs/tasks.py imports the engine,
    which imports this module. The registered task object sends it (its options, and whatever
    wraps its apply_async), or the app by name where the worker's tasks were never imported."""
    return current_app.signature("runs.tasks.advance_run", args=args)


@functools.cache
def _lock_run_row_sql() -> str:
    return f"SELECT {sql.columns(Run, 'r')} FROM {sql.table(Run)} r WHERE r.id = %s {sql.for_update('r')}"


@functools.cache
def _lock_run_sql(for_step: bool) -> str:
    """LOCK_RUN (built once: the column lists come from the models' metadata)."""
    joins = (
        f"JOIN {sql.table(Tenant)} t ON t.id = r.tenant_id "
        f"JOIN {sql.table(AgentVersion)} v ON v.id = r.version_id "
    )
    select = f"{sql.columns(Run, 'r')}, {sql.columns(Tenant, 't')}, {sql.columns(AgentVersion, 'v')}"
    if for_step:
        joins += (
            f"JOIN {sql.table(User)} u ON u.id = r.created_by_id "
            f"JOIN {sql.table(ModelEndpoint)} e ON e.id = v.model_endpoint_id "
        )
        select += f", {sql.columns(User, 'u')}, {sql.columns(ModelEndpoint, 'e')}"
    return f"SELECT {select} FROM {sql.table(Run)} r {joins}WHERE r.id = %s {sql.for_update('r')}"


def lock_run(run_id, *, for_step: bool = False, like: Run | None = None) -> Run:
    """The run row locked FOR UPDATE, with its tenant and version (and for a step: the user who
    started it and the version's model endpoint), read fresh in one statement.

    `like`: the same run as this worker read it earlier in the step (the claim): only the run
    row is read (fresh, locked); its tenant, version and user are taken from `like`.
    """
    try:
        run_id = uuid.UUID(str(run_id))
    except ValueError:
        raise Run.DoesNotExist(f"no run {run_id}") from None
    if like is not None:
        found = sql.fetch(_lock_run_row_sql(), [run_id], Run)
        if not found:
            raise Run.DoesNotExist(f"no run {run_id}")
        (run,) = found[0]
        run.tenant, run.version, run.created_by = like.tenant, like.version, like.created_by
        return run
    models = [Run, Tenant, AgentVersion] + ([User, ModelEndpoint] if for_step else [])
    found = sql.fetch(_lock_run_sql(for_step), [run_id], *models)
    if not found:
        raise Run.DoesNotExist(f"no run {run_id}")
    run, tenant, version, *more = found[0]
    run.tenant, run.version = tenant, version
    if more:
        run.created_by, version.model_endpoint = more
    return run


def end_run(
    run: Run, status: str, *, reason: str = "", error: str = "", actor=None, message: str = "", **fields
) -> None:
    """Finish a run: skip steps that will never run and void approvals that can no longer be used.

    `fields`: more columns of the run to write in the same UPDATE (final_output, say)."""
    fields.update(stop_reason=reason, error=error)
    transition_run(
        run, status, actor=actor, message=message, event_data={"reason": reason, "error": error}, **fields
    )
    for step in Step.objects.filter(run=run, status__in=READY | {StepStatus.AWAITING_APPROVAL}):
        transition_step(step, StepStatus.SKIPPED, message=f"step {step.seq} skipped: run {status}")
    void_open_approvals(run, reason=f"run {status}" + (f" ({reason})" if reason else ""))


# --- Admission -------------------------------------------------------------------------------


def _check_quotas(*, tenant, user, now: dt.datetime) -> None:
    active = Run.objects.filter(tenant=tenant).exclude(status__in=TERMINAL).count()
    if active >= tenant.max_active_runs:
        raise DomainError(
            f"tenant has {active} active runs (quota {tenant.max_active_runs})",
            code="active_run_quota_exceeded",
            status=429,
            retry_after=30,
        )
    recent = Run.objects.filter(created_by=user, created_at__gte=now - dt.timedelta(minutes=1)).count()
    if recent >= tenant.max_starts_per_minute:
        raise DomainError(
            f"{recent} runs started in the last minute (limit {tenant.max_starts_per_minute})",
            code="start_rate_exceeded",
            status=429,
            retry_after=60,
        )


def start_run(
    *,
    user,
    agent: str,
    alias: str | None = None,
    version: int | None = None,
    input,
    metadata: dict | None = None,
    idempotency_key: str | None = None,
    wait: bool = True,
) -> tuple[Run, bool]:
    """Start a run as `user`. Returns (run, created); replays the same run for a repeated key.

    The run is admitted (queued) only if the tenant's day can carry its expected cost on top of
    what admitted runs are still expected to spend (runs/admission.py); otherwise it waits in
    `waiting_budget`, or with wait=False the call answers 429 with Retry-After.
    """
    tenant = user.tenant
    if tenant is None:
        raise DomainError("user belongs to no tenant", code="no_tenant", status=403)
    metadata = metadata or {}
    request_hash = digest(
        {"agent": agent, "alias": alias, "version": version, "input": input, "metadata": metadata}
    )
    if idempotency_key:
        existing = Run.objects.filter(tenant=tenant, created_by=user, idempotency_key=idempotency_key).first()
        if existing is not None:
            if existing.request_hash != request_hash:
                raise DomainError(
                    "this Idempotency-Key was used with a different request body",
                    code="idempotency_key_reused",
                    status=422,
                )
            return existing, False
    pinned = resolve_version(tenant=tenant, agent=agent, alias=alias, version=version)
    if not may_run_agent(user, pinned.agent_id):
        raise Forbidden(
            f"you may not start runs of {agent}: run_agent is not granted to you", code="not_permitted"
        )
    now = timezone.now()
    limits = effective_limits(pinned.spec.get("limits", {}), tenant)
    expected = admission.expected_cost(version=pinned, limits=limits, tenant=tenant)
    try:
        with atomic_with_events():
            # Admissions of one tenant queue on its row, so two starts cannot both pass a quota only
            # one of them fits. NO KEY: inserts that merely reference the tenant are not blocked.
            type(tenant).objects.select_for_update(no_key=True).filter(pk=tenant.pk).exists()
            _check_quotas(tenant=tenant, user=user, now=now)
            admitted, retry_after = admission.decide(tenant=tenant, expected=expected)
            if not admitted and not wait:
                raise DomainError(
                    f"the tenant's budget for today cannot carry another run now ({expected} micros "
                    "expected)",
                    code="tenant_budget_exhausted",
                    status=429,
                    retry_after=retry_after,
                )
            run = Run.objects.create(
                tenant=tenant,
                created_by=user,
                agent=pinned.agent,
                version=pinned,
                input=input,
                metadata=metadata,
                limits=limits,
                idempotency_key=idempotency_key or None,
                request_hash=request_hash,
                expected_cost_micros=expected,
                admitted_at=now if admitted else None,
                deadline_at=now + dt.timedelta(seconds=limits["max_wall_seconds"]) if admitted else None,
            )
            create_run_account(run=run, limit_micros=limits["max_cost_micros"])
            record_event(
                run.pk,
                "created",
                f"run created by {user.username} on {pinned}",
                actor=user,
                agent=pinned.agent.name,
                version=pinned.number,
                alias=alias or "",
                limits=limits,
                expected_cost_micros=expected,
            )
            if admitted:
                enqueue(run.pk)
            else:
                # A row, not a task: the sweeper admits it in order of arrival (admission.admit_waiting).
                transition_run(
                    run,
                    RunStatus.WAITING_BUDGET,
                    message=f"waiting for budget: {expected} micros "
                    "expected, more than today's budget can carry on top of the runs already admitted",
                    event_data={"expected_cost_micros": expected, "admission": True},
                )
    except IntegrityError:
        raise Conflict(
            "a request with this Idempotency-Key is in progress", code="idempotency_key_in_flight"
        ) from None
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
        if leased:
            return run
        # A tool call sent earlier whose answer never came (or waits out its settle window) may
        # still take effect: cancelling must not forget it. A person resolves it first; the run
        # then ends as cancelled at its next claim.
        inflight = Step.objects.filter(run=run, kind=StepKind.TOOL, status=StepStatus.DISPATCHING).first()
        if inflight is None:
            end_run(run, RunStatus.CANCELLED, actor=actor, message="cancelled")
        else:
            message = (
                f"step {inflight.seq} {inflight.tool_name}: outcome unknown and run cancelled; "
                "resolve it, then the run ends as cancelled"
            )
            transition_step(
                inflight,
                StepStatus.OUTCOME_UNKNOWN,
                message=message,
                error=message,
                next_attempt_at=None,
                finished_at=timezone.now(),
                actor=actor,
            )
            transition_run(run, RunStatus.NEEDS_ATTENTION, actor=actor, message="needs attention: " + message)
    return run


def bump_counters(run: Run, **counters: int) -> None:
    Run.objects.filter(pk=run.pk).update(**{name: F(name) + n for name, n in counters.items()})
    for name, n in counters.items():
        setattr(run, name, getattr(run, name) + n)


def lease_seconds_for(timeout: float) -> int:
    return int(timeout) + settings.LEASE_MARGIN_SECONDS


def continue_run(run: Run, *, countdown: float | None = None) -> None:
    enqueue(run.pk, countdown=countdown, lease_token=None, lease_expires_at=None)  # one UPDATE


# --- Approvals: what they do to the run ------------------------------------------------------


def request_approval(run: Run, step: Step, decision) -> None:
    """Park a proposed call for a person's decision: the approval, its event, the step and the run wait."""
    approval = approvals.request_approval(run=run, step=step, decision=decision)
    record_event(
        run.pk,
        "approval_requested",
        f"approval requested for {step.tool.name}: {decision.reason}",
        step_seq=step.seq,
        approval=str(approval.pk),
        expires_at=approval.expires_at.isoformat(),
    )


def decide_approval(*, approval_id, user, approve: bool, reason: str = "") -> Approval:
    """Approve or deny once; the step moves and a waiting run resumes. Repeating the same decision
    by the same person returns the approval again. Past its expiry the approval expires instead
    (that is committed) and the decision is refused."""
    with transaction.atomic():
        run = lock_run(approvals.run_of(approval_id, tenant_id=user.tenant_id))
        approval = approvals.locked(approval_id)
        verdict = approvals.decide(approval, user=user, approve=approve, reason=reason)
        approval.repeated = verdict == approvals.Verdict.REPEATED  # the API answers what happened first
        if verdict == approvals.Verdict.DECIDED:
            _approval_decided(run, approval, user=user, approve=approve, reason=reason)
        elif verdict == approvals.Verdict.EXPIRED:
            _approval_expired(run, approval)
    if verdict == approvals.Verdict.EXPIRED:
        raise Conflict("approval expired before it was decided", code="approval_expired")
    return approval


def correct_approval(*, approval_id, user, arguments: dict, reason: str) -> Approval:
    """An approver corrects the call and approves the corrected one (approvals.services.correct
    checks it again); the step is sent with the corrected arguments, both versions on the timeline."""
    with transaction.atomic():
        run = lock_run(approvals.run_of(approval_id, tenant_id=user.tenant_id))
        approval = approvals.locked(approval_id)
        changes = approvals.correct(approval, run=run, user=user, arguments=arguments, reason=reason)
        step = approval.step
        what = ", ".join(f"{name} {old!r} → {new!r}" for name, (old, new) in changes.items())
        _update(Step, step.pk, arguments=arguments, args_digest=digest(arguments))
        step.arguments = arguments
        record_event(
            run.pk,
            "approval_corrected",
            f"{approval.tool.name} corrected by {user.username}: {what} ({reason})",
            step_seq=step.seq,
            actor=user,
            approval=str(approval.pk),
            proposed=approval.original_arguments,
            corrected=arguments,
            reason=reason,
        )
        _approval_decided(run, approval, user=user, approve=True, reason=reason)
    return approval


def _approval_decided(run: Run, approval: Approval, *, user, approve: bool, reason: str) -> None:
    step = approval.step
    verb = "approved" if approve else "denied"
    record_event(
        run.pk,
        f"approval_{verb}",
        f"{approval.tool.name} {verb} by {user.username}" + (f": {reason}" if reason else ""),
        step_seq=step.seq,
        actor=user,
        approval=str(approval.pk),
    )
    if approve:
        transition_step(step, StepStatus.APPROVED, actor=user)
    else:
        transition_step(
            step,
            StepStatus.REJECTED,
            actor=user,
            finished_at=approval.decided_at,
            error=reason,
            observation=f"ERROR: a supervisor denied this call{': ' + reason if reason else ''}. "
            "Explain this to the user or choose another path.",
        )
    if run.status == RunStatus.WAITING_APPROVAL:
        transition_run(run, RunStatus.RUNNING, actor=user, message=f"resumed: approval {verb}")
        enqueue(run.pk)


def _approval_expired(run: Run, approval: Approval) -> None:
    step = approval.step
    record_event(
        run.pk,
        "approval_expired",
        f"approval for {approval.tool.name} expired undecided",
        step_seq=step.seq,
        approval=str(approval.pk),
    )
    transition_step(
        step,
        StepStatus.EXPIRED,
        finished_at=timezone.now(),
        observation="ERROR: the approval request expired without a decision; the call was not made.",
    )
    if run.status != RunStatus.WAITING_APPROVAL:
        return
    if run.version.spec.get("on_approval_expired") == "stop":
        end_run(
            run, RunStatus.STOPPED, reason=StopReason.APPROVAL_EXPIRED, message="stopped: approval expired"
        )
    else:
        transition_run(run, RunStatus.RUNNING, message="resumed: approval expired, the model is told")
        enqueue(run.pk)


def expire_approvals(*, now: dt.datetime | None = None, limit: int = 500) -> int:
    """Expire pending approvals whose time is up, each with its run locked; how many expired."""
    now = now or timezone.now()
    count = 0
    for approval_id, run_id in approvals.due_for_expiry(now=now, limit=limit):
        with transaction.atomic():
            run = lock_run(run_id)
            approval = approvals.locked(approval_id)
            if approvals.expire(approval):
                _approval_expired(run, approval)
                count += 1
    return count


def void_approval(step: Step, *, reason: str) -> None:
    """Withdraw the step's open approval, if any, with an event."""
    if approvals.void_for_step(step, reason=reason):
        record_event(
            step.run_id,
            "approval_voided",
            f"approval for step {step.seq} voided: {reason}",
            step_seq=step.seq,
            reason=reason,
        )


def void_open_approvals(run: Run, *, reason: str) -> None:
    for step_id, seq in approvals.open_approval_steps(run):
        void_approval(Step(pk=step_id, seq=seq, run_id=run.pk), reason=reason)
