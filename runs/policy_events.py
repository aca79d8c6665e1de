"""Policy decisions of shadow-mode sets on the run's timeline (approvals/cedar.py evaluates them
at dispatch and leaves them on the step; only runs/ writes run events)."""

from __future__ import annotations

from runs.models import Run, Step
from runs.transitions import record_event

WOULD = {"deny": "would have denied", "approval": "would have required approval for"}


def record_shadow(run: Run, step: Step) -> None:
    verdict = getattr(step, "policy_verdict", None)
    for shadow in verdict.shadow if verdict is not None else ():
        if shadow.outcome == "allow":
            continue  # counted in ShadowDecision for the report; the timeline shows what differs
        by = f" ({', '.join(shadow.policies)})" if shadow.policies else ""
        record_event(
            run.pk,
            "policy_shadow",
            f"shadow policy set {shadow.policy_set} {WOULD[shadow.outcome]} step {step.seq} {step.tool_name}{by}",
            step_seq=step.seq,
            policy_set=shadow.policy_set,
            outcome=shadow.outcome,
            policies=list(shadow.policies),
        )


def decision_data(step: Step, *, denied: bool = False) -> dict:
    """What a step's event records of the Cedar decision behind it (approvals/cedar.py): the ids
    of the deciding policies and the version of the tenant's policies. `denied`: only a denial by
    a policy (a denial for another reason, a deactivated user say, names no policy)."""
    verdict = getattr(step, "policy_verdict", None)
    if verdict is None or verdict.policy_version is None:
        return {}
    if denied and verdict.denial is None:
        return {}
    return {"policies": list(verdict.deciding()), "policy_version": verdict.policy_version}
