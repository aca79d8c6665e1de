"""What an approval's request, decision or expiry does to its run: the step moves, a waiting run
resumes (approvals/services.py decides and moves the approval itself; it never writes run state)."""

from __future__ import annotations

import datetime as dt

from django.db import transaction
from django.utils import timezone

from agents.spec import spec_for
from approvals import reminders
from approvals import services as approvals
from approvals.models import Approval, ApprovalStatus
from core.digests import digest
from core.errors import Conflict, Forbidden
from runs.models import (
    Run,
    RunStatus,
    Step,
    StepStatus,
    StopReason,
)
from runs.queueing import enqueue
from runs.transitions import end_run, lock_run, record_event, transition_run, transition_step, write_step


def request_approval(run: Run, step: Step, decision) -> None:
    """Park a proposed call for a person's decision: the approval, its event, the step and the run wait."""
    approval = approvals.request_approval(run=run, step=step, decision=decision)
    needs = f" ({approval.required_approvals} approvers)" if approval.required_approvals > 1 else ""
    record_event(
        run.pk,
        "approval_requested",
        f"approval requested for {step.tool_name}{needs}: {decision.reason}",
        step_seq=step.seq,
        approval=str(approval.pk),
        expires_at=approval.expires_at.isoformat(),
        policies=approval.policy_ids,
        policy_version=approval.policy_set_version,
        required_approvals=approval.required_approvals,
    )


def decide_approval(*, approval_id, user, approve: bool, reason: str = "") -> Approval:
    """Approve or deny once; the step moves and a waiting run resumes. Repeating the same decision
    by the same person returns the approval again. Past its expiry the approval expires instead
    (that is committed) and the decision is refused."""
    try:
        with transaction.atomic():
            run = lock_run(approvals.run_of(approval_id, tenant_id=user.tenant_id))
            approval = approvals.locked(approval_id)
            verdict = approvals.decide(approval, user=user, approve=approve, reason=reason)
            # The API answers a repeat with what happened the first time (approvals/api.py).
            setattr(approval, "repeated", verdict == approvals.Verdict.REPEATED)  # noqa: B010
            setattr(approval, "verdict", verdict)  # noqa: B010
            if verdict == approvals.Verdict.DECIDED:
                _approval_decided(run, approval, user=user, approve=approve, reason=reason)
            elif verdict == approvals.Verdict.COUNTED:
                _approval_counted(run, approval, user=user, reason=reason)
            elif verdict == approvals.Verdict.EXPIRED:
                _approval_expired(run, approval)
    except Forbidden as exc:
        _escalate_if_above_limit(exc, approval_id, user)
        raise
    if verdict == approvals.Verdict.EXPIRED:
        raise Conflict("approval expired before it was decided", code="approval_expired")
    return approval


def _escalate_if_above_limit(exc: Forbidden, approval_id, user, *, correcting: bool = False) -> None:
    """Above this approver's limit (an approve_call policy refused them: `approval_refused`), the
    approval goes up to the group it escalates to now, rather than wait for its escalation time;
    the refusal is raised again naming that group."""
    if exc.code != "approval_refused":
        return
    escalated = escalate_now(approval_id, refused=user, correcting=correcting)
    if escalated:
        raise Forbidden(f"{exc.message}; escalated to {escalated}", code=exc.code) from None


def escalate_now(approval_id, *, refused, correcting: bool = False) -> str | None:
    """Escalate a pending approval at once, because an approver (or their correction of the call:
    `correcting`) was refused by their limit; the group's name, or None when it has no
    escalation group or was escalated already."""
    now = timezone.now()
    with transaction.atomic():
        run_id = Approval.objects.filter(pk=approval_id).values_list("run_id", flat=True).first()
        if run_id is None:
            return None
        lock_run(run_id)
        if not reminders.mark_escalated(approval_id, now=now):
            return None
        approval = Approval.objects.select_related("tool", "step", "escalate_to").get(pk=approval_id)
        assert approval.escalate_to is not None  # mark_escalated requires it
        group = approval.escalate_to.name
        names = [user.username for user in reminders.members(approval)]
        record_event(
            run_id,
            "approval_escalated",
            f"approval for {approval.tool.name} escalated to {group} ({', '.join(names) or 'no members'}): "
            + ("a correction " if correcting else "")
            + f"above the limit of {refused.username}",
            step_seq=approval.step.seq,
            approval=str(approval.pk),
            group=group,
            members=names,
            pending_seconds=int((now - approval.created_at).total_seconds()),
            above_limit_of=refused.username,
        )
    return group


