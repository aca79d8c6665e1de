"""A run as a person reads it: its title, its status in words, its step and event counts.

One place for these so the list, the run page, the inbox and the approval page say the same.
"""

from __future__ import annotations

import re

from runs.models import RunStatus, StepStatus

STATUS_LABELS: dict[str, str] = {
    RunStatus.QUEUED: "queued",
    RunStatus.RUNNING: "running",
    RunStatus.WAITING_APPROVAL: "waiting for approval",
    RunStatus.WAITING_BUDGET: "waiting for budget",
    RunStatus.WAITING_SETTLE: "waiting for the provider",
    RunStatus.NEEDS_ATTENTION: "needs attention",
    RunStatus.PAUSED: "paused",
    RunStatus.SUCCEEDED: "succeeded",
    RunStatus.FAILED: "failed",
    RunStatus.CANCELLED: "cancelled",
    RunStatus.STOPPED: "stopped",
    StepStatus.PROPOSED: "proposed",
    StepStatus.DENIED: "denied",
    StepStatus.AWAITING_APPROVAL: "awaiting approval",
    StepStatus.APPROVED: "approved",
    StepStatus.REJECTED: "rejected",
    StepStatus.EXPIRED: "approval expired",
    StepStatus.DISPATCHING: "in flight",
    StepStatus.OUTCOME_UNKNOWN: "outcome unknown",
    StepStatus.RESOLVED_SUCCEEDED: "resolved: succeeded",
    StepStatus.RESOLVED_FAILED: "resolved: failed",
    StepStatus.RETRIED: "retrying",
    StepStatus.SKIPPED: "skipped",
}


def status_label(status: str) -> str:
    return STATUS_LABELS.get(status, status.replace("_", " "))


# Input keys whose value names the case a run works on, best first; otherwise the first short text.
KEY_NAMES = re.compile(r"(^|_)(id|ref|reference|number|case|ticket|order|transaction)$", re.IGNORECASE)
TITLE_VALUE_MAX = 40


def key_value(run_input) -> str:
    """The input's key value (`TXN-1001`) for a run's title; "" when nothing fits."""
    if isinstance(run_input, str):
        return run_input[:TITLE_VALUE_MAX]
    if not isinstance(run_input, dict):
        return ""
    scalars = [(k, v) for k, v in run_input.items() if isinstance(v, str | int) and not isinstance(v, bool)]
    for key, value in scalars:
        if KEY_NAMES.search(str(key)):
            return str(value)[:TITLE_VALUE_MAX]
    for _, value in scalars:
        if isinstance(value, str) and 0 < len(value) <= TITLE_VALUE_MAX:
            return value
    return ""


def run_title(run) -> str:
    """`disputes · TXN-1001 · arjun`: the agent, the input's key value, the creator."""
    parts = [run.agent.name, key_value(run.input), run.created_by.username]
    return " · ".join(part for part in parts if part)
