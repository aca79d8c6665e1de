"""Claim: take the run's lease, decide its next step from the step log and commit the intent
(runs/engine/__init__.py).

Everything here runs in the claim's one short transaction with the run row locked once, and
needs no network: denials, approval requests, replays and stops are applied here; a model or
tool call is reserved and committed as `dispatching` (runs.engine.dispatch.reserve_and_mark) and
handed on as a `Plan`.
"""

from __future__ import annotations

import datetime as dt
import uuid

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from approvals import services as approvals
from budgets import services as budgets
from budgets.models import Reservation
from llm import gateway as model_gateway
from observability import observe
from runs import statements
from runs.engine import loops, platform_tools
from runs.engine.dispatch import deny, let_go, reserve_and_mark
from runs.engine.types import ModelPlan, Plan, ToolPlan
from runs.lifecycle import (
    atomic_with_events,
    continue_run,
    end_run,
    lease_seconds_for,
    lock_run,
    record_event,
    request_approval,
    transition_run,
    transition_step,
    void_approval,
    write_run_at_end,
)
from runs.models import READY, WAITING, Run, RunStatus, Step, StepKind, StepStatus, StopReason
from runs.policy_events import record_shadow
from tenants.permissions import may_run_agent
from tools import checks, offer
from tools.models import EffectClass

MAX_MODEL_FAILURES = 5


def claim(run_id, enqueued_at: dt.datetime | None = None) -> Plan | None:
    """The step's first transaction. A Plan for a call committed as `dispatching` (or a lookup or
    a lost model call to settle first); None when there is nothing to call now."""
    with atomic_with_events():
        try:
            # With the user who started it and the model endpoint: read fresh, in this one statement.
            run = lock_run(run_id, for_step=True)
        except Run.DoesNotExist:
            return None
        observe.bind(tenant=run.tenant.slug)
        if (
            enqueued_at is not None
            and run.last_enqueued_at is not None
            and enqueued_at < run.last_enqueued_at
        ):
            return None  # superseded: a newer message for this run is on its way
        now = timezone.now()
        if run.is_terminal or run.status in WAITING:
            return None
        if run.lease_token is not None and run.lease_expires_at and run.lease_expires_at > now:
            return None
        if run.lease_token is not None:
            record_event(
                run.pk,
                "lease_expired",
                "previous worker's lease expired; taking over",
                expired_at=run.lease_expires_at.isoformat(),
            )
            Run.objects.filter(pk=run.pk).update(lease_token=None, lease_expires_at=None)
            run.lease_token = None
            # What the lost worker reserved but never dispatched goes back now, not after
            # budgets.release_orphans' quarantine (that one is for runs nobody claims again).
            transaction.on_commit(lambda: _release_undispatched(run.pk), robust=True)
        if run.cancel_requested:
            end_run(run, RunStatus.CANCELLED, message="cancelled")
            return None
        if run.deadline_at and now >= run.deadline_at:
            end_run(run, RunStatus.STOPPED, reason=StopReason.DEADLINE, message="stopped: deadline passed")
            return None
        if run.status == RunStatus.QUEUED:
            transition_run(run, RunStatus.RUNNING, started_at=now)
        plan = _decide(run, statements.step_log(run), now)
        if plan is None:
            return None
        plan.run = run
        if plan.kind == "recover_model" or plan.reconcile_first:
            # Nothing is sent before the lost call is settled or the provider asked: lease only.
            write_run_at_end(
                run, lease_token=plan.token, lease_expires_at=now + dt.timedelta(seconds=plan.lease_seconds)
            )
            return plan
        if not reserve_and_mark(run, plan, take_lease=True):
            return None
    let_go(plan)
    return plan


def _new_plan(run: Run, kind: str, timeout: float, **fields) -> Plan:
    """A plan with a new lease token (taken when the claim commits its intent)."""
    return Plan(run.pk, uuid.uuid4(), kind, lease_seconds_for(timeout), **fields)


