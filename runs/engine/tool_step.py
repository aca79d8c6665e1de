"""A tool step: call the tool, then settle and record in one transaction (runs/engine/__init__.py).

The claim has reserved the call's budget and committed the step as `dispatching`; a recovery
that asks the provider first (reconcile) reserves and marks after the lookup.
"""

from __future__ import annotations

import datetime as dt
import random

from django.db import close_old_connections, transaction
from django.db.models import F
from django.utils import timezone

from budgets import services as budgets
from observability import observe
from runs.engine import heartbeat, loops
from runs.engine.claim import mark_unknown, settle_due, wait_to_settle
from runs.engine.dispatch import (
    budget_event,
    close_tool_holds,
    mark_after_lookup,
    recorded_before,
    through_database_outage,
)
from runs.engine.types import Plan, ToolOutcome, fenced
from runs.lifecycle import (
    atomic_with_events,
    continue_run,
    end_run,
    enqueue,
    lock_run,
    record_event,
    transition_run,
    transition_step,
)
from runs.models import Run, RunStatus, Step, StepKind, StepStatus
from tenants import secrets
from tools import results, transports
from tools.models import IN_PROGRESS_PATIENCE, MIN_IN_PROGRESS_PATIENCE, EffectClass
from tools.types import ToolFailed, ToolInProgress, ToolOutcomeUnknown

# Classes whose unanswered attempt is looked up or sent again, so they wait out the settle window.
SETTLING = (EffectClass.IDEMPOTENT, EffectClass.RECONCILABLE)


def do_tool(plan: Plan) -> None:
    step = plan.tool.step
    if plan.reconcile_first:
        found = _reconcile(plan, step)
        if found is not None:
            through_database_outage(
                lambda retry: _record_tool(plan, step, found, retry=retry), seconds=plan.lease_seconds
            )
            return
        if not mark_after_lookup(plan):
            return
    dispatched = plan.step
    try:
        with observe.tool_call(dispatched) as call:
            outcome = _call_tool(dispatched, send_by=plan.send_by)
            call.ended(outcome.kind, price_micros=dispatched.tool.price_micros, error=outcome.error)
    finally:
        heartbeat.untrack(plan.run_id)
        close_old_connections()
    through_database_outage(
        lambda retry: _record_tool(plan, dispatched, outcome, retry=retry), seconds=plan.lease_seconds
    )


def _close_reservation(plan: Plan, step: Step, outcome: ToolOutcome):
    """Settle, hold or release this attempt's reservation (in the record's transaction, after the
    run lock). A no-op on a reservation already closed, so a retried record repeats it safely.
    Returns the run account's balances after a settle (for the budget event), else None."""
    if plan.reservation_id is None:  # the outcome came from a status lookup: nothing was reserved
        return None
    if outcome.kind == "unknown":
        budgets.hold(plan.reservation_id, note=f"tool outcome unknown: {outcome.error}")
    elif outcome.kind in ("failed", "in_progress"):
        budgets.release(plan.reservation_id, note="this attempt provably took no effect")
    else:
        return budgets.settle_reporting(plan.reservation_id, actual_micros=step.tool.price_micros)[1]
    return None


def _call_tool(step: Step, *, send_by: float) -> ToolOutcome:
    try:
        result = transports.dispatch(step, send_by=send_by)
    except ToolFailed as exc:
        return ToolOutcome("failed", error=str(exc))
    except ToolInProgress as exc:
        return ToolOutcome("in_progress", error=str(exc), retry_after=exc.retry_after, sent=True)
    except ToolOutcomeUnknown as exc:
        return ToolOutcome("unknown", error=str(exc), retry_after=exc.retry_after)
    return ToolOutcome("succeeded", result=result)


def _reconcile(plan: Plan, step: Step) -> ToolOutcome | None:
    """Ask a reconcilable provider whether key K happened; None means it provably did not.

    The claim asks only once the step's settle window has passed, so "not found" is evidence.
    """
    try:
        result = transports.lookup_status(step)
    except ToolInProgress as exc:
        _lookup_event(plan, step, ": in progress, waiting, not retrying", found=None)
        return ToolOutcome("in_progress", error=str(exc), retry_after=exc.retry_after)
    except (ToolFailed, ToolOutcomeUnknown) as exc:
        # A failed lookup counts as an attempt: a status endpoint that stays down ends in
        # needs_attention after max_attempts instead of an endless loop of lookups.
        _lookup_event(plan, step, f" failed: {exc}", found=None, count_attempt=True)
        return ToolOutcome("unknown", error=f"status lookup failed: {exc}")
    _lookup_event(
        plan, step, ": found, not retrying" if result else ": not found, retrying", found=result is not None
    )
    if result is None:
        return None
    return ToolOutcome("succeeded", result=result, reconciled=True)


