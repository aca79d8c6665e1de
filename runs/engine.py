"""The run loop: claim, act, record — at most one step per Celery task (DESIGN.md section 3).

    claim   short transaction, run row locked: take the lease, decide the next step from the
            durable step log (never from the message), apply decisions that need no network
            (denials, approvals requested, replays, stops).
    reserve budget, in its own transaction (budget rows are never locked together with a run).
    mark    short transaction, run row locked: check the lease and the cancel flag, commit the
            step as `dispatching` (with its idempotency key) before anything is sent.
    act     no transaction and no database connection held: call the model or the tool.
    settle  budget, in its own transaction.
    record  short transaction, run row locked: write the outcome only if the lease token still
            matches; a fenced-out worker only adds a late-attempt event.
    continue enqueue the next task on commit, or park the run.
"""
from __future__ import annotations

import datetime as dt
import logging
import random
import time
import uuid
from dataclasses import dataclass, field

from django.conf import settings
from django.db import InterfaceError, OperationalError, close_old_connections, connection, transaction
from django.db.models import F
from django.utils import timezone

from budgets import services as budgets
from budgets.models import BudgetAccount
from runs import heartbeat
from runs.models import (READY, WAITING, Run, RunStatus, Step, StepKind, StepStatus,
                         StopReason)
from runs import rows
from runs.services import (atomic_with_events, bump_counters, end_run, enqueue, lease_seconds_for, lock_run,
                           record_event, transition_run, transition_step)
from tools.models import EffectClass
from tools.types import ToolFailed, ToolOutcomeUnknown, ToolResult

log = logging.getLogger(__name__)
MAX_MODEL_FAILURES = 5


@dataclass
class Plan:
    run_id: uuid.UUID
    token: uuid.UUID
    kind: str                         # "model" | "tool" | "recover_model"
    lease_seconds: int
    step_id: int | None = None
    reservation_id: uuid.UUID | None = None
    reconcile_first: bool = False
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ToolOutcome:
    kind: str                         # "succeeded" | "failed" | "unknown"
    result: ToolResult | None = None
    error: str = ""
    retry_after: float | None = None
    reconciled: bool = False


def advance(run_id, *, enqueued_at: dt.datetime | None = None) -> None:
    """Perform at most one step of the run. Safe to call any number of times, concurrently.

    `enqueued_at` comes with a queued message: a message older than the run's last enqueue was
    superseded by a newer one and does nothing.
    """
    plan = _claim(run_id, enqueued_at)
    if plan is None:
        return
    if plan.kind == "recover_model":
        _recover_model(plan)
    elif plan.kind == "model":
        _do_model(plan)
    else:
        _do_tool(plan)


# --- claim -----------------------------------------------------------------------------------

def _claim(run_id, enqueued_at: dt.datetime | None = None) -> Plan | None:
    with atomic_with_events():
        try:
            # With the user who started it and the model endpoint: read fresh, in this one statement.
            run = lock_run(run_id, for_step=True)
        except Run.DoesNotExist:
            return None
        if enqueued_at is not None and run.last_enqueued_at is not None and enqueued_at < run.last_enqueued_at:
            return None          # superseded: a newer message for this run is on its way
        now = timezone.now()
        if run.is_terminal or run.status in WAITING:
            return None
        if run.lease_token is not None and run.lease_expires_at and run.lease_expires_at > now:
            return None
        if run.lease_token is not None:
            record_event(run.pk, "lease_expired", "previous worker's lease expired; taking over",
                         expired_at=run.lease_expires_at.isoformat())
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
        return _decide(run, _step_log(run), now)


def _step_log(run: Run) -> list[Step]:
    """The run's steps in order (tools are read where needed, fresh: check_dispatch)."""
    steps = [step for step, in rows.fetch(f"SELECT {rows.columns(Step, 's')} FROM {rows.table(Step)} s "
                                          "WHERE s.run_id = %s ORDER BY s.seq", [run.pk], Step)]
    for step in steps:
        step.run = run
    return steps


