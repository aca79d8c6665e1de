"""Approvals bound to the exact call: request, decide, verify, consume, void, expire.

These functions decide and move approvals; what a decision does to the run and its step (events,
resuming the run) is written by runs/transitions.py, which calls them under the run's lock.
"""

from __future__ import annotations

import datetime as dt
import enum
import uuid

import jsonschema
from django.utils import dateformat, timezone

from approvals import calls, cedar, policy_sets, reminders, tool_rules
from approvals.cedar import Decision
from approvals.models import APPROVAL_TRANSITIONS, Approval, ApprovalStatus, ApprovalVote
from core.digests import digest
from core.errors import Conflict, DomainError, Forbidden, IllegalTransition, NotFound
from runs.models import Run, Step
from tenants import permissions
from tenants.permissions import holds
from tools.models import Tool
from vault.fields import seal, sealed_names


def effective_policy(run: Run, tool: Tool) -> str:
    """The tool's approval rule and the version's override, which can only add to it."""
    return tool_rules.effective(*calls.approval_rules(run, tool))


def decision_for(run: Run, tool: Tool, arguments: dict, *, step: Step | None = None) -> Decision:
    """Whether the call needs approval: the tenant's @approval policies, and the tool's approval
    rule with the version's override (approvals/cedar.py). With the claim's step, its verdict from
    check_dispatch is used and a call that needs no approval is counted into the day's totals
    (approvals/calls.py)."""
    verdict = getattr(step, "policy_verdict", None)
    if verdict is None:
        request = calls.request_for(run, tool, arguments, user=run.created_by)
        verdict = cedar.evaluate(
            request, rules=calls.approval_rules(run, tool), policies=calls.policies_of(run)
        )
    if not verdict.approval.required and step is not None:
        calls.count_call(step)
    return verdict.approval


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
    return permissions.holds(user, "approve_tool", Tool, tool.pk)


def can_decide(user, approval: Approval) -> bool:
    """approve_tool on the tool, or membership of the group the approval was escalated to."""
    if not user.is_active or user.tenant_id != approval.tenant_id:
        return False
    return can_approve(user, approval.tool) or reminders.escalated_member(user, approval)


SEALED = frozenset(sealed_names(Approval))  # content: sealed at rest (vault/fields.py)


def _transition(approval: Approval, to: str, *, where: dict | None = None, **fields) -> bool:
    """Move the approval from the status it was read in to `to` (APPROVAL_TRANSITIONS), or raise.

    One guarded UPDATE (the status it was read in, and `where`); False when someone moved it first.
    """
    if to not in APPROVAL_TRANSITIONS.get(approval.status, set()):
        raise IllegalTransition("approval", approval.status, to)
    updated = Approval.objects.filter(pk=approval.pk, status=approval.status, **(where or {})).update(
        status=to, **_sealed(approval, fields)
    )
    if updated:
        approval.status = to
        for name, value in fields.items():
            setattr(approval, name, value)
    return bool(updated)


def _sealed(approval: Approval, fields: dict) -> dict:
    """`fields` with the content columns sealed with the run's key, as an UPDATE writes them."""
    return fields | {
        name: seal(Approval, name, approval.run_id, value, tenant=approval.tenant_id)
        for name, value in fields.items()
        if name in SEALED
    }


def request_approval(*, run: Run, step: Step, decision: Decision) -> Approval:
    """The pending approval for this exact call (the caller records the event and parks the step):
    the policies that asked for it, at the version of the tenant's policies the claim decided with,
    and how many distinct people must approve."""
    tool = _tool_of(step)
    verdict = getattr(step, "policy_verdict", None)
    ttl = tool.approval_ttl_seconds or run.tenant.approval_ttl_seconds
    now = timezone.now()
    expires_at = now + dt.timedelta(seconds=ttl)
    return Approval.objects.create(
        tenant_id=run.tenant_id,
        run=run,
        step=step,
        tool=tool,
        arguments=step.arguments,
        digest=call_digest(
            tool=tool,
            arguments=step.arguments or {},
            run_id=run.pk,
            user_id=run.created_by_id,
            policy_version=tool.policy_version,
        ),
        policy=effective_policy(run, tool),
        policy_version=tool.policy_version,
        reason=decision.reason,
        policy_ids=list(decision.policies),
        policy_texts=_texts_of(run.tenant_id, decision),
        policy_set_version=verdict.policy_version if verdict is not None else None,
        required_approvals=decision.approvers,
        requested_by_id=run.created_by_id,
        expires_at=expires_at,
        **reminders.times_for(reminders.schedule_for(tool), now=now, expires_at=expires_at),
    )


