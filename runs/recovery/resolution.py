"""People resolve unknown outcomes: it happened (with a result), it did not, or retry."""

from __future__ import annotations

import json

from django.db import transaction
from django.utils import timezone

from approvals.services import can_approve
from core.errors import Conflict, DomainError, Forbidden, NotFound
from runs.engine import writer
from runs.engine.dispatch import close_tool_holds
from runs.models import Step, StepKind, StepStatus
from runs.transitions import lock_run, record_event, transition_step
from tools.models import EffectClass

OUTCOMES = ("succeeded", "failed", "retry")


def resolve_step(
    *, run_id, seq: int, user, outcome: str, reason: str, result=None, override: bool = False
) -> Step:
    if outcome not in OUTCOMES:
        raise DomainError("unknown outcome", fields={"outcome": [f"must be one of {', '.join(OUTCOMES)}"]})
    if not reason:
        raise DomainError("a reason is required", fields={"reason": ["This field is required."]})
    with transaction.atomic():
        run = lock_run(run_id)
        step = (
            Step.objects.select_for_update(of=("self",))
            .select_related("tool")
            .filter(run=run, seq=seq)
            .first()
        )
        if step is None or step.kind != StepKind.TOOL or step.tool is None:
            raise NotFound(f"tool step {seq}")
        tool = step.tool
        if not can_approve(user, tool):
            raise Forbidden(f"resolving needs approve_tool on {step.tool_name}", code="not_an_approver")
        if step.status != StepStatus.OUTCOME_UNKNOWN:
            raise Conflict(f"step {seq} is {step.status}, not outcome_unknown", code="step_not_unknown")
        if outcome == "retry" and tool.effect_class == EffectClass.UNSAFE and not override:
            raise DomainError(
                f"{step.tool_name} is unsafe: retrying may repeat its effect; pass override=true "
                "to retry anyway",
                code="retry_not_allowed",
                status=409,
            )
        now = timezone.now()
        # The call's own duration ends when its outcome became unknown (finished_at); the human
        # decision is kept apart, with its time and reason.
        resolution: dict = {"resolved_at": now, "resolution": f"{outcome} by {user.username}: {reason}"}
        if outcome == "succeeded":
            text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
            transition_step(
                step,
                StepStatus.RESOLVED_SUCCEEDED,
                actor=user,
                error="",
                **resolution,
                result={
                    "text": text,
                    "structured": result if not isinstance(result, str) else None,
                    "is_error": False,
                    "resolved_by": user.username,
                },
                observation=text or "(the call succeeded; no result was recorded)",
            )
        elif outcome == "failed":
            transition_step(
                step,
                StepStatus.RESOLVED_FAILED,
                actor=user,
                error="",
                **resolution,
                observation="ERROR: the call did not take effect (confirmed by a supervisor).",
            )
        else:
            transition_step(step, StepStatus.RETRIED, actor=user, next_attempt_at=None, **resolution)
        if outcome != "retry":
            # Its held reservation: charged at the tool's price if it happened, given back if not
            # (a retry leaves it held: the next attempt's outcome decides).
            step_id, price = step.pk, tool.price_micros
            transaction.on_commit(
                lambda: close_tool_holds(step_id, happened=outcome == "succeeded", price_micros=price),
                robust=True,
            )
        record_event(
            run.pk,
            "resolved",
            f"step {seq} {step.tool_name} resolved as {outcome} by {user.username}: "
            f"{reason}" + (" (override of the unsafe-retry rule)" if override else ""),
            step_seq=seq,
            actor=user,
            outcome=outcome,
            reason=reason,
            override=override,
        )
        writer.resume_if_resolved(run, actor=user, message="resumed: unknown outcome resolved")
    return step