def _decide(run: Run, steps: list[Step], now: dt.datetime) -> Plan | None:
    inflight = next((s for s in steps if s.status == StepStatus.DISPATCHING), None)
    if inflight is not None:
        return _plan_recovery(run, inflight, now)
    if any(s.kind == StepKind.TOOL and s.status == StepStatus.OUTCOME_UNKNOWN for s in steps):
        transition_run(run, RunStatus.NEEDS_ATTENTION, message="waiting for a person to resolve an unknown outcome")
        return None
    if any(s.status == StepStatus.AWAITING_APPROVAL for s in steps):
        transition_run(run, RunStatus.WAITING_APPROVAL, message="waiting for approval")
        return None
    ready = next((s for s in steps if s.kind == StepKind.TOOL and s.status in READY), None)
    if ready is not None:
        return _plan_tool(run, ready, steps, now)
    last_model = next((s for s in reversed(steps) if s.kind == StepKind.MODEL
                       and s.status == StepStatus.SUCCEEDED), None)
    if last_model is not None and not last_model.result.get("tool_calls"):
        end_run(run, RunStatus.SUCCEEDED, message="succeeded")
        return None
    return _plan_model(run, steps)


def _take_lease(run: Run, seconds: int) -> uuid.UUID:
    token = uuid.uuid4()
    expires = timezone.now() + dt.timedelta(seconds=seconds)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {rows.table(Run)} SET lease_token = %s, lease_expires_at = %s WHERE id = %s",
                       [token, expires, run.pk])
    run.lease_token, run.lease_expires_at = token, expires
    return token


def _continue(run: Run, *, countdown: float | None = None) -> None:
    enqueue(run.pk, countdown=countdown, lease_token=None, lease_expires_at=None)   # one UPDATE


def _plan_model(run: Run, steps: list[Step]) -> Plan | None:
    from llm import gateway as model_gateway
    from tools import gateway as tool_gateway

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
        end_run(run, RunStatus.FAILED, error=f"model call failed {failures} times in a row",
                message="failed: model unavailable")
        return None
    offered = tool_gateway.offered_tools(run, user=run.created_by)   # the user row this claim read
    request = model_gateway.build_request(run, steps, offered)
    endpoint = run.version.model_endpoint
    if endpoint.secret_id:
        endpoint.secret   # read now: the call itself then needs no database connection
    input_tokens = model_gateway.estimate_input_tokens(request)
    estimate = model_gateway.estimate_cost_micros(endpoint, request, input_tokens=input_tokens)
    lease = lease_seconds_for(endpoint.timeout_seconds)
    token = _take_lease(run, lease)
    return Plan(run.pk, token, "model", lease,
                extra={"request": request, "estimate": estimate, "endpoint_id": endpoint.pk,
                       "endpoint": endpoint, "seq": (steps[-1].seq if steps else 0) + 1, "run": run,
                       "summary": model_gateway.request_summary(request, input_tokens=input_tokens)})


def _plan_tool(run: Run, step: Step, steps: list[Step], now: dt.datetime) -> Plan | None:
    from approvals import services as approvals
    from tools import gateway as tool_gateway

    if step.tool_name == tool_gateway.SEARCH_TOOLS:
        tool_gateway.run_search_tools(run, step)
        _continue(run)
        return None
    # Fresh rows: the user and the run this claim read under the lock; the tool, its server and
    # the permission in one statement; the call's offer from the step log.
    denial = tool_gateway.check_dispatch(run, step, user=run.created_by, steps=steps)
    if denial:
        if step.status == StepStatus.APPROVED:
            approvals.void_for_step(step, reason=denial)
        _deny(step, denial)
        _continue(run)
        return None
    prior = next((s for s in steps if s.seq < step.seq and s.kind == StepKind.TOOL
                  and s.tool_id == step.tool_id and s.args_digest == step.args_digest
                  and s.status in (StepStatus.SUCCEEDED, StepStatus.RESOLVED_SUCCEEDED)), None)
    if prior is not None:
        _replay(run, step, prior, steps)
        return None
    if step.status == StepStatus.PROPOSED:
        decision = approvals.decision_for(run, step.tool, step.arguments)
        if decision.required:
            approvals.request_approval(run=run, step=step, decision=decision)
            transition_step(step, StepStatus.AWAITING_APPROVAL, message=f"step {step.seq} {step.tool_name}: "
                            f"approval required ({decision.reason})")
            transition_run(run, RunStatus.WAITING_APPROVAL, message=f"waiting for approval of {step.tool_name}")
            return None
    elif step.status == StepStatus.APPROVED:
        problem = approvals.verify_for_dispatch(step)
        if problem:
            approvals.void_for_step(step, reason=problem)
            _deny(step, problem)
            _continue(run)
            return None
    if run.tool_call_count >= run.limits["max_tool_calls"]:
        end_run(run, RunStatus.STOPPED, reason=StopReason.MAX_TOOL_CALLS, message="stopped: max tool calls")
        return None
    if run.step_count >= run.limits["max_steps"]:
        end_run(run, RunStatus.STOPPED, reason=StopReason.MAX_STEPS, message="stopped: max steps reached")
        return None
    lease = lease_seconds_for(step.tool.timeout_seconds)
    return Plan(run.pk, _take_lease(run, lease), "tool", lease, step_id=step.pk,
                extra={"step": step, "run": run, "steps": steps})


