"""Around the call, for both step kinds (runs/engine/__init__.py).

Before it, in the claim's transaction: reserve the budget and commit the step as `dispatching`.
After it: write the outcome through a database outage, and record the budget event.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
import uuid

from django.db import InterfaceError, OperationalError, connection
from django.utils import timezone

from approvals import services as approvals
from budgets import services as budgets
from budgets.models import BudgetAccount, Reservation
from core import chain, sql
from regions.models import HomeLink, is_home, user_home_free
from runs.controls import kill_switches
from runs.engine import decisions, heartbeat, writer
from runs.engine.types import Intent, Lease, ModelCall, ModelPlan, Plan, ToolCall, ToolPlan, fenced, tool_of
from runs.models import Run, RunEvent, RunReplay, RunStatus, Step, StepKind, StepStatus, StopReason
from runs.policy_events import decision_data
from runs.queueing import continue_run
from runs.transitions import (
    atomic_with_events,
    end_run,
    lock_run,
    record_event,
    transition_run,
    transition_step,
    write_run_at_end,
)

log = logging.getLogger(__name__)


# --- reserve and mark ------------------------------------------------------------------------


def reserve_and_mark(run: Run, intent: Intent) -> ModelCall | ToolCall | None:
    """Reserve the call's worst case and commit its step as `dispatching`, in the claim's
    transaction with `run` locked; the lease is taken in the same UPDATE that counts the step and
    numbers the events (runs.transitions.write_run_at_end). The plan of the committed call.

    None: refused by the budget (recorded: the run stops or waits) or by a used-up approval
    (the step is denied); nothing is reserved then.
    """
    if intent.model is not None:
        return _mark_model(run, intent.lease, intent.model)
    if intent.tool is None:
        raise TypeError("an intent names a model call or a tool call")
    return _mark_tool(run, intent.lease, intent.tool, take_lease=True)


def _lease_fields(lease: Lease, now: dt.datetime) -> dict:
    return {"lease_token": lease.token, "lease_expires_at": now + dt.timedelta(seconds=lease.seconds)}


def _mark_model(run: Run, lease: Lease, model: ModelPlan) -> ModelCall | None:
    now = timezone.now()
    summary = model.fold is not None  # a fold's summary (runs/engine/summaries.py)
    step = Step(
        run_id=run.pk,
        seq=model.seq,
        kind=StepKind.SUMMARY if summary else StepKind.MODEL,
        status=StepStatus.DISPATCHING,
        attempts=1,
        started_at=now,
        dispatched_at=now,
        reserved_micros=model.estimate,
        request=model.summary,
        model_endpoint_id=model.endpoint.pk,
    )
    sql.insert([step])
    if summary:
        reservation_id = _reserve_summary(run, step, model)
    else:
        reservation_id = _reserve(run, step, amount=model.estimate, purpose="model", what=_fallback_of(model))
    if reservation_id is None:
        if not summary:
            Step.objects.filter(
                run_id=step.run_id, pk=step.pk
            ).delete()  # never dispatched: the refusal is the record
        return None
    record_event(
        run.pk,
        "step",
        f"step {step.seq} {'summary of a fold' if summary else 'model call'} dispatched",
        step_seq=step.seq,
        to=StepStatus.DISPATCHING,
        step_kind=step.kind,
        content=chain.content_of({"request": step.request}),  # binds the request into the chain
    )
    # A summary is no step of the agent's: it counts toward neither limit.
    adds = {} if summary else {"step_count": 1, "model_call_count": 1}
    write_run_at_end(run, adds=adds, **_lease_fields(lease, now))
    return ModelCall(lease, run, step, reservation_id, model)


def _reserve_summary(run: Run, step: Step, model: ModelPlan) -> uuid.UUID | None:
    """A summary's reservation; a refusal leaves the fold its deterministic record and the run
    goes on (its next model call meets the budget as any call does)."""
    try:
        return budgets.reserve(
            tenant=run.tenant,
            run=run,
            user=run.created_by,
            step=step,
            amount_micros=model.estimate,
            purpose="model",
        ).pk
    except budgets.BudgetExceeded as exc:
        transition_step(
            step,
            StepStatus.FAILED,
            message=f"step {step.seq} summary not made: {exc.message}; the fold keeps its record",
            error=f"budget refused the summary: {exc.message}",
            error_class="budget",
            finished_at=timezone.now(),
        )
        continue_run(run)
        return None


def _mark_tool(run: Run, lease: Lease, call: ToolPlan, *, take_lease: bool) -> ToolCall | None:
    """`take_lease` false: after a status lookup, whose worker holds the lease already."""
    now = timezone.now()
    step = call.step
    reservation_id = _reserve(run, step, amount=tool_of(step).price_micros, purpose="tool")
    if reservation_id is None:
        return None
    if step.status == StepStatus.APPROVED:
        # The approval is used up in the transaction that commits the call it covers.
        if not approvals.consume(step):
            budgets.release(reservation_id, note="call not made: approval already used")
            writer.deny(run, step, "approval was already used or withdrawn")
            return None
    first = step.status != StepStatus.DISPATCHING
    _transition_to_dispatching(step, now)
    counters = {"step_count": 1, "tool_call_count": 1} if first else {}
    if take_lease:
        write_run_at_end(run, adds=counters, **_lease_fields(lease, now))
    elif counters:
        write_run_at_end(run, adds=counters)
    return ToolCall(lease, run, call, step=step, reservation_id=reservation_id)


def _fallback_of(model) -> str:
    """What a refused model reservation was for, when it is a fallback's: the run's record says
    the budget could not carry the fallback (at its prices), not only that it ran out."""
    if model.chain is None or not model.chain.index_of(model.endpoint.pk):
        return ""
    return f"the fallback endpoint {model.endpoint.name}, reserved at its own prices"


def _reserve(run: Run, step: Step, *, amount: int, purpose: str, what: str = "") -> uuid.UUID | None:
    """The reservation's id; None when the budget refused it (recorded on the run)."""
    try:
        if run.evaluation:
            # An evaluation's run spends its evaluation's budget, never the tenant's or the user's
            # day (docs/evaluations.md): the replay row names that account.
            reservation = budgets.reserve_on(
                account_id=_evaluation_account(run), run=run, step=step, amount_micros=amount, purpose=purpose
            )
        else:
            reservation = budgets.reserve(
                tenant=run.tenant,
                run=run,
                user=run.created_by,
                step=step,
                amount_micros=amount,
                purpose=purpose,
            )
    except budgets.BudgetExceeded as exc:
        _record_budget_refusal(run, exc, what=what)
        return None
    return reservation.pk


