"""What a tool call gives the model: its result redacted, stored in full, and shown capped."""

from __future__ import annotations

from django.conf import settings

from approvals.models import Approval
from runs.models import Run, Step
from tenants.crypto import redact, redact_obj
from tenants.secrets import known_secrets
from tools.types import ToolResult


def shape_result(
    run: Run, step: Step, result: ToolResult, *, may_be_corrected: bool = True
) -> tuple[dict, str]:
    """Redact, store in full, and give the model a capped view with a clear marker (after what an
    approver corrected, when the call went through an approval: `may_be_corrected`)."""
    # The generation as the record read it with the run's lock (runs.transitions.lock_run).
    secrets = known_secrets(run.tenant_id, generation=run.tenant.secrets_generation)
    text = redact(result.text, secrets)
    stored = {"text": text, "structured": redact_obj(result.structured, secrets), "is_error": result.is_error}
    limit = settings.TOOL_RESULT_MODEL_CHARS
    observation = text
    if len(text) > limit:
        observation = (
            text[:limit] + f"\n[truncated by the platform: showing {limit} of {len(text)} characters; "
            "the full result is stored]"
        )
    if result.is_error:
        observation = f"ERROR: {observation}"
    return stored, (correction_note(step) if may_be_corrected else "") + observation


def correction_note(step: Step) -> str:
    """The model is told what an approver changed in its call, and by whom, before the result."""
    if step.kind != "tool":
        return ""
    corrected = (
        Approval.objects.filter(step_id=step.pk, corrected_by__isnull=False)
        .values_list("original_arguments", "arguments", "corrected_by__username", "correction_reason")
        .first()
    )
    if corrected is None:
        return ""
    before, after, who, reason = corrected
    before, after = before or {}, after or {}
    changes = "; ".join(
        f"{name}: {before.get(name)!r} -> {after.get(name)!r}"
        for name in sorted(set(before) | set(after))
        if before.get(name) != after.get(name)
    )
    return (
        f"[platform] Before this call was sent, approver {who} corrected it ({changes}); reason: "
        f"{reason}. It was made with the corrected arguments.\n"
    )


def actual_price(step: Step, result: ToolResult | None) -> int:
    """What a succeeded call is settled at: its measured cost where the tool reports one
    (run_python: CPU seconds and GiB-seconds), else the tool's price."""
    if result is not None and result.cost_micros is not None:
        return result.cost_micros
    assert step.tool is not None  # a tool step that got as far as a result has its tool
    return step.tool.price_micros