def _decide(run: Run, steps: list[Step], now: dt.datetime) -> Plan | None:
    inflight = next((s for s in steps if s.status == StepStatus.DISPATCHING), None)
    if inflight is not None:
        return _plan_recovery(run, inflight, steps, now)
    if any(s.kind == StepKind.TOOL and s.status == StepStatus.OUTCOME_UNKNOWN for s in steps):
        transition_run(
            run, RunStatus.NEEDS_ATTENTION, message="waiting for a person to resolve an unknown outcome"
        )
        return None
    if any(s.status == StepStatus.AWAITING_APPROVAL for s in steps):
        transition_run(run, RunStatus.WAITING_APPROVAL, message="waiting for approval")
        return None
    ready = next((s for s in steps if s.kind == StepKind.TOOL and s.status in READY), None)
    if ready is not None:
        return _plan_tool(run, ready, steps, now)
    last_model = next(
        (s for s in reversed(steps) if s.kind == StepKind.MODEL and s.status == StepStatus.SUCCEEDED), None
    )
    if last_model is not None and not last_model.result.get("tool_calls"):
        end_run(run, RunStatus.SUCCEEDED, message="succeeded")
        return None
    return _plan_model(run, steps)


def _plan_model(run: Run, steps: list[Step]) -> Plan | None:
    if not run.created_by.is_active:
        # The run acts with its creator's authority, and a model call spends money on their
        # behalf: a deactivated user's runs stop here, at the next model turn. Tool steps the
        # model already proposed were denied by the gateway's fresh check and are on record.
        end_run(
            run,
            RunStatus.STOPPED,
            reason=StopReason.USER_DEACTIVATED,
            message="stopped: the user who started this run was deactivated",
        )
        return None
    if not may_run_agent(run.created_by, run.agent_id):
        # Starting a run needs run_agent, and so does every model turn: a revoked grant (direct
        # or through a group) stops the run here, before anything is reserved for the call.
        end_run(
            run,
            RunStatus.STOPPED,
            reason=StopReason.RUN_AGENT_REVOKED,
            message=f"stopped: {run.created_by.username} may no longer run this agent (run_agent revoked)",
        )
        return None
    if run.step_count >= run.limits["max_steps"]:
        end_run(run, RunStatus.STOPPED, reason=StopReason.MAX_STEPS, message="stopped: max steps reached")
        return None
    failures = 0
    for step in reversed(steps):
        if step.kind != StepKind.MODEL:
            break
        if step.status in (StepStatus.FAILED, StepStatus.OUTCOME_UNKNOWN):
            failures += 1
    if failures >= MAX_MODEL_FAILURES:
        end_run(
            run,
            RunStatus.FAILED,
            error=f"model call failed {failures} times in a row",
            message="failed: model unavailable",
        )
        return None
    offered = offer.offered_tools(run, user=run.created_by)  # the user row this claim read
    request = model_gateway.build_request(run, steps, offered)
    endpoint = run.version.model_endpoint
    if endpoint.secret_id:
        endpoint.secret  # noqa: B018 -- read now: the call itself then needs no database connection
    input_tokens = model_gateway.estimate_input_tokens(request)
    return _new_plan(
        run,
        "model",
        endpoint.timeout_seconds,
        model=ModelPlan(
            request=request,
            estimate=model_gateway.estimate_cost_micros(endpoint, request, input_tokens=input_tokens),
            endpoint=endpoint,
            seq=(steps[-1].seq if steps else 0) + 1,
            summary=model_gateway.request_summary(request, input_tokens=input_tokens),
        ),
    )


def _plan_tool(run: Run, step: Step, steps: list[Step], now: dt.datetime) -> Plan | None:
    if step.tool_name in offer.PLATFORM_TOOLS:
        platform_tools.run_platform_tool(run, step)
        continue_run(run)
        return None
    # Fresh rows: the user and the run this claim read under the lock; the tool, its server and
    # the permission in one statement; the call's offer from the step log.
    denial = checks.check_dispatch(run, step, user=run.created_by, steps=steps)
    record_shadow(run, step)  # shadow-mode policy sets: on the timeline, never enforced
    if denial:
        if step.status == StepStatus.APPROVED:
            void_approval(step, reason=denial)
        deny(step, denial)
        _continue_unless_looping(run, steps, step)
        return None
    prior = next(
        (
            s
            for s in steps
            if s.seq < step.seq
            and s.kind == StepKind.TOOL
            and s.tool_id == step.tool_id
            and s.args_digest == step.args_digest
            and s.status in (StepStatus.SUCCEEDED, StepStatus.RESOLVED_SUCCEEDED)
        ),
        None,
    )
    if prior is not None:
        _replay(run, step, prior, steps)
        return None
    if step.status == StepStatus.PROPOSED:
        decision = approvals.decision_for(run, step.tool, step.arguments, step=step)
        if decision.required:
            request_approval(run, step, decision)
            transition_step(
                step,
                StepStatus.AWAITING_APPROVAL,
                message=f"step {step.seq} {step.tool_name}: approval required ({decision.reason})",
            )
            transition_run(
                run, RunStatus.WAITING_APPROVAL, message=f"waiting for approval of {step.tool_name}"
            )
            return None
    elif step.status == StepStatus.APPROVED:
        problem = approvals.verify_for_dispatch(step)
        if problem:
            void_approval(step, reason=problem)
            deny(step, problem)
            _continue_unless_looping(run, steps, step)
            return None
    if run.tool_call_count >= run.limits["max_tool_calls"]:
        end_run(run, RunStatus.STOPPED, reason=StopReason.MAX_TOOL_CALLS, message="stopped: max tool calls")
        return None
    if run.step_count >= run.limits["max_steps"]:
        end_run(run, RunStatus.STOPPED, reason=StopReason.MAX_STEPS, message="stopped: max steps reached")
        return None
    return _new_plan(
        run, "tool", step.tool.timeout_seconds, step_id=step.pk, tool=ToolPlan(step=step, steps=steps)
    )