def _deny(step: Step, reason: str) -> None:
    transition_step(step, StepStatus.DENIED, message=f"step {step.seq} {step.tool_name or '?'} denied: {reason}",
                    error=reason, observation=f"ERROR: call denied by the platform: {reason}",
                    finished_at=timezone.now())


def _replay(run: Run, step: Step, prior: Step, steps: list[Step]) -> None:
    """An identical call already succeeded in this run: answer from the record, call nothing."""
    from runs import loops

    note = (f"[platform] This exact call was already made at step {prior.seq}; "
            f"returning the recorded result without calling the tool again.")
    transition_step(step, StepStatus.SUCCEEDED, message=f"step {step.seq} {step.tool_name}: replayed from "
                    f"step {prior.seq}", result=prior.result, observation=f"{prior.observation}\n{note}",
                    replayed_from_seq=prior.seq, finished_at=timezone.now())
    if not loops.check(run, steps, step):
        _continue(run)


def _plan_recovery(run: Run, step: Step, now: dt.datetime) -> Plan | None:
    """A step was left `dispatching`: a scheduled retry, or a worker that died or stalled."""
    if step.next_attempt_at is not None and step.next_attempt_at > now:
        _continue(run, countdown=(step.next_attempt_at - now).total_seconds())
        return None
    crashed = step.next_attempt_at is None
    if crashed:
        # The lost attempt may have been charged: hold its reservation once this claim commits
        # (budget rows are never locked while the run row is; the sweeper is the backstop).
        transaction.on_commit(lambda: _hold_lost_reservations(step.pk), robust=True)
        step.crashes += 1
        Step.objects.filter(pk=step.pk).update(crashes=step.crashes)
        if step.crashes >= settings.MAX_STEP_CRASHES:
            record_event(run.pk, "recovery", f"step {step.seq} crashed its worker {step.crashes} times",
                         step_seq=step.seq, action="fail_run")
            no_effect = step.kind == StepKind.MODEL or step.tool.effect_class == EffectClass.READ_ONLY
            transition_step(step, StepStatus.FAILED if no_effect else StepStatus.OUTCOME_UNKNOWN,
                            error=f"worker died {step.crashes} times during this step")
            end_run(run, RunStatus.FAILED, error=f"step {step.seq} crashed its worker {step.crashes} times",
                    message="failed: poison step")
            return None
    if step.kind == StepKind.MODEL:
        record_event(run.pk, "recovery", f"model step {step.seq} lost with its worker: its reservation is "
                     "held and the call is made again", step_seq=step.seq, action="hold_and_retry")
        lease = lease_seconds_for(5)
        return Plan(run.pk, _take_lease(run, lease), "recover_model", lease, step_id=step.pk)
    tool = step.tool
    effect = tool.effect_class
    found = "found in dispatching after its worker was lost" if crashed else "retry due"
    if effect == EffectClass.UNSAFE:
        _mark_unknown(run, step, f"step {step.seq} {step.tool_name} {found}; unsafe tool: never retried "
                      "automatically")
        return None
    if step.attempts >= tool.max_attempts:
        if effect == EffectClass.READ_ONLY:
            transition_step(step, StepStatus.FAILED, error=f"gave up after {step.attempts} attempts",
                            observation=f"ERROR: {step.tool_name} did not answer after {step.attempts} attempts",
                            finished_at=now)
            _continue(run)
        else:
            _mark_unknown(run, step, f"step {step.seq} {step.tool_name}: {step.attempts} attempts, outcome "
                          "still unknown")
        return None
    action = {EffectClass.READ_ONLY: "retry", EffectClass.IDEMPOTENT: "retry with the same key",
              EffectClass.RECONCILABLE: "ask the provider, then retry only if it did not happen"}[effect]
    record_event(run.pk, "recovery", f"step {step.seq} {step.tool_name} {found}: {action}",
                 step_seq=step.seq, action=action, effect_class=effect, attempts=step.attempts)
    lease = lease_seconds_for(tool.timeout_seconds)
    return Plan(run.pk, _take_lease(run, lease), "tool", lease, step_id=step.pk,
                reconcile_first=effect == EffectClass.RECONCILABLE)