def _evaluation_account(run: Run) -> int:
    account = RunReplay.objects.filter(run_id=run.pk).values_list("budget_account_id", flat=True).first()
    if account is None:
        raise BudgetAccount.DoesNotExist(f"evaluation run {run.pk} has no evaluation budget")
    return account


def _record_budget_refusal(run: Run, exc: budgets.BudgetExceeded, *, what: str = "") -> None:
    error = f"{exc.message} for {what}" if what else exc.message
    record_event(run.pk, "budget", f"refused: {error}", decision="refused", scope=exc.scope)
    if exc.scope == BudgetAccount.Scope.EVALUATION:
        end_run(
            run,
            RunStatus.STOPPED,
            reason=StopReason.BUDGET_EXHAUSTED,
            error=error,
            message="stopped: the evaluation's budget is spent",
        )
    elif exc.scope == BudgetAccount.Scope.RUN:
        end_run(
            run,
            RunStatus.STOPPED,
            reason=StopReason.BUDGET_EXHAUSTED,
            error=error,
            message="stopped: run budget cannot carry the fallback"
            if what
            else "stopped: run budget exhausted",
        )
    elif (park := _region_park_reason(run, exc.scope)) is not None:
        transition_run(
            run,
            RunStatus.WAITING_BUDGET,
            # Which day's slice it waits for: the tenant's, or its creator's own (user_day).
            message=f"parked: {park} ({exc.scope})",
            event_data={"region_reason": park, "scope": exc.scope},
            resume_at=None,
        )
    elif run.tenant.on_budget_exhausted == run.tenant.OnBudgetExhausted.PAUSE:
        resume = budgets.next_local_midnight(run.tenant)
        transition_run(
            run,
            RunStatus.WAITING_BUDGET,
            message=f"paused until {resume.isoformat()}: {exc.scope} budget spent",
            resume_at=resume,
            lease_token=None,
            lease_expires_at=None,
        )
    else:
        end_run(
            run,
            RunStatus.STOPPED,
            reason=StopReason.TENANT_BUDGET_EXHAUSTED,
            error=error,
            message=f"stopped: {exc.scope} budget exhausted",
        )


