"""One case of an evaluation: its run, through the real engine, answered from its recordings.

    run_case(evaluation, case)    start the case's run, drive it to its end, judge its checks

The run is started like any run (runs.services.start_run: the case's user's grants, the tenant's
Cedar policies and kill switches apply) as an evaluation run (runs.models.RunReplay): the engine
answers its tool calls from the case's recordings (tools/replay.py) and reserves its calls on the
evaluation's budget account, never the tenant's day. The evaluation drives the run itself, one
engine step at a time (runs.engine.advance, safe beside a worker that also picks it up), and
decides each approval the run asks for as the case says: approve or deny as the case's approver,
or let it expire. A run that ends in a wait nothing here can end (needs_attention, a budget wait)
is judged as it stands.
"""

from __future__ import annotations

import time

from django.db import IntegrityError
from django.utils import timezone

from approvals.models import Approval, ApprovalStatus
from evals import checks as check_rules
from evals import grading
from evals.models import Case, CaseResult, Evaluation
from runs import approval_effects
from runs.engine import advance
from runs.models import TERMINAL, Run, RunEvent, RunStatus, StepKind, StepStatus
from runs.services import Replay, start_run

MAX_TASKS = 400
# How long a case's run may take, at most, on the evaluation's clock (a replayed call is instant;
# a real model endpoint is not).
CASE_SECONDS = 600


def run_case(evaluation: Evaluation, case: Case) -> CaseResult:
    run, _ = start_run(
        user=case.user,
        agent=evaluation.agent_version.agent.name,
        version=evaluation.agent_version.number,
        input=case.input,
        metadata={"evaluation": str(evaluation.pk), "case": case.name},
        idempotency_key=f"evaluation:{evaluation.pk}:{case.pk}",
        replay=Replay(
            recordings=case.recordings,
            uncovered=evaluation.uncovered,
            budget_account_id=evaluation.budget_account_id or 0,
        ),
    )
    run = drive(run.pk, case, evaluation)
    return _judge(evaluation, case, run)


def drive(run_id, case: Case, evaluation: Evaluation) -> Run:
    """Step the run until it ends or waits for what only a person or time can give it."""
    deadline = time.monotonic() + CASE_SECONDS
    for _ in range(MAX_TASKS):
        advance(run_id)
        run = Run.objects.get(pk=run_id)
        if run.status in TERMINAL:
            return run
        if run.status == RunStatus.WAITING_APPROVAL:
            _decide(run, case, evaluation)
            continue
        if run.status in (RunStatus.NEEDS_ATTENTION, RunStatus.WAITING_BUDGET, RunStatus.PAUSED):
            return run
        if time.monotonic() > deadline:
            return run
        if run.status != RunStatus.RUNNING and run.status != RunStatus.QUEUED:
            time.sleep(0.05)  # a settle window or a worker holding the lease: wait and look again
    return Run.objects.get(pk=run_id)


def _decide(run: Run, case: Case, evaluation: Evaluation) -> None:
    pending = Approval.objects.filter(run=run, status=ApprovalStatus.PENDING).select_related("tool")
    for approval in pending:
        decision = case.approvals.get(approval.tool.name) or case.approvals.get("*") or "approve"
        if decision == "expire":
            approval_effects.expire_approval(approval_id=approval.pk, tenant_id=run.tenant_id)
            continue
        approver = case.approver or evaluation.started_by
        approval_effects.decide_approval(
            approval_id=approval.pk,
            user=approver,
            approve=decision == "approve",
            reason=f"decided by evaluation case {case.name}",
        )


def view_of(run: Run) -> check_rules.RunView:
    """The finished run as the checks read it."""
    steps = list(run.steps.filter(kind=StepKind.TOOL).order_by("seq"))
    asked = set(
        RunEvent.objects.filter(run=run, kind="approval_requested").values_list("step_seq", flat=True)
    )
    calls = tuple(
        check_rules.Call(
            seq=s.seq,
            tool=s.tool_name,
            arguments=s.arguments or {},
            sent=s.dispatched_at is not None,
            status=s.status,
            result=(
                s.result.get("structured") if s.result.get("structured") is not None else s.result.get("text")
            )
            if isinstance(s.result, dict)
            else None,
            approval_asked=s.seq in asked,
            denied=s.status == StepStatus.DENIED,
        )
        for s in steps
    )
    account = getattr(run, "budget", None)
    return check_rules.RunView(
        status=run.status,
        output=run.final_output or "",
        calls=calls,
        cost_micros=account.spent_micros + account.held_micros if account else 0,
        steps=run.step_count,
    )


def _judge(evaluation: Evaluation, case: Case, run: Run) -> CaseResult:
    view = view_of(run)
    verdicts = []
    for check in case.checks:
        kind = check_rules.kind_of(check)
        if kind in check_rules.GRADED:
            passed, detail, cost = grading.grade(
                evaluation=evaluation, check=check, case_input=case.input, output=view.output
            )
            verdicts.append(
                {
                    "check": check_rules.name_of(check),
                    "kind": kind,
                    "passed": passed,
                    "detail": detail,
                    "graded": True,
                    "cost_micros": cost,
                    "tags": check.get("tags", []),
                }
            )
            continue
        passed, detail = check_rules.judge(check, view)
        verdicts.append(
            {
                "check": check_rules.name_of(check),
                "kind": kind,
                "passed": passed,
                "detail": detail,
                "graded": False,
                "tags": check.get("tags", []),
            }
        )
    uncovered = list(
        RunEvent.objects.filter(run=run, kind="replay_uncovered")
        .order_by("seq")
        .values_list("message", flat=True)
    )
    ended = run.finished_at or timezone.now()
    latency = int((ended - (run.started_at or run.created_at)).total_seconds() * 1000)
    try:
        return CaseResult.objects.create(
            evaluation=evaluation,
            case=case,
            run=run,
            run_status=run.status,
            passed=all(v["passed"] for v in verdicts if not v["graded"]),
            checks=verdicts,
            uncovered=uncovered,
            cost_micros=view.cost_micros,
            steps=view.steps,
            latency_ms=max(latency, 0),
            error=run.error,
        )
    except IntegrityError:  # another worker judged this case of the evaluation first
        return CaseResult.objects.get(evaluation=evaluation, case=case)