def _release_undispatched(run_id) -> None:
    """A reservation is linked to its step in the transaction that commits `dispatching`: one
    without a step paid for a call that was never sent."""
    from budgets.models import Reservation

    for reservation_id in Reservation.objects.filter(run_id=run_id, step__isnull=True,
                                                     status=Reservation.Status.OPEN).values_list("pk", flat=True):
        budgets.release(reservation_id, note="its worker lost the lease before dispatching")


def _hold_lost_reservations(step_id: int) -> None:
    from budgets.models import Reservation

    for reservation_id in Reservation.objects.filter(step_id=step_id, status=Reservation.Status.OPEN) \
            .values_list("pk", flat=True):
        budgets.hold(reservation_id, note="attempt lost with its worker; it may have been charged")


def _mark_unknown(run: Run, step: Step, message: str) -> None:
    transition_step(step, StepStatus.OUTCOME_UNKNOWN, message=message, error=message,
                    next_attempt_at=None)
    transition_run(run, RunStatus.NEEDS_ATTENTION, message="needs attention: " + message)


# --- reserve and mark ------------------------------------------------------------------------

def _reserve(plan: Plan, *, amount: int, purpose: str) -> bool:
    # The run, tenant and user rows the claim just read (recovery plans carry none: read them).
    run = plan.extra.get("run") or Run.objects.select_related("tenant", "created_by").get(pk=plan.run_id)
    try:
        reservation = budgets.reserve(tenant=run.tenant, run=run, user=run.created_by,
                                      amount_micros=amount, purpose=purpose)
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
            end_run(run, RunStatus.STOPPED, reason=StopReason.BUDGET_EXHAUSTED, error=exc.message,
                    message="stopped: run budget exhausted")
        elif run.tenant.on_budget_exhausted == run.tenant.OnBudgetExhausted.PAUSE:
            resume = budgets.next_local_midnight(run.tenant)
            transition_run(run, RunStatus.WAITING_BUDGET, message=f"paused until {resume.isoformat()}: "
                           f"{exc.scope} budget spent", resume_at=resume, lease_token=None, lease_expires_at=None)
        else:
            end_run(run, RunStatus.STOPPED, reason=StopReason.TENANT_BUDGET_EXHAUSTED, error=exc.message,
                    message=f"stopped: {exc.scope} budget exhausted")


def _fenced(run: Run, plan: Plan) -> bool:
    return run.lease_token == plan.token


