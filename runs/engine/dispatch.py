"""Around the call, for both step kinds (runs/engine/__init__.py).

Before it: reserve budget in its own transaction, then commit the step as `dispatching` under the
run lock. After it: write the outcome through a database outage, and record the budget event.
"""

from __future__ import annotations

import datetime as dt
import logging
import time

from django.db import InterfaceError, OperationalError, connection
from django.utils import timezone

from approvals import services as approvals
from budgets import services as budgets
from budgets.models import BudgetAccount, Reservation
from runs import rows
from runs.engine import heartbeat
from runs.engine.claim import deny
from runs.engine.types import Plan, fenced
from runs.lifecycle import (
    atomic_with_events,
    bump_counters,
    continue_run,
    end_run,
    lock_run,
    record_event,
    transition_run,
    transition_step,
)
from runs.models import Run, RunEvent, RunStatus, Step, StepKind, StepStatus, StopReason

log = logging.getLogger(__name__)


# --- reserve and mark ------------------------------------------------------------------------


def reserve(plan: Plan, *, amount: int, purpose: str) -> bool:
    # The run, tenant and user rows the claim just read (recovery plans carry none: read them).
    run = plan.extra.get("run") or Run.objects.select_related("tenant", "created_by").get(pk=plan.run_id)
    try:
        reservation = budgets.reserve(
            tenant=run.tenant, run=run, user=run.created_by, amount_micros=amount, purpose=purpose
        )
    except budgets.BudgetExceeded as exc:
        _record_budget_refusal(plan, exc)
        return False
    plan.reservation_id = reservation.pk
    return True


def _record_budget_refusal(plan: Plan, exc: budgets.BudgetExceeded) -> None:
    with atomic_with_events():
        run = lock_run(plan.run_id)
        if run.lease_token != plan.token:
            return
        record_event(run.pk, "budget", f"refused: {exc.message}", decision="refused", scope=exc.scope)
        if exc.scope == BudgetAccount.Scope.RUN:
            end_run(
                run,
                RunStatus.STOPPED,
                reason=StopReason.BUDGET_EXHAUSTED,
                error=exc.message,
                message="stopped: run budget exhausted",
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
                error=exc.message,
                message=f"stopped: {exc.scope} budget exhausted",
            )


def mark_dispatching(plan: Plan, step: Step | None = None, new_step: dict | None = None) -> Step | None:
    """Commit the step as dispatching before the call, or give up if fenced out or cancelled."""

    with atomic_with_events():
        now = timezone.now()
        if new_step is not None:
            if not _bump_if_leased(plan, step_count=1, model_call_count=1):
                return _not_dispatching(plan)
            step = Step(
                run_id=plan.run_id,
                status=StepStatus.DISPATCHING,
                attempts=1,
                started_at=now,
                dispatched_at=now,
                reserved_micros=new_step.pop("reserved"),
                **new_step,
            )
            rows.insert([step])
            record_event(
                plan.run_id,
                "step",
                f"step {step.seq} model call dispatched",
                step_seq=step.seq,
                to=StepStatus.DISPATCHING,
                step_kind=StepKind.MODEL,
            )
        elif step.status == StepStatus.APPROVED:
            step = _mark_approved_dispatching(plan, step, now)
            if step is None:
                return None
        else:
            first = step.status != StepStatus.DISPATCHING
            if not _bump_if_leased(plan, **({"step_count": 1, "tool_call_count": 1} if first else {})):
                return _not_dispatching(plan)
            _transition_to_dispatching(step, now)
        Reservation.objects.filter(pk=plan.reservation_id).update(step=step)
    # The call that follows may take long: hold no database connection while it runs.
    connection.close()
    heartbeat.track(plan.run_id, plan.token, plan.lease_seconds)
    return step


def _bump_if_leased(plan: Plan, **counters: int) -> bool:
    """Add to the run's counters if this worker still holds the lease and nobody asked to cancel.

    One conditional UPDATE: it locks the run row as lock_run would, and judges the lease and the
    cancel flag on the newest row version, so a cancel_run that committed first is always seen.
    """
    sets = ", ".join([f"{name} = {name} + %s" for name in counters] + ["lease_token = lease_token"])
    with connection.cursor() as cursor:
        rows.execute(
            cursor,
            f"UPDATE {rows.table(Run)} SET {sets} WHERE id = %s AND lease_token = %s "
            "AND NOT cancel_requested",
            [*counters.values(), plan.run_id, plan.token],
        )
        return cursor.rowcount == 1


def _not_dispatching(plan: Plan) -> None:
    """The lease is gone (nothing to do) or the run is to be cancelled (cancel it now)."""
    run = lock_run(plan.run_id)
    if fenced(run, plan) and run.cancel_requested:
        end_run(run, RunStatus.CANCELLED, message="cancelled before dispatch")
    return None


def _transition_to_dispatching(step: Step, now: dt.datetime) -> None:
    transition_step(
        step,
        StepStatus.DISPATCHING,
        attempts=step.attempts + 1,
        next_attempt_at=None,
        started_at=step.started_at or now,
        dispatched_at=now,
        message=f"step {step.seq} {step.tool_name} dispatched (attempt {step.attempts + 1}, "
        f"key {step.idempotency_key})",
    )


def _mark_approved_dispatching(plan: Plan, step: Step, now: dt.datetime) -> Step | None:
    """An approved call: its approval is used up in the same transaction that marks it."""
    run = lock_run(plan.run_id)
    if not fenced(run, plan):
        return None
    if run.cancel_requested:
        end_run(run, RunStatus.CANCELLED, message="cancelled before dispatch")
        return None
    step = Step.objects.select_related("tool", "tool__server").get(pk=step.pk)
    if step.status == StepStatus.APPROVED and not approvals.consume(step):
        deny(step, "approval was already used or withdrawn")
        continue_run(run)
        return None
    _transition_to_dispatching(step, now)
    bump_counters(run, step_count=1, tool_call_count=1)
    return step


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
    is charged at that price; every other hold goes back. Run after the record commits: budget
    rows are never locked while the run row is.
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


def budget_event(run: Run, step: Step, *, reserved: int, settled: int | None) -> None:
    # The run's account as settle left it: only the balance columns (the ledger's own table).
    balances = ", ".join(
        rows.column(BudgetAccount, name)
        for name in ("limit_micros", "reserved_micros", "spent_micros", "held_micros")
    )
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {balances} FROM {rows.table(BudgetAccount)} "
            f"WHERE {rows.column(BudgetAccount, 'run')} = %s",
            [rows.adapt(run.pk)],
        )
        limit, reserved_now, spent, held = cursor.fetchone()
    account = BudgetAccount(
        limit_micros=limit, reserved_micros=reserved_now, spent_micros=spent, held_micros=held
    )
    record_event(
        run.pk,
        "budget",
        f"step {step.seq}: reserved {reserved}, settled {settled}, "
        f"run remaining {account.remaining_micros} micros",
        step_seq=step.seq,
        reserved=reserved,
        settled=settled,
        spent=spent,
        held=held,
        remaining=account.remaining_micros,
        limit=limit,
    )
