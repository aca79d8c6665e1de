"""Approvals bound to the exact call: request, decide, verify, consume, void, expire."""

from __future__ import annotations

import datetime as dt
import uuid

from django.db import transaction
from django.utils import timezone
from guardian.shortcuts import get_objects_for_user

from agentplatform.errors import Conflict, Forbidden, NotFound
from approvals.models import APPROVAL_TRANSITIONS, Approval, ApprovalStatus
from approvals.policy import Decision, parse_policy, stricter
from runs.lifecycle import (
    IllegalTransition,
    digest,
    end_run,
    enqueue,
    lock_run,
    record_event,
    transition_run,
    transition_step,
)
from runs.models import Run, RunStatus, Step, StepStatus, StopReason
from tools.models import Tool


def effective_policy(run: Run, tool: Tool) -> str:
    """The tool's policy, made stricter (never looser) by the agent version."""
    override = (run.version.spec.get("approval_overrides") or {}).get(tool.name)
    return stricter(tool.approval_policy, override)


def decision_for(run: Run, tool: Tool, arguments: dict) -> Decision:
    return parse_policy(effective_policy(run, tool)).evaluate(arguments)


def call_digest(*, tool: Tool, arguments: dict, run_id, user_id, policy_version: int) -> str:
    return digest(
        {
            "tool": tool.name,
            "tool_id": tool.pk,
            "arguments": arguments,
            "run": str(run_id),
            "user": user_id,
            "policy_version": policy_version,
        }
    )


def can_approve(user, tool: Tool) -> bool:
    if not user.is_active or user.tenant_id != tool.tenant_id:
        return False
    return get_objects_for_user(
        user,
        "tools.approve_tool",
        klass=Tool.objects.filter(pk=tool.pk),
        with_superuser=False,
        accept_global_perms=False,
    ).exists()


def _transition(approval: Approval, to: str, **fields) -> bool:
    if to not in APPROVAL_TRANSITIONS.get(approval.status, set()):
        raise IllegalTransition("approval", approval.status, to)
    updated = Approval.objects.filter(pk=approval.pk, status=approval.status).update(status=to, **fields)
    if updated:
        approval.status = to
        for name, value in fields.items():
            setattr(approval, name, value)
    return bool(updated)


def request_approval(*, run: Run, step: Step, decision: Decision) -> Approval:
    tool = step.tool
    ttl = tool.approval_ttl_seconds or run.tenant.approval_ttl_seconds
    approval = Approval.objects.create(
        tenant_id=run.tenant_id,
        run=run,
        step=step,
        tool=tool,
        arguments=step.arguments,
        digest=call_digest(
            tool=tool,
            arguments=step.arguments,
            run_id=run.pk,
            user_id=run.created_by_id,
            policy_version=tool.policy_version,
        ),
        policy=effective_policy(run, tool),
        policy_version=tool.policy_version,
        reason=decision.reason,
        requested_by_id=run.created_by_id,
        expires_at=timezone.now() + dt.timedelta(seconds=ttl),
    )
    record_event(
        run.pk,
        "approval_requested",
        f"approval requested for {tool.name}: {decision.reason}",
        step_seq=step.seq,
        approval=str(approval.pk),
        expires_at=approval.expires_at.isoformat(),
    )
    return approval


def decide(*, approval_id, user, approve: bool, reason: str = "") -> Approval:
    """Approve or deny once. Repeating the same decision by the same person returns it again."""
    target = ApprovalStatus.APPROVED if approve else ApprovalStatus.DENIED
    try:
        approval_id = uuid.UUID(str(approval_id))
    except ValueError:
        raise NotFound("approval") from None
    expired = False
    with transaction.atomic():
        run_id = (
            Approval.objects.filter(pk=approval_id, tenant_id=user.tenant_id)
            .values_list("run_id", flat=True)
            .first()
        )
        if run_id is None:
            raise NotFound("approval")
        run = lock_run(run_id)
        approval = Approval.objects.select_for_update().select_related("tool", "step").get(pk=approval_id)
        if approval.requested_by_id == user.pk:
            raise Forbidden("you may not decide your own request", code="self_approval")
        if not can_approve(user, approval.tool):
            raise Forbidden(f"you do not hold approve_tool on {approval.tool.name}", code="not_an_approver")
        repeated = approval.decided_by_id == user.pk and (
            approval.status == target or (approve and approval.status == ApprovalStatus.CONSUMED)
        )
        if repeated:
            return approval
        if approval.status != ApprovalStatus.PENDING:
            raise Conflict(f"approval is already {approval.status}", code=f"approval_{approval.status}")
        if approval.expires_at <= timezone.now():
            _expire(run, approval)
            expired = True
        else:
            _apply_decision(run, approval, user=user, approve=approve, reason=reason)
    if expired:
        raise Conflict("approval expired before it was decided", code="approval_expired")
    return approval