def _mark_dispatching(plan: Plan, step: Step | None = None, new_step: dict | None = None) -> Step | None:
    """Commit the step as dispatching before the call, or give up if fenced out or cancelled."""
    from budgets.models import Reservation

    with atomic_with_events():
        now = timezone.now()
        if new_step is not None:
            if not _bump_if_leased(plan, step_count=1, model_call_count=1):
                return _not_dispatching(plan)
            step = Step(run_id=plan.run_id, status=StepStatus.DISPATCHING, attempts=1, started_at=now,
                        reserved_micros=new_step.pop("reserved"), **new_step)
            rows.insert([step])
            record_event(plan.run_id, "step", f"step {step.seq} model call dispatched", step_seq=step.seq,
                         to=StepStatus.DISPATCHING, step_kind=StepKind.MODEL)
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
        cursor.execute(f"UPDATE {rows.table(Run)} SET {sets} WHERE id = %s AND lease_token = %s "
                       "AND NOT cancel_requested", [*counters.values(), plan.run_id, plan.token])
        return cursor.rowcount == 1


def _not_dispatching(plan: Plan) -> None:
    """The lease is gone (nothing to do) or the run is to be cancelled (cancel it now)."""
    run = lock_run(plan.run_id)
    if _fenced(run, plan) and run.cancel_requested:
        end_run(run, RunStatus.CANCELLED, message="cancelled before dispatch")
    return None


def _transition_to_dispatching(step: Step, now: dt.datetime) -> None:
    transition_step(step, StepStatus.DISPATCHING, attempts=step.attempts + 1, next_attempt_at=None,
                    started_at=step.started_at or now,
                    message=f"step {step.seq} {step.tool_name} dispatched (attempt {step.attempts + 1}, "
                            f"key {step.idempotency_key})")


def _mark_approved_dispatching(plan: Plan, step: Step, now: dt.datetime) -> Step | None:
    """An approved call: its approval is used up in the same transaction that marks it."""
    from approvals import services as approvals

    run = lock_run(plan.run_id)
    if not _fenced(run, plan):
        return None
    if run.cancel_requested:
        end_run(run, RunStatus.CANCELLED, message="cancelled before dispatch")
        return None
    step = Step.objects.select_related("tool", "tool__server").get(pk=step.pk)
    if step.status == StepStatus.APPROVED and not approvals.consume(step):
        _deny(step, "approval was already used or withdrawn")
        _continue(run)
        return None
    _transition_to_dispatching(step, now)
    bump_counters(run, step_count=1, tool_call_count=1)
    return step


# --- model steps -----------------------------------------------------------------------------

def _do_model(plan: Plan) -> None:
    from llm import gateway as model_gateway
    from llm.models import ModelEndpoint
    from llm.types import ProviderError

    request = plan.extra["request"]
    estimate = plan.extra["estimate"]
    if not _reserve(plan, amount=estimate, purpose="model"):
        return
    step = _mark_dispatching(plan, new_step={
        "seq": plan.extra["seq"], "kind": StepKind.MODEL, "reserved": estimate,
        "request": plan.extra.get("summary") or model_gateway.request_summary(request)})
    if step is None:
        budgets.release(plan.reservation_id, note="call not made")
        return
    # The endpoint (and its secret) the claim read: the call itself needs no database connection.
    endpoint = plan.extra.get("endpoint") or ModelEndpoint.objects.select_related("secret").get(
        pk=plan.extra["endpoint_id"])
    try:
        reply = model_gateway.call_model(endpoint, request)
    except ProviderError as exc:
        heartbeat.untrack(plan.run_id)
        close_old_connections()
        failure = exc   # `exc` is unbound once the except block ends
        _through_database_outage(lambda: _record_model_failure(plan, step, failure), seconds=plan.lease_seconds)
        return
    finally:
        heartbeat.untrack(plan.run_id)
    close_old_connections()
    cost = model_gateway.cost_micros(endpoint, reply.usage)

    def settle_and_record() -> None:
        budgets.settle(plan.reservation_id, actual_micros=cost)
        _record_model(plan, step, reply, cost, estimate)

    _through_database_outage(settle_and_record, seconds=plan.lease_seconds)