def _continue_unless_looping(run: Run, steps: list[Step], step: Step) -> None:
    """After a tool step's outcome (also a denial or a replay): stop on a loop, else go on."""
    if not loops.check(run, steps, step):
        continue_run(run)


def _replay(run: Run, step: Step, prior: Step, steps: list[Step]) -> None:
    """An identical call already succeeded in this run: answer from the record, call nothing."""
    note = (
        f"[platform] This exact call was already made at step {prior.seq}; "
        f"returning the recorded result without calling the tool again."
    )
    transition_step(
        step,
        StepStatus.SUCCEEDED,
        message=f"step {step.seq} {step.tool_name}: replayed from step {prior.seq}",
        result=prior.result,
        observation=f"{prior.observation}\n{note}",
        replayed_from_seq=prior.seq,
        finished_at=timezone.now(),
    )
    _continue_unless_looping(run, steps, step)


def _plan_recovery(run: Run, step: Step, steps: list[Step], now: dt.datetime) -> Plan | None:
    """A step was left `dispatching`: a scheduled retry, or a worker that died or stalled."""
    if step.next_attempt_at is not None and step.next_attempt_at > now:
        continue_run(run, countdown=(step.next_attempt_at - now).total_seconds())
        return None
    crashed = step.next_attempt_at is None
    if crashed:
        # The lost attempt may have been charged: hold its reservation once this claim commits
        # (one ledger statement per transaction, and this one's is the retry's reserve: see the
        # lock order in runs/engine/__init__.py; the sweeper is the backstop). The ids are taken
        # now: the retry's own reservation, made in this transaction, is linked to the same step
        # and must stay open.
        lost = _open_reservations(step.pk)
        transaction.on_commit(lambda: _hold_lost_reservations(lost), robust=True)
        step.crashes += 1
        Step.objects.filter(pk=step.pk).update(crashes=step.crashes)
        if step.crashes >= settings.MAX_STEP_CRASHES:
            record_event(
                run.pk,
                "recovery",
                f"step {step.seq} crashed its worker {step.crashes} times",
                step_seq=step.seq,
                action="fail_run",
            )
            no_effect = step.kind == StepKind.MODEL or step.tool.effect_class == EffectClass.READ_ONLY
            transition_step(
                step,
                StepStatus.FAILED if no_effect else StepStatus.OUTCOME_UNKNOWN,
                error=f"worker died {step.crashes} times during this step",
            )
            end_run(
                run,
                RunStatus.FAILED,
                error=f"step {step.seq} crashed its worker {step.crashes} times",
                message="failed: poison step",
            )
            return None
    if step.kind == StepKind.MODEL:
        record_event(
            run.pk,
            "recovery",
            f"model step {step.seq} lost with its worker: its reservation is held and the call is made again",
            step_seq=step.seq,
            action="hold_and_retry",
        )
        return _new_plan(run, "recover_model", 5, step_id=step.pk)
    tool = step.tool
    effect = tool.effect_class
    found = "found in dispatching after its worker was lost" if crashed else "retry due"
    if effect == EffectClass.UNSAFE:
        mark_unknown(
            run, step, f"step {step.seq} {step.tool_name} {found}; unsafe tool: never retried automatically"
        )
        return None
    if step.attempts >= tool.max_attempts:
        if effect == EffectClass.READ_ONLY:
            transition_step(
                step,
                StepStatus.FAILED,
                error=f"gave up after {step.attempts} attempts",
                observation=f"ERROR: {step.tool_name} did not answer after {step.attempts} attempts",
                finished_at=now,
            )
            continue_run(run)
        else:
            mark_unknown(
                run,
                step,
                f"step {step.seq} {step.tool_name}: {step.attempts} attempts, outcome still unknown",
            )
        return None
    due = settle_due(step)
    if crashed and effect != EffectClass.READ_ONLY and now < due:
        # The provider may still make the lost attempt visible (or de-duplicate its key) until
        # then: a "not found" or a retry before it proves nothing (DESIGN.md 5.1).
        wait_to_settle(
            run,
            step,
            due,
            f"attempt {step.attempts} was lost with its worker; settle window: the "
            f"provider may make it visible up to {tool.settle_window}s after its "
            f"{tool.timeout_seconds:g}s timeout, and a status lookup or a retry before then proves nothing",
        )
        return None
    action = {
        EffectClass.READ_ONLY: "retry",
        EffectClass.IDEMPOTENT: "retry with the same key",
        EffectClass.RECONCILABLE: "ask the provider, then retry only if it did not happen",
    }[effect]
    record_event(
        run.pk,
        "recovery",
        f"step {step.seq} {step.tool_name} {found}: {action}",
        step_seq=step.seq,
        action=action,
        effect_class=effect,
        attempts=step.attempts,
    )
    # The retry is sent from this step row: with its tool and server, read now (the call itself
    # holds no database connection).
    step = Step.objects.select_related("tool", "tool__server").get(pk=step.pk)
    step.run = run
    return _new_plan(
        run,
        "tool",
        tool.timeout_seconds,
        step_id=step.pk,
        reconcile_first=effect == EffectClass.RECONCILABLE,
        tool=ToolPlan(step=step, steps=steps),
    )