def _lookup_event(
    plan: Plan, step: Step, what: str, *, found: bool | None, count_attempt: bool = False
) -> None:
    with atomic_with_events():
        run = lock_run(plan.run_id)
        if fenced(run, plan):
            if count_attempt:
                Step.objects.filter(pk=step.pk).update(attempts=F("attempts") + 1)
            record_event(
                run.pk, "recovery", f"status lookup for step {step.seq}{what}", step_seq=step.seq, found=found
            )


def _record_tool(plan: Plan, step: Step, outcome: ToolOutcome, *, retry: bool = False) -> None:
    """Write the outcome under the run lock if this worker still holds the lease.

    On a retry (the first attempt's transaction failed) the step and the step log are read again:
    the in-memory ones may carry the rolled-back writes.
    """
    now = timezone.now()
    if plan.record_began is None:
        plan.record_began = now
    steps = plan.tool.steps
    if retry:
        step = Step.objects.select_related("tool", "tool__server").get(pk=step.pk)
        steps = None
    with atomic_with_events():
        run = lock_run(plan.run_id, like=plan.run)
        balances = _close_reservation(plan, step, outcome)
        if not fenced(run, plan):
            if retry and recorded_before(run, step, plan.record_began):
                return
            _late_tool_attempt(run, Step.objects.select_related("tool").get(pk=step.pk), outcome)
            return
        # While this worker holds the lease nobody else moves the run's steps: the step as marked
        # dispatching, and the step log the claim read, are still what is stored.
        if outcome.kind == "succeeded":
            stored, observation = results.shape_result(run, step, outcome.result)
            transition_step(
                step,
                StepStatus.SUCCEEDED,
                result=stored,
                observation=observation,
                cost_micros=step.tool.price_micros,
                finished_at=now,
                error="",
                message=f"step {step.seq} {step.tool_name}: "
                f"{'error reported by tool' if outcome.result.is_error else 'succeeded'}"
                f"{' (found by status lookup)' if outcome.reconciled else ''}",
            )
            price = step.tool.price_micros
            budget_event(run, step, reserved=price, settled=price, balances=balances)
            if outcome.reconciled:
                # The lookup found the lost attempt's effect: its held reservation is that call's charge.
                _close_holds_on_commit(step, happened=True)
        elif outcome.kind == "failed":
            error = secrets.redact_text(run.tenant_id, outcome.error)
            transition_step(
                step,
                StepStatus.FAILED,
                error=error,
                observation=f"ERROR: {error}",
                finished_at=now,
                message=f"step {step.seq} {step.tool_name} failed: {error}",
            )
        elif outcome.kind == "in_progress":
            _wait_in_progress(run, step, outcome)
            return
        else:
            _record_unknown(run, step, outcome)
            return
        if steps is None or not any(s is step for s in steps):
            steps = list(run.steps.all())
        if run.cancel_requested:
            end_run(run, RunStatus.CANCELLED, message="cancelled")
        elif not loops.check(run, steps, step):  # failed calls count as repeats too
            continue_run(run)


def _close_holds_on_commit(step: Step, *, happened: bool) -> None:
    price = step.tool.price_micros
    transaction.on_commit(
        lambda: close_tool_holds(step.pk, happened=happened, price_micros=price), robust=True
    )