def _record_model_failure(plan: Plan, step: Step, exc) -> None:
    # No answer after sending, or a 2xx we could not read: the provider may have charged it.
    lost = exc.sent and (exc.status is None or 200 <= exc.status < 300)
    if lost:
        budgets.hold(plan.reservation_id, note=f"model response lost: {exc}")
    else:
        budgets.release(plan.reservation_id, note=f"provider refused: {exc}")
    with atomic_with_events():
        run = lock_run(plan.run_id)
        status = StepStatus.OUTCOME_UNKNOWN if lost else StepStatus.FAILED
        message = f"step {step.seq} model call {'lost' if lost else 'failed'}: {exc}"
        if not _fenced(run, plan):
            record_event(run.pk, "late_attempt", message, step_seq=step.seq)
            return
        transition_step(step, status, message=message, error=str(exc), finished_at=timezone.now())
        if run.cancel_requested:
            end_run(run, RunStatus.CANCELLED, message="cancelled")
        elif not exc.retryable:
            end_run(run, RunStatus.FAILED, error=f"model provider refused the request: {exc}",
                    message="failed: model request refused")
        else:
            _continue(run, countdown=exc.retry_after if exc.retry_after is not None else 1.0)


def _record_model(plan: Plan, step: Step, reply, cost: int, estimate: int) -> None:
    from tools import gateway as tool_gateway

    with atomic_with_events():
        run = lock_run(plan.run_id)
        if not _fenced(run, plan):
            record_event(run.pk, "late_attempt", f"step {step.seq} model reply arrived after the lease was lost",
                         step_seq=step.seq, cost_micros=cost)
            return
        # Known secrets are redacted from what the model said before it is stored or acted on.
        text, calls = tool_gateway.redact_reply(run, reply)
        usage = {"input_tokens": reply.usage.input_tokens, "cached_input_tokens": reply.usage.cached_input_tokens,
                 "cache_write_tokens": reply.usage.cache_write_tokens, "output_tokens": reply.usage.output_tokens}
        transition_step(step, StepStatus.SUCCEEDED, result={"text": text, "tool_calls": calls},
                        usage=usage, cost_micros=cost, finished_at=timezone.now(),
                        observation=text,
                        message=f"step {step.seq} model call: {len(calls)} tool call(s), cost {cost} micros")
        _budget_event(run, step, reserved=estimate, settled=cost)
        tool_gateway.propose(run=run, parent_seq=step.seq, calls=calls)
        if run.cancel_requested:
            end_run(run, RunStatus.CANCELLED, message="cancelled")
        elif not calls:
            end_run(run, RunStatus.SUCCEEDED, message="succeeded", final_output=text)
        else:
            _continue(run)


def _budget_event(run: Run, step: Step, *, reserved: int, settled: int | None) -> None:
    # The run's account as settle left it: only the balance columns (the ledger's own table).
    column = {name: BudgetAccount._meta.get_field(name).column for name in
              ("run", "limit_micros", "reserved_micros", "spent_micros", "held_micros")}
    with connection.cursor() as cursor:
        cursor.execute(f'SELECT "{column["limit_micros"]}", "{column["reserved_micros"]}", "{column["spent_micros"]}", '
                       f'"{column["held_micros"]}" FROM {rows.table(BudgetAccount)} WHERE "{column["run"]}" = %s',
                       [run.pk])
        limit, reserved_now, spent, held = cursor.fetchone()
    account = BudgetAccount(limit_micros=limit, reserved_micros=reserved_now, spent_micros=spent, held_micros=held)
    record_event(run.pk, "budget", f"step {step.seq}: reserved {reserved}, settled {settled}, "
                 f"run remaining {account.remaining_micros} micros", step_seq=step.seq, reserved=reserved,
                 settled=settled, spent=spent, held=held, remaining=account.remaining_micros, limit=limit)


def _recover_model(plan: Plan) -> None:
    from budgets.models import Reservation

    for reservation_id in Reservation.objects.filter(step_id=plan.step_id, status=Reservation.Status.OPEN) \
            .values_list("pk", flat=True):
        budgets.hold(reservation_id, note="model call lost with its worker")
    with atomic_with_events():
        run = lock_run(plan.run_id)
        if not _fenced(run, plan):
            return
        step = Step.objects.get(pk=plan.step_id)
        transition_step(step, StepStatus.OUTCOME_UNKNOWN, error="worker lost during the call; charge held",
                        finished_at=timezone.now())
        _continue(run)


# --- tool steps ------------------------------------------------------------------------------