def _region_park_reason(run: Run, scope: str) -> str | None:
    """Regions: the reason to park a run whose tenant day or user day (a slice, away from home)
    refused it.

    Read only on a refusal, never on the step path: a reservation that fits costs the same in
    every region (the slice is the day's limit there).
    """
    if scope not in (BudgetAccount.Scope.TENANT_DAY, BudgetAccount.Scope.USER_DAY) or is_home(run.tenant):
        return None
    link = HomeLink.objects.filter(tenant_id=run.tenant_id).first()
    today = budgets.local_day(run.tenant)
    if scope == BudgetAccount.Scope.USER_DAY:
        home_free = user_home_free(run.tenant, today, run.created_by_id)
    else:
        home_free = link.home_free_micros if link is not None and link.home_day == today else None
    move = decisions.budget_refusal(
        scope=scope,
        home_here=False,
        link_up=link is None or link.state == HomeLink.State.UP,
        home_free_micros=home_free,
    )
    return None if move == "tenant_rule" else move[1]


def mark_after_lookup(plan: ToolCall) -> ToolCall | None:
    """After a status lookup that found nothing: reserve and commit the retry as `dispatching`,
    if this worker still holds the lease, nobody asked to cancel or pause, and no kill switch is
    on for the tool. One short transaction; the plan of the resend, read fresh."""
    with atomic_with_events():
        run = lock_run(plan.run_id, for_step=True)
        if not fenced(run, plan):
            return None
        if run.cancel_requested:
            end_run(run, RunStatus.CANCELLED, message="cancelled before dispatch")
            return None
        step = Step.objects.select_related("tool", "tool__server", "tool__server__delegation").get(
            run_id=plan.run_id, pk=plan.step_id
        )
        step.run = run
        # A switch may have gone on, or a pause been asked for, during the lookup: the resend is
        # a new call like any other, and the step waits as a retry due at the resume.
        switch = kill_switches.killed(tool_id=step.tool_id)
        if switch is not None or run.pause_requested:
            writer.keep_retry(step)
            if switch is not None:
                kill_switches.pause_by(run, switch)
            else:
                writer.pause(run)
            return None
        call = ToolPlan(step=step, may_be_corrected=plan.call.may_be_corrected)
        resend = _mark_tool(run, plan.lease, call, take_lease=False)
        if resend is None:
            return None
    let_go(resend)
    return resend


def let_go(plan: Plan) -> None:
    """The intent is committed: hold no database connection during the call, keep the lease alive."""
    connection.close()
    heartbeat.track(plan.run_id, plan.token, plan.lease_seconds)