def _apply_decision(run: Run, approval: Approval, *, user, approve: bool, reason: str) -> None:
    now = timezone.now()
    target = ApprovalStatus.APPROVED if approve else ApprovalStatus.DENIED
    _transition(approval, target, decided_by=user, decision_reason=reason, decided_at=now)
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
            finished_at=now,
            error=reason,
            observation=f"ERROR: a supervisor denied this call{': ' + reason if reason else ''}. "
            "Explain this to the user or choose another path.",
        )
    if run.status == RunStatus.WAITING_APPROVAL:
        transition_run(run, RunStatus.RUNNING, actor=user, message=f"resumed: approval {verb}")
        enqueue(run.pk)


def _expected_digest(step: Step, approval: Approval) -> str:
    tool = step.tool
    return call_digest(
        tool=tool,
        arguments=step.arguments,
        run_id=step.run_id,
        user_id=approval.requested_by_id,
        policy_version=tool.policy_version,
    )


def verify_for_dispatch(step: Step) -> str | None:
    """Why an approved step must not be dispatched, or None."""
    approval = Approval.objects.filter(step=step).select_related("tool").first()
    if approval is None or approval.status != ApprovalStatus.APPROVED:
        return f"approval is {approval.status if approval else 'missing'}"
    if _expected_digest(step, approval) != approval.digest:
        return "the approval does not cover this exact call (arguments, tool or policy changed)"
    return None


def consume(step: Step) -> bool:
    """Use the approval once, atomically, for exactly this call; False if used, withdrawn or not covering it.

    The digest is checked again here because the step is re-read between the claim (which ran
    verify_for_dispatch) and this update: what is consumed is what is dispatched.
    """
    approval = Approval.objects.filter(step=step).only("requested_by").first()
    if approval is None:
        return False
    return bool(
        Approval.objects.filter(
            pk=approval.pk, status=ApprovalStatus.APPROVED, digest=_expected_digest(step, approval)
        ).update(status=ApprovalStatus.CONSUMED, consumed_at=timezone.now())
    )


def void_for_step(step: Step, *, reason: str) -> None:
    if Approval.objects.filter(
        step=step, status__in=[ApprovalStatus.PENDING, ApprovalStatus.APPROVED]
    ).update(status=ApprovalStatus.VOIDED, void_reason=reason):
        record_event(
            step.run_id,
            "approval_voided",
            f"approval for step {step.seq} voided: {reason}",
            step_seq=step.seq,
            reason=reason,
        )


def void_open_approvals(run: Run, *, reason: str) -> None:
    for step_id, seq in Approval.objects.filter(
        run=run, status__in=[ApprovalStatus.PENDING, ApprovalStatus.APPROVED]
    ).values_list("step_id", "step__seq"):
        void_for_step(Step(pk=step_id, seq=seq, run_id=run.pk), reason=reason)


def _expire(run: Run, approval: Approval) -> None:
    _transition(approval, ApprovalStatus.EXPIRED)
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


def expire_due(*, now: dt.datetime | None = None, limit: int = 500) -> int:
    now = now or timezone.now()
    count = 0
    for approval_id, run_id in Approval.objects.filter(
        status=ApprovalStatus.PENDING, expires_at__lte=now
    ).values_list("pk", "run_id")[:limit]:
        with transaction.atomic():
            run = lock_run(run_id)
            approval = Approval.objects.select_for_update().select_related("tool", "step").get(pk=approval_id)
            if approval.status == ApprovalStatus.PENDING:
                _expire(run, approval)
                count += 1
    return count
