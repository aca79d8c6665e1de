"""No-progress detection: one platform warning to the model, then `loop_detected`."""
from __future__ import annotations

from runs.models import Run, Step, StepKind, StepStatus, StopReason, RunStatus
from runs.services import bump_counters, end_run, record_event

DEFAULTS = {"max_repeats": 3, "max_empty_results": 3, "alternation_cycles": 2}
EMPTY = {"", "[]", "{}", "null", "none", "no results", "0 results"}
WARNING = ("[platform] You are not making progress ({pattern}). Do not repeat this call; change your "
           "approach or give your final answer.")


def _thresholds(run: Run) -> dict:
    return {**DEFAULTS, **(run.version.spec.get("loop") or {})}


def _is_empty(step: Step) -> bool:
    text = (step.result or {}).get("text", "") if isinstance(step.result, dict) else ""
    return text.strip().lower() in EMPTY


def detect(run: Run, steps: list[Step]) -> str | None:
    limits = _thresholds(run)
    calls = [s for s in steps if s.kind == StepKind.TOOL and s.status in
             (StepStatus.SUCCEEDED, StepStatus.FAILED, StepStatus.DENIED)]
    if not calls:
        return None
    last = calls[-1]
    repeats = sum(1 for s in calls if s.tool_id == last.tool_id and s.args_digest == last.args_digest)
    if repeats >= limits["max_repeats"]:
        return f"the same call {last.tool_name} was made {repeats} times"
    cycles = limits["alternation_cycles"]
    tail = [s.args_digest + str(s.tool_id) for s in calls[-2 * cycles:]]
    if len(tail) == 2 * cycles and tail[0] != tail[1] and all(
            tail[i] == tail[i % 2] for i in range(len(tail))):
        return "alternating between the same two calls"
    empties = calls[-limits["max_empty_results"]:]
    if len(empties) == limits["max_empty_results"] and all(
            s.status == StepStatus.SUCCEEDED and _is_empty(s) for s in empties):
        return f"{len(empties)} empty results in a row"
    return None


def check(run: Run, steps: list[Step], step: Step) -> bool:
    """After a tool step: warn once, stop the second time. True when the run was stopped."""
    pattern = detect(run, steps)
    if pattern is None:
        return False
    if run.loop_warnings == 0:
        warning = WARNING.format(pattern=pattern)
        Step.objects.filter(pk=step.pk).update(observation=f"{step.observation}\n{warning}")
        bump_counters(run, loop_warnings=1)
        record_event(run.pk, "loop_warning", f"no progress: {pattern}; the model was told to change approach",
                     step_seq=step.seq, pattern=pattern)
        return False
    end_run(run, RunStatus.STOPPED, reason=StopReason.LOOP_DETECTED, error=pattern,
            message=f"stopped: loop detected ({pattern})")
    return True