def _transition_to_dispatching(step: Step, now: dt.datetime) -> None:
    event = transition_step(
        step,
        StepStatus.DISPATCHING,
        attempts=step.attempts + 1,
        next_attempt_at=None,
        started_at=step.started_at or now,
        dispatched_at=now,
        message=f"step {step.seq} {step.tool_name} dispatched (attempt {step.attempts + 1}, "
        f"key {step.idempotency_key})",
        defer=True,  # the claim's last write of the step: sent with the lease and the events
    )
    event.data.update(decision_data(step))  # the policies that allowed it (inserted at the end)


# --- settle and record -----------------------------------------------------------------------


def through_database_outage(record, *, seconds: float) -> None:
    """Record an outcome held only in memory, retried from scratch while the database is unreachable.

    Giving up would turn a known outcome into an unknown one (for an unsafe tool: a person's
    problem; for a model call: a second paid call). `record(retry)` must be a pure function of
    fresh rows and the outcome: with `retry` true it trusts nothing it read or wrote in memory
    before the failed attempt, whose transaction rolled back (or, at COMMIT, may have landed:
    `recorded_before` tells). Closing a reservation twice is a no-op and the record is fenced, so
    repeating is safe; after `seconds` the lease may be someone else's and the task's own retry
    takes over.
    """
    deadline = time.monotonic() + seconds
    retry = False
    while True:
        try:
            record(retry)
            return
        except (OperationalError, InterfaceError):
            if time.monotonic() >= deadline:
                raise
            log.warning("database unreachable while recording an outcome; retrying", exc_info=True)
            connection.close()
            retry = True
            time.sleep(0.5)


def recorded_before(run: Run, step: Step, since: dt.datetime) -> bool:
    """Whether an earlier attempt of this record committed although its connection then failed.

    Asked only on a retry that finds the lease gone. Within the lease nobody else writes this
    step, so an event about it written since the record began is that attempt's own.
    """
    return RunEvent.objects.filter(run_id=run.pk, step_seq=step.seq, at__gte=since).exists()


def close_tool_holds(step_id: int, *, happened: bool, price_micros: int) -> None:
    """Once a tool step's outcome is known, close the holds its lost attempts left.

    An attempt whose answer was lost keeps its reservation held (it may have been charged). When
    the step turns out to have happened and no attempt was settled at the tool's price, one hold
    is charged at that price; every other hold goes back. Run after the record commits: the
    record's transaction has its one ledger statement already (runs/engine/__init__.py).
    """
    reservations = list(
        Reservation.objects.filter(step_id=step_id).order_by("created_at").values_list("pk", "status")
    )
    charged = any(status == Reservation.Status.SETTLED for _, status in reservations)
    for reservation_id, status in reservations:
        if status != Reservation.Status.HELD:
            continue
        actual = price_micros if happened and not charged else 0
        charged = charged or actual > 0
        budgets.reconcile(
            reservation_id,
            actual_micros=actual,
            actor=None,
            note=f"the step's outcome is known: {'it happened' if happened else 'it did not happen'}",
        )


def add_settle(
    event: RunEvent, run: Run, step: Step, *, reserved: int, settled: int | None, balances
) -> None:
    """Add the settle's figures to the step's outcome event, recorded earlier in the same
    transaction (it is inserted at commit, with what the settle reported): what was reserved,
    what was charged, and the run account after it. One line of the timeline per outcome, not
    two, and one event row fewer per step (docs/performance.md)."""
    if balances is None:
        balances = (
            BudgetAccount.objects.filter(run_id=run.pk)
            .values_list("limit_micros", "reserved_micros", "spent_micros", "held_micros")
            .get()
        )
    limit, reserved_now, spent, held = balances
    remaining = (
        limit - reserved_now - spent - held
    )  # BudgetAccount.remaining_micros, without a model instance
    event.message += f"; reserved {reserved}, settled {settled}, run remaining {remaining} micros"
    event.data["budget"] = {
        "reserved": reserved,
        "settled": settled,
        "spent": spent,
        "held": held,
        "remaining": remaining,
        "limit": limit,
    }