def _do_tool(plan: Plan) -> None:
    # The step row the claim read (with its tool); _mark_dispatching re-reads it under the run lock.
    step = plan.extra.get("step") or Step.objects.select_related("tool", "tool__server").get(pk=plan.step_id)
    if plan.reconcile_first:
        found = _reconcile(plan, step)
        if found is not None:
            _record_tool(plan, step, found)
            return
    if not _reserve(plan, amount=step.tool.price_micros, purpose="tool"):
        return
    dispatched = _mark_dispatching(plan, step=step)
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

    _through_database_outage(close_and_record, seconds=plan.lease_seconds)


def _through_database_outage(write, *, seconds: float) -> None:
    """Retry the write of an outcome held only in memory while the database is unreachable.

    Giving up would turn a known outcome into an unknown one (for an unsafe tool: a person's
    problem). Retrying is safe: the reservation closes once and the record is fenced; after
    `seconds` the lease may be someone else's and the task's own retry takes over.
    """
    deadline = time.monotonic() + seconds
    while True:
        try:
            write()
            return
        except (OperationalError, InterfaceError):
            if time.monotonic() >= deadline:
                raise
            log.warning("database unreachable while recording an outcome; retrying", exc_info=True)
            connection.close()
            time.sleep(1.0)


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
            if _fenced(run, plan):
                # A failed lookup counts as an attempt: a status endpoint that stays down ends in
                # needs_attention after max_attempts instead of an endless loop of lookups.
                Step.objects.filter(pk=step.pk).update(attempts=F("attempts") + 1)
                record_event(run.pk, "recovery", f"status lookup for step {step.seq} failed: {exc}",
                             step_seq=step.seq)
        return ToolOutcome("unknown", error=f"status lookup failed: {exc}")
    with atomic_with_events():
        run = lock_run(plan.run_id)
        if _fenced(run, plan):
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
        if not _fenced(run, plan):
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
            _budget_event(run, step, reserved=step.tool.price_micros, settled=step.tool.price_micros)
            if steps is None or not any(s is step for s in steps):
                steps = list(run.steps.all())
            if run.cancel_requested:
                end_run(run, RunStatus.CANCELLED, message="cancelled")
            elif not loops.check(run, steps, step):
                _continue(run)
        elif outcome.kind == "failed":
            error = tool_gateway.redact_text(run, outcome.error)
            transition_step(step, StepStatus.FAILED, error=error, observation=f"ERROR: {error}", finished_at=now,
                            message=f"step {step.seq} {step.tool_name} failed: {error}")
            if run.cancel_requested:
                end_run(run, RunStatus.CANCELLED, message="cancelled")
            else:
                _continue(run)
        else:
            _record_unknown(run, step, outcome)


def _record_unknown(run: Run, step: Step, outcome: ToolOutcome) -> None:
    from tools import gateway as tool_gateway

    tool = step.tool
    error = tool_gateway.redact_text(run, outcome.error)
    if tool.effect_class == EffectClass.UNSAFE or step.attempts >= tool.max_attempts:
        if tool.effect_class == EffectClass.READ_ONLY:
            transition_step(step, StepStatus.FAILED, error=error, finished_at=timezone.now(),
                            observation=f"ERROR: {step.tool_name} did not answer: {error}")
            _continue(run)
            return
        _mark_unknown(run, step, f"step {step.seq} {step.tool_name}: outcome unknown ({error})")
        return
    delay = outcome.retry_after if outcome.retry_after is not None else \
        tool.backoff_seconds * 2 ** (step.attempts - 1) * random.uniform(0.5, 1.0)
    retry_at = timezone.now() + dt.timedelta(seconds=delay)
    Step.objects.filter(pk=step.pk).update(next_attempt_at=retry_at, error=error)
    record_event(run.pk, "retry_scheduled", f"step {step.seq} {step.tool_name}: outcome unknown ({error}); "
                 f"retry in {delay:.1f}s", step_seq=step.seq, effect_class=tool.effect_class)
    if run.cancel_requested:
        _mark_unknown(run, step, f"step {step.seq} {step.tool_name}: outcome unknown and run cancelled")
        return
    _continue(run, countdown=delay)


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
