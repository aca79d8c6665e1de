"""A tool step: reconcile, reserve, mark, call the tool, settle, record (runs/engine.py)."""
from __future__ import annotations

import datetime as dt
import random

from django.db import close_old_connections
from django.db.models import F
from django.utils import timezone

from budgets import services as budgets
from runs import heartbeat
from runs.claim import mark_unknown
from runs.dispatch import budget_event, mark_dispatching, reserve, through_database_outage
from runs.engine import Plan, ToolOutcome, continue_run, fenced
from runs.models import Run, RunStatus, Step, StepKind, StepStatus
from runs.services import (atomic_with_events, end_run, enqueue, lock_run, record_event, transition_run,
                           transition_step)
from tools.models import EffectClass
from tools.types import ToolFailed, ToolOutcomeUnknown


def do_tool(plan: Plan) -> None:
    # The step row the claim read (with its tool); mark_dispatching re-reads it under the run lock.
    step = plan.extra.get("step") or Step.objects.select_related("tool", "tool__server").get(pk=plan.step_id)
    if plan.reconcile_first:
        found = _reconcile(plan, step)
        if found is not None:
            _record_tool(plan, step, found)
            return
    if not reserve(plan, amount=step.tool.price_micros, purpose="tool"):
        return
    dispatched = mark_dispatching(plan, step=step)
    if dispatched is None:
        budgets.release(plan.reservation_id, note="call not made")
        return
    try:
        outcome = _call_tool(dispatched)
    finally:
        heartbeat.untrack(plan.run_id)
        close_old_connections()

    def close_and_record() -> None:
        if outcome.kind == "unknown":
            budgets.hold(plan.reservation_id, note=f"tool outcome unknown: {outcome.error}")
        elif outcome.kind == "failed":
            budgets.release(plan.reservation_id, note="tool call provably not made")
        else:
            budgets.settle(plan.reservation_id, actual_micros=step.tool.price_micros)
        _record_tool(plan, dispatched, outcome)

    through_database_outage(close_and_record, seconds=plan.lease_seconds)


def _call_tool(step: Step) -> ToolOutcome:
    from tools import gateway as tool_gateway

    try:
        result = tool_gateway.dispatch(step)
    except ToolFailed as exc:
        return ToolOutcome("failed", error=str(exc))
    except ToolOutcomeUnknown as exc:
        return ToolOutcome("unknown", error=str(exc), retry_after=exc.retry_after)
    return ToolOutcome("succeeded", result=result)


def _reconcile(plan: Plan, step: Step) -> ToolOutcome | None:
    """Ask a reconcilable provider whether key K happened; None means it provably did not."""
    from tools import gateway as tool_gateway

    try:
        result = tool_gateway.lookup_status(step)
    except (ToolFailed, ToolOutcomeUnknown) as exc:
        with atomic_with_events():
            run = lock_run(plan.run_id)
            if fenced(run, plan):
                # A failed lookup counts as an attempt: a status endpoint that stays down ends in
                # needs_attention after max_attempts instead of an endless loop of lookups.
                Step.objects.filter(pk=step.pk).update(attempts=F("attempts") + 1)
                record_event(run.pk, "recovery", f"status lookup for step {step.seq} failed: {exc}",
                             step_seq=step.seq)
        return ToolOutcome("unknown", error=f"status lookup failed: {exc}")
    with atomic_with_events():
        run = lock_run(plan.run_id)
        if fenced(run, plan):
            record_event(run.pk, "recovery", f"status lookup for step {step.seq}: "
                         f"{'found, not retrying' if result else 'not found, retrying'}", step_seq=step.seq,
                         found=result is not None)
    if result is None:
        return None
    return ToolOutcome("succeeded", result=result, reconciled=True)