def _release_undispatched(run_id) -> None:
    """A reservation is linked to its step in the transaction that commits `dispatching`: one
    without a step paid for a call that was never sent."""
    for reservation_id in Reservation.objects.filter(
        run_id=run_id, step__isnull=True, status=Reservation.Status.OPEN
    ).values_list("pk", flat=True):
        budgets.release(reservation_id, note="its worker lost the lease before dispatching")


def _open_reservations(step_id: int) -> list:
    return list(
        Reservation.objects.filter(step_id=step_id, status=Reservation.Status.OPEN).values_list(
            "pk", flat=True
        )
    )


def _hold_lost_reservations(reservation_ids: list) -> None:
    for reservation_id in reservation_ids:
        budgets.hold(reservation_id, note="attempt lost with its worker; it may have been charged")


def mark_unknown(run: Run, step: Step, message: str) -> None:
    transition_step(
        step,
        StepStatus.OUTCOME_UNKNOWN,
        message=message,
        error=message,
        next_attempt_at=None,
        finished_at=timezone.now(),
    )
    transition_run(run, RunStatus.NEEDS_ATTENTION, message="needs attention: " + message)


def settle_due(step: Step, *, ended: dt.datetime | None = None) -> dt.datetime:
    """The earliest moment a status lookup or a retry of the step's last attempt proves anything:
    the settle window after the call ended (DESIGN.md 5.1).

    `ended`: when the worker saw the call end (a 5xx, a timeout). Unknown (the worker was lost),
    it ended at the latest at its timeout: sent_at + timeout.
    """
    if ended is None:
        sent = step.dispatched_at or step.started_at or timezone.now()
        ended = sent + dt.timedelta(seconds=step.tool.timeout_seconds)
    return ended + dt.timedelta(seconds=step.tool.settle_window)


def wait_to_settle(run: Run, step: Step, until: dt.datetime, why: str) -> None:
    """Park the run as a row (no lease, no message) until `until`; the sweeper wakes it."""
    Step.objects.filter(pk=step.pk).update(next_attempt_at=until)
    step.next_attempt_at = until
    transition_run(
        run,
        RunStatus.WAITING_SETTLE,
        resume_at=until,
        message=f"waiting until {until.isoformat(timespec='seconds')} to ask about step {step.seq} "
        f"{step.tool_name}: {why}",
        event_data={"step_seq": step.seq, "tool": step.tool_name, "until": until.isoformat(), "reason": why},
    )