def _record_unknown(run: Run, step: Step, outcome: ToolOutcome) -> None:
    tool = step.tool
    error = secrets.redact_text(run.tenant_id, outcome.error)
    if tool.effect_class == EffectClass.UNSAFE or step.attempts >= tool.max_attempts:
        if tool.effect_class == EffectClass.READ_ONLY:
            transition_step(
                step,
                StepStatus.FAILED,
                error=error,
                finished_at=timezone.now(),
                observation=f"ERROR: {step.tool_name} did not answer: {error}",
            )
            continue_run(run)
            return
        mark_unknown(run, step, f"step {step.seq} {step.tool_name}: outcome unknown ({error})")
        return
    if run.cancel_requested:
        mark_unknown(run, step, f"step {step.seq} {step.tool_name}: outcome unknown and run cancelled")
        return
    delay = (
        outcome.retry_after
        if outcome.retry_after is not None
        else tool.backoff_seconds * 2 ** (step.attempts - 1) * random.uniform(0.5, 1.0)
    )
    retry_at = timezone.now() + dt.timedelta(seconds=delay)
    Step.objects.filter(pk=step.pk).update(error=error)
    # The call ended now (this worker saw it end): the window runs from here.
    due = settle_due(step, ended=timezone.now())
    if tool.effect_class in SETTLING and due > retry_at:
        wait_to_settle(
            run,
            step,
            due,
            f"outcome unknown ({error}); settle window: the provider may make the "
            f"call visible up to {tool.settle_window}s after it ended, and a status lookup or a retry "
            "before then proves nothing",
        )
        return
    Step.objects.filter(pk=step.pk).update(next_attempt_at=retry_at)
    record_event(
        run.pk,
        "retry_scheduled",
        f"step {step.seq} {step.tool_name}: outcome unknown ({error}); retry in {delay:.1f}s",
        step_seq=step.seq,
        effect_class=tool.effect_class,
    )
    continue_run(run, countdown=delay)


def _wait_in_progress(run: Run, step: Step, outcome: ToolOutcome) -> None:
    """The provider has the request and is still on it: ask again later, never send it again now.

    Waiting is bounded: IN_PROGRESS_PATIENCE settle windows (at least MIN_IN_PROGRESS_PATIENCE
    seconds) after the window of the attempt, a person decides (the provider may be stuck, and only
    someone who can see it can tell).
    """
    tool = step.tool
    now = timezone.now()
    patience = max(tool.settle_window * IN_PROGRESS_PATIENCE, MIN_IN_PROGRESS_PATIENCE)
    give_up = settle_due(step) + dt.timedelta(seconds=patience)
    if now >= give_up or run.cancel_requested:
        why = (
            "run cancelled"
            if run.cancel_requested
            else f"still in progress {patience}s after its settle window"
        )
        mark_unknown(run, step, f"step {step.seq} {step.tool_name}: {why} ({outcome.error})")
        return
    if outcome.sent:
        # A repeat answered 409 did nothing: it does not use up one of max_attempts (waiting
        # has its own bound, above).
        Step.objects.filter(pk=step.pk).update(attempts=F("attempts") - 1)
    wait = (
        outcome.retry_after
        if outcome.retry_after is not None
        else min(max(tool.settle_window / 4, 1.0), 30.0)
    )
    wait_to_settle(
        run,
        step,
        now + dt.timedelta(seconds=wait),
        f"the provider says the call is still in progress ({outcome.error}); it is asked again, not re-sent",
    )


def _late_tool_attempt(run: Run, step: Step, outcome: ToolOutcome) -> None:
    """A fenced-out worker may only leave a record — unless it proves an unknown step succeeded."""
    record_event(
        run.pk,
        "late_attempt",
        f"step {step.seq} {step.tool_name}: result from a worker that lost its lease ({outcome.kind})",
        step_seq=step.seq,
        outcome=outcome.kind,
    )
    if outcome.kind == "succeeded" and step.status == StepStatus.OUTCOME_UNKNOWN:
        stored, observation = results.shape_result(run, step, outcome.result)
        transition_step(
            step,
            StepStatus.RESOLVED_SUCCEEDED,
            result=stored,
            observation=observation,
            resolved_at=timezone.now(),
            error="",
            resolution="happened: a late result from the lost attempt proves it",
            message=f"step {step.seq} resolved automatically: the late result proves it succeeded",
        )
        _close_holds_on_commit(step, happened=True)
        if (
            run.status == RunStatus.NEEDS_ATTENTION
            and not run.steps.filter(status=StepStatus.OUTCOME_UNKNOWN, kind=StepKind.TOOL).exists()
        ):
            transition_run(
                run, RunStatus.RUNNING, message="resumed: unknown outcome resolved by a late result"
            )
            enqueue(run.pk)