def _texts_of(tenant_id: int, decision: Decision) -> list[str]:
    """Each deciding policy's text as the tenant wrote it; Cedar's rendering for a tool's rule."""
    written = policy_sets.sources_of(tenant_id, list(decision.policies))
    rendered = dict(zip(decision.policies, decision.texts, strict=False))
    return [written.get(pid) or rendered.get(pid, "") for pid in decision.policies]


def run_of(approval_id, *, tenant_id):
    """The id of the run an approval of this tenant belongs to (its lock is taken first)."""
    try:
        approval_id = uuid.UUID(str(approval_id))
    except ValueError:
        raise NotFound("approval") from None
    run_id = (
        Approval.objects.filter(pk=approval_id, tenant_id=tenant_id).values_list("run_id", flat=True).first()
    )
    if run_id is None:
        raise NotFound("approval")
    return run_id


def locked(approval_id) -> Approval:
    """The approval row locked FOR UPDATE, with its tool and step (after its run's lock)."""
    return Approval.objects.select_for_update().select_related("tool", "step").get(pk=approval_id)


class Verdict(enum.Enum):
    DECIDED = "decided"  # moved to approved or denied now
    COUNTED = "counted"  # one more distinct approval counted; more are needed (dual control)
    REPEATED = "repeated"  # the same person repeated the same decision: nothing to do
    EXPIRED = "expired"  # its time ran out undecided: moved to expired now


def decide(approval: Approval, *, user, approve: bool, reason: str = "") -> Verdict:
    """Approve or deny a locked approval once, or refuse the decider (Forbidden, Conflict).

    Dual control: an approval that requires N approvers moves to approved with the Nth distinct
    person's approval; each one before it is a vote (COUNTED), and one denial denies. The run's
    lock, taken before the approval's, puts two approvers deciding at once one after the other.
    """
    target = ApprovalStatus.APPROVED if approve else ApprovalStatus.DENIED
    if approval.requested_by_id == user.pk:
        raise Forbidden("you may not decide your own request", code="self_approval")
    if not can_decide(user, approval):
        raise Forbidden(f"you do not hold approve_tool on {approval.tool.name}", code="not_an_approver")
    # A vote counts for the call it approved: one given before a correction is no vote for it.
    voted = (
        approve and ApprovalVote.objects.filter(approval=approval, user=user, digest=approval.digest).exists()
    )
    repeated = (approval.decided_by_id == user.pk or voted) and (
        approval.status == target
        or (approve and approval.status in (ApprovalStatus.CONSUMED, ApprovalStatus.PENDING))
    )
    if repeated:
        return Verdict.REPEATED
    if approval.status != ApprovalStatus.PENDING:
        said = f" ({first_decision(approval)})" if approval.decided_by_id else ""
        raise Conflict(f"approval is already {approval.status}{said}", code=f"approval_{approval.status}")
    if approval.expires_at <= timezone.now():
        _transition(approval, ApprovalStatus.EXPIRED)
        return Verdict.EXPIRED
    # After the checks above: a decision from a stale tab hears what happened, not "reason missing".
    refuse_without_reason(approval, approve=approve, reason=reason)
    if not approve:
        _transition(approval, target, decided_by=user, decision_reason=reason, decided_at=timezone.now())
        return Verdict.DECIDED
    refuse_approver(approval, approver=user, arguments=approval.arguments)
    ApprovalVote.objects.filter(approval=approval, user=user).delete()  # of a call since corrected
    ApprovalVote.objects.create(approval=approval, user=user, digest=approval.digest, reason=reason)
    if approvals_given(approval) < approval.required_approvals:
        return Verdict.COUNTED
    _transition(approval, target, decided_by=user, decision_reason=reason, decided_at=timezone.now())
    return Verdict.DECIDED


def reason_required(approval: Approval, *, approve: bool) -> bool:
    """A denial always needs a reason (the model and the requester are told it); an approval
    when the tenant's configuration says so (`approval_reason_required`)."""
    return not approve or approval.tenant.approval_reason_required


def refuse_without_reason(approval: Approval, *, approve: bool, reason: str) -> None:
    if reason_required(approval, approve=approve) and not reason.strip():
        what = "an approval" if approve else "a denial"
        raise DomainError(f"{what} needs a reason", fields={"reason": ["required"]})