def _record_tool(plan: Plan, step: Step, outcome: ToolOutcome) -> None:
    from runs import loops
    from tools import gateway as tool_gateway

    now = timezone.now()
    with atomic_with_events():
        run = lock_run(plan.run_id)
        if not fenced(run, plan):
            _late_tool_attempt(run, Step.objects.select_related("tool").get(pk=step.pk), outcome)
            return
        # While this worker holds the lease nobody else moves the run's steps: the step as marked
        # dispatching, and the step log the claim read, are still what is stored.
        steps = plan.extra.get("steps")
        if outcome.kind == "succeeded":
            stored, observation = tool_gateway.shape_result(run, step, outcome.result)
            transition_step(step, StepStatus.SUCCEEDED, result=stored, observation=observation,
                            cost_micros=step.tool.price_micros, finished_at=now, error="",
                            message=f"step {step.seq} {step.tool_name}: "
                                    f"{'error reported by tool' if outcome.result.is_error else 'succeeded'}"
                                    f"{' (found by status lookup)' if outcome.reconciled else ''}")
            budget_event(run, step, reserved=step.tool.price_micros, settled=step.tool.price_micros)
        elif outcome.kind == "failed":
            error = tool_gateway.redact_text(run, outcome.error)
            transition_step(step, StepStatus.FAILED, error=error, observation=f"ERROR: {error}", finished_at=now,
                            message=f"step {step.seq} {step.tool_name} failed: {error}")
        else:
            _record_unknown(run, step, outcome)
            return
        if steps is None or not any(s is step for s in steps):
            steps = list(run.steps.all())
        if run.cancel_requested:
            end_run(run, RunStatus.CANCELLED, message="cancelled")
        elif not loops.check(run, steps, step):   # failed calls count as repeats too
            continue_run(run)


def _record_unknown(run: Run, step: Step, outcome: ToolOutcome) -> None:
    from tools import gateway as tool_gateway

    tool = step.tool
    error = tool_gateway.redact_text(run, outcome.error)
    if tool.effect_class == EffectClass.UNSAFE or step.attempts >= tool.max_attempts:
        if tool.effect_class == EffectClass.READ_ONLY:
            transition_step(step, StepStatus.FAILED, error=error, finished_at=timezone.now(),
                            observation=f"ERROR: {step.tool_name} did not answer: {error}")
            continue_run(run)
            return
        mark_unknown(run, step, f"step {step.seq} {step.tool_name}: outcome unknown ({error})")
        return
    delay = outcome.retry_after if outcome.retry_after is not None else \
        tool.backoff_seconds * 2 ** (step.attempts - 1) * random.uniform(0.5, 1.0)
    retry_at = timezone.now() + dt.timedelta(seconds=delay)
    Step.objects.filter(pk=step.pk).update(next_attempt_at=retry_at, error=error)
    record_event(run.pk, "retry_scheduled", f"step {step.seq} {step.tool_name}: outcome unknown ({error}); "
                 f"retry in {delay:.1f}s", step_seq=step.seq, effect_class=tool.effect_class)
    if run.cancel_requested:
        mark_unknown(run, step, f"step {step.seq} {step.tool_name}: outcome unknown and run cancelled")
        return
    continue_run(run, countdown=delay)


def _late_tool_attempt(run: Run, step: Step, outcome: ToolOutcome) -> None:
    """A fenced-out worker may only leave a record — unless it proves an unknown step succeeded."""
    record_event(run.pk, "late_attempt", f"step {step.seq} {step.tool_name}: result from a worker that lost "
                 f"its lease ({outcome.kind})", step_seq=step.seq, outcome=outcome.kind)
    if outcome.kind == "succeeded" and step.status == StepStatus.OUTCOME_UNKNOWN:
        from tools import gateway as tool_gateway

        stored, observation = tool_gateway.shape_result(run, step, outcome.result)
        transition_step(step, StepStatus.RESOLVED_SUCCEEDED, result=stored, observation=observation,
                        finished_at=timezone.now(),
                        message=f"step {step.seq} resolved automatically: the late result proves it succeeded")
        if run.status == RunStatus.NEEDS_ATTENTION and not run.steps.filter(
                status=StepStatus.OUTCOME_UNKNOWN, kind=StepKind.TOOL).exists():
            transition_run(run, RunStatus.RUNNING, message="resumed: unknown outcome resolved by a late result")
            enqueue(run.pk)