def _approval_counted(run: Run, approval: Approval, *, user, reason: str) -> None:
    """One of several approvals the call needs: recorded; the step and the run keep waiting."""
    given = approvals.approvals_given(approval)
    record_event(
        run.pk,
        "approval_given",
        f"{approval.tool.name} approved by {user.username}: {given} of {approval.required_approvals} "
        "approvals" + (f" ({reason})" if reason else ""),
        step_seq=approval.step.seq,
        actor=user,
        approval=str(approval.pk),
        given=given,
        required=approval.required_approvals,
    )


def correct_approval(*, approval_id, user, arguments: dict, reason: str) -> Approval:
    """An approver corrects the call and approves the corrected one (approvals.services.correct
    checks it again); the step is sent with the corrected arguments, both versions on the timeline.
    A correction above the approver's limit escalates the approval at once, as an approval does."""
    try:
        return _correct(approval_id=approval_id, user=user, arguments=arguments, reason=reason)
    except Forbidden as exc:
        _escalate_if_above_limit(exc, approval_id, user, correcting=True)
        raise


def _correct(*, approval_id, user, arguments: dict, reason: str) -> Approval:
    with transaction.atomic():
        run = lock_run(approvals.run_of(approval_id, tenant_id=user.tenant_id))
        approval = approvals.locked(approval_id)
        changes = approvals.correct(approval, run=run, user=user, arguments=arguments, reason=reason)
        step = approval.step
        what = ", ".join(f"{name} {old!r} → {new!r}" for name, (old, new) in changes.items())
        write_step(step, arguments=arguments, args_digest=digest(arguments))
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
            content={"arguments": digest(arguments)},  # binds the corrected arguments into the chain
        )
        if approval.status == ApprovalStatus.APPROVED:
            _approval_decided(run, approval, user=user, approve=True, reason=reason)
        else:  # dual control: the corrected call waits for its other approvers
            _approval_counted(run, approval, user=user, reason=reason)
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
    if spec_for(run.version).on_approval_expired == "stop":
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


def expire_approval(*, approval_id, tenant_id) -> bool:
    """Expire one pending approval now, whatever its time (an evaluation case that lets it expire:
    evals/); False if it was decided or expired already."""
    with transaction.atomic():
        run = lock_run(approvals.run_of(approval_id, tenant_id=tenant_id))
        approval = approvals.locked(approval_id)
        if not approvals.expire(approval):
            return False
        _approval_expired(run, approval)
    return True


def remind_approvals(*, now: dt.datetime | None = None, limit: int = 500) -> dict[str, int]:
    """Remind of, then escalate, pending approvals past their times: each once, with its event.

    The event is what the notification scan sends (approval_reminder, approval_escalated); the
    guarded UPDATE under the run's lock (the order decide_approval takes) makes a second sweeper,
    or one that runs after a decision or the expiry, do nothing.
    """
    now = now or timezone.now()
    reminded = escalated = 0
    for approval_id, run_id in reminders.due_reminders(now=now, limit=limit):
        with transaction.atomic():
            lock_run(run_id)
            if not reminders.mark_reminded(approval_id, now=now):
                continue
            approval = Approval.objects.select_related("tool", "step").get(pk=approval_id)
            waited = _waited(approval, now)
            record_event(
                run_id,
                "approval_reminder",
                f"approval for {approval.tool.name} still pending after {waited}: approvers reminded",
                step_seq=approval.step.seq,
                approval=str(approval.pk),
                pending_seconds=int((now - approval.created_at).total_seconds()),
            )
            reminded += 1
    for approval_id, run_id in reminders.due_escalations(now=now, limit=limit):
        with transaction.atomic():
            lock_run(run_id)
            if not reminders.mark_escalated(approval_id, now=now):
                continue
            approval = Approval.objects.select_related("tool", "step", "escalate_to").get(pk=approval_id)
            assert approval.escalate_to is not None  # mark_escalated requires it
            group = approval.escalate_to.name
            names = [user.username for user in reminders.members(approval)]
            record_event(
                run_id,
                "approval_escalated",
                f"approval for {approval.tool.name} still pending after {_waited(approval, now)}: "
                f"escalated to {group} ({', '.join(names) or 'no members'})",
                step_seq=approval.step.seq,
                approval=str(approval.pk),
                group=group,
                members=names,
                pending_seconds=int((now - approval.created_at).total_seconds()),
            )
            escalated += 1
    return {"reminded": reminded, "escalated": escalated}


def _waited(approval: Approval, now: dt.datetime) -> str:
    seconds = int((now - approval.created_at).total_seconds())
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return " ".join(f"{n}{unit}" for n, unit in ((hours, "h"), (minutes, "m"), (seconds, "s")) if n) or "0s"