def approvals_given(approval: Approval) -> int:
    """Distinct people who approved the call the approval now covers."""
    return ApprovalVote.objects.filter(approval=approval, digest=approval.digest).count()


def votes(approval: Approval) -> list[ApprovalVote]:
    """The approvals given to the call the approval now covers, first first, with their people."""
    return list(ApprovalVote.objects.filter(approval=approval, digest=approval.digest).select_related("user"))


def refuse_approver(approval: Approval, *, approver, arguments: dict) -> None:
    """Raise Forbidden when the tenant's policies forbid this approver approving this call
    (Action::"approve_call:<tool>": "supervisors approve refunds up to INR 25,000")."""
    run = approval.run
    denial = cedar.evaluate_approval(
        tenant_id=approval.tenant_id,
        approver=approver,
        approver_groups=calls.groups_of(approver),
        requester=approval.requested_by,
        requester_groups=calls.groups_of(approval.requested_by),
        tool=approval.tool,
        arguments=arguments,
        agent_name=run.agent.name,
        version_number=run.version.number,
    )
    if denial is not None:
        raise Forbidden(f"you may not approve this call: {denial}", code="approval_refused")


def _tool_of(step: Step) -> Tool:
    if step.tool is None:
        raise ValueError(f"step {step.seq} of run {step.run_id} calls no tool: nothing to approve")
    return step.tool


MOMENT = "j M Y, H:i"  # the admin's one format for a moment (core/formats): 3 Dec 2026, 14:26


def first_decision(approval: Approval) -> str:
    """What a repeated decision is answered with: "already approved by ravi at 13:44; nothing changed"
    (the time in the tenant's zone)."""
    if approval.status == ApprovalStatus.PENDING:
        given = votes(approval)
        names = ", ".join(vote.user.username for vote in given) or "nobody"
        return (
            f"{len(given)} of {approval.required_approvals} approvals given ({names}); "
            "waiting for another approver; nothing changed"
        )
    verb = "denied" if approval.status == ApprovalStatus.DENIED else "approved"
    decided = approval.decided_at
    at = dateformat.format(decided.astimezone(approval.tenant.zone), MOMENT) if decided else "?"
    who = approval.decided_by.username if approval.decided_by else "?"
    used = "; the call was dispatched" if approval.status == ApprovalStatus.CONSUMED else ""
    return f"already {verb} by {who} at {at}{used}; nothing changed"


def correct(approval: Approval, *, run: Run, user, arguments: dict, reason: str) -> dict:
    """An approver's corrected call, checked again as a new one and approved; the changes made.

    The corrected call must match the tool's schema, the requester must still hold use_tool, and
    the tenant's policies must allow it with the requester as principal and the approver as
    `context.editor` (so a rule can refuse an edit above the approver's own limit), read under the
    day's totals lock like any call; the budget is reserved at dispatch as for any call. The
    approval then binds to the corrected call's digest.
    """
    if not reason.strip():
        raise DomainError("a correction needs a reason", fields={"reason": ["required"]})
    if not isinstance(arguments, dict):
        raise DomainError("arguments must be an object", fields={"arguments": ["must be an object"]})
    if approval.requested_by_id == user.pk:
        raise Forbidden("you may not correct your own request", code="self_approval")
    tool = approval.tool
    if not can_decide(user, approval):
        raise Forbidden(f"you do not hold approve_tool on {tool.name}", code="not_an_approver")
    if approval.status != ApprovalStatus.PENDING:
        raise Conflict(f"approval is already {approval.status}", code=f"approval_{approval.status}")
    if approval.expires_at <= timezone.now():
        raise Conflict("approval expired before it was corrected", code="approval_expired")
    changes = {
        name: (approval.arguments.get(name), arguments.get(name))
        for name in sorted(set(approval.arguments) | set(arguments))
        if approval.arguments.get(name) != arguments.get(name)
    }
    if not changes:
        raise DomainError("the corrected call is the same call", fields={"arguments": ["nothing changed"]})
    schema = tool.input_schema or {"type": "object"}
    error = jsonschema.exceptions.best_match(
        jsonschema.validators.validator_for(schema)(schema).iter_errors(arguments)
    )
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(arguments)"
        raise DomainError(
            f"arguments invalid at {where}: {error.message}", fields={"arguments": [error.message]}
        )
    requester = run.created_by
    may_use = holds(requester, "use_tool", Tool, tool.pk)
    if not requester.is_active or not may_use:
        raise Forbidden(f"{requester.username} may no longer use {tool.name}", code="correction_refused")
    step = approval.step
    step.tool = tool
    denial = calls.check_correction(run, step, requester=requester, editor=user, arguments=arguments)
    if denial:
        raise Forbidden(f"the corrected call is refused: {denial}", code="correction_refused")
    refuse_approver(approval, approver=user, arguments=arguments)
    now = timezone.now()
    corrected = {
        # The model's proposal stays, however many corrections follow it.
        "original_arguments": approval.original_arguments or approval.arguments,
        "arguments": arguments,
        "digest": call_digest(
            tool=tool,
            arguments=arguments,
            run_id=run.pk,
            user_id=approval.requested_by_id,
            policy_version=tool.policy_version,
        ),
        "corrected_by": user,
        "correction_reason": reason,
    }
    # The corrector approves the corrected call; earlier approvals were of another call, and
    # no longer count towards it (votes are per digest).
    ApprovalVote.objects.filter(approval=approval, user=user).delete()
    ApprovalVote.objects.create(approval=approval, user=user, digest=corrected["digest"], reason=reason)
    given = ApprovalVote.objects.filter(approval=approval, digest=corrected["digest"]).count()
    if given < approval.required_approvals:
        if not Approval.objects.filter(pk=approval.pk, status=ApprovalStatus.PENDING).update(
            **_sealed(approval, corrected)
        ):
            raise Conflict("approval was decided meanwhile", code="approval_decided")
        for name, value in corrected.items():
            setattr(approval, name, value)
        return changes
    _transition(
        approval,
        ApprovalStatus.APPROVED,
        **corrected,
        decided_by=user,
        decision_reason=reason,
        decided_at=now,
    )
    return changes


def _expected_digest(step: Step, approval: Approval) -> str:
    tool = _tool_of(step)
    return call_digest(
        tool=tool,
        arguments=step.arguments or {},
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
    calls.count_call(step)  # it is dispatched next, in this transaction
    return None


def consume(step: Step) -> bool:
    """Use the approval once, atomically, for exactly this call; False if used, withdrawn or not covering it.

    The digest is checked again here because the step is re-read between the claim (which ran
    verify_for_dispatch) and this update: what is consumed is what is dispatched.
    """
    approval = Approval.objects.filter(step=step).only("status", "requested_by").first()
    if approval is None or approval.status != ApprovalStatus.APPROVED:
        return False
    return _transition(
        approval,
        ApprovalStatus.CONSUMED,
        where={"digest": _expected_digest(step, approval)},
        consumed_at=timezone.now(),
    )


def void_for_step(step: Step, *, reason: str) -> bool:
    """Withdraw the step's open approval; True if there was one (the caller records the event)."""
    # Read again when a decision moved it between the read and the update (pending -> approved):
    # an approval moves forward only, so this ends after as many tries as it has open statuses.
    for _ in range(len(APPROVAL_TRANSITIONS)):
        approval = Approval.objects.filter(step=step).only("status").first()
        if approval is None or ApprovalStatus.VOIDED not in APPROVAL_TRANSITIONS.get(approval.status, set()):
            return False
        if _transition(approval, ApprovalStatus.VOIDED, void_reason=reason):
            return True
    return False


def open_approval_steps(run: Run) -> list[tuple]:
    """(step id, step seq) of the run's approvals that could still be used."""
    # The step's run named as well as the approval's: steps are partitioned by their run, and the
    # run's id written into the statement lets PostgreSQL plan one month's partition, not every one.
    return list(
        Approval.objects.filter(
            run=run, step__run_id=run.pk, status__in=[ApprovalStatus.PENDING, ApprovalStatus.APPROVED]
        ).values_list("step_id", "step__seq")
    )


def due_for_expiry(*, now: dt.datetime, limit: int) -> list[tuple]:
    """(approval id, run id) of pending approvals whose time is up."""
    return list(
        Approval.objects.filter(status=ApprovalStatus.PENDING, expires_at__lte=now).values_list(
            "pk", "run_id"
        )[:limit]
    )


def expire(approval: Approval) -> bool:
    """Move a locked approval that is still pending to expired; False if it was decided meanwhile."""
    if approval.status != ApprovalStatus.PENDING:
        return False
    _transition(approval, ApprovalStatus.EXPIRED)
    return True
