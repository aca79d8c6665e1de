"""No-progress detection: one platform warning to the model, then `loop_detected`.

Patterns, each with a limit from the version's spec (`loop`, defaults in agents.spec.LOOP_DEFAULTS):
- the same call (tool and canonical arguments) made `max_repeats` times in the run, whatever
  came of it: succeeded, failed at the provider, or denied by the platform;
- `max_empty_results` empty results in a row (an empty text, or a result whose collections are
  all empty, like {"tickets": []});
- two different calls alternating (A B A B ...) for `alternation_cycles` cycles.

Checked after every tool step has its outcome, including a denial at the claim.

The call that reaches a limit stops the run. The call just before it gets one platform warning
appended to its observation, so the model reads it on its next turn and can change course. A
run is warned once. So a model that keeps repeating an empty search costs at most `limit`
tool calls (identical ones are replayed from the record by the engine, not sent again) and
`limit` model calls.
"""

from __future__ import annotations

import json

from agents.spec import LoopLimits, spec_for
from runs.lifecycle import bump_counters, end_run, record_event
from runs.models import Run, RunStatus, Step, StepKind, StepStatus, StopReason

EMPTY = {"", "[]", "{}", "null", "none", "no results", "0 results"}
WARNING = (
    "[platform] You are not making progress ({pattern}). Do not repeat this call; change your "
    "approach or give your final answer."
)
FINISHED = (StepStatus.SUCCEEDED, StepStatus.FAILED, StepStatus.DENIED)


def _thresholds(run: Run) -> LoopLimits:
    return spec_for(run.version).loop


def _is_empty_value(value) -> bool:
    if isinstance(value, list):
        return not value
    if isinstance(value, dict):
        collections = [v for v in value.values() if isinstance(v, (list, dict))]
        return not value or (bool(collections) and all(_is_empty_value(v) for v in collections))
    return False


def _is_empty(step: Step) -> bool:
    result = step.result if isinstance(step.result, dict) else {}
    text = str(result.get("text") or "")
    if text.strip().lower() in EMPTY:
        return True
    structured = result.get("structured")
    if structured is None:
        try:
            structured = json.loads(text)
        except ValueError:
            return False
    return _is_empty_value(structured)


def _key(step: Step) -> str:
    return f"{step.tool_id}:{step.tool_name}:{step.args_digest}"


def patterns(run: Run, steps: list[Step]) -> list[tuple[str, int, int]]:
    """(description, count so far, limit) of each no-progress pattern the tool calls show."""
    limits = _thresholds(run)
    calls = [s for s in steps if s.kind == StepKind.TOOL and s.status in FINISHED]
    if not calls:
        return []
    last = calls[-1]
    keys = [_key(s) for s in calls]
    found = []
    alternating = 0
    if len(keys) >= 3 and keys[-1] != keys[-2]:
        alternating = 2
        while alternating < len(keys) and keys[-alternating - 1] == keys[-alternating + 1]:
            alternating += 1
    if alternating >= 3:
        found.append(("alternating between the same two calls", alternating, 2 * limits.alternation_cycles))
    repeats = keys.count(_key(last))
    found.append((f"the same call {last.tool_name} was made {repeats} times", repeats, limits.max_repeats))
    empties = 0
    for s in reversed(calls):
        if not (s.status == StepStatus.SUCCEEDED and _is_empty(s)):
            break
        empties += 1
    found.append((f"{empties} empty results in a row", empties, limits.max_empty_results))
    return found


def detect(run: Run, steps: list[Step]) -> tuple[str, str] | None:
    """("stop" | "warn", pattern) when a limit is reached or is one call away, else None."""
    found = patterns(run, steps)
    for description, count, limit in found:
        if count >= limit:
            return "stop", description
    for description, count, limit in found:
        if limit > 1 and count == limit - 1:
            return "warn", description
    return None


def check(run: Run, steps: list[Step], step: Step) -> bool:
    """After a tool step: warn once when a limit is one call away, stop at it. True when stopped."""
    verdict = detect(run, steps)
    if verdict is None:
        return False
    level, pattern = verdict
    if level == "stop":
        end_run(
            run,
            RunStatus.STOPPED,
            reason=StopReason.LOOP_DETECTED,
            error=pattern,
            message=f"stopped: loop detected ({pattern})",
        )
        return True
    if run.loop_warnings == 0:
        warning = WARNING.format(pattern=pattern)
        Step.objects.filter(pk=step.pk).update(observation=f"{step.observation}\n{warning}")
        step.observation = f"{step.observation}\n{warning}"
        bump_counters(run, loop_warnings=1)
        record_event(
            run.pk,
            "loop_warning",
            f"no progress: {pattern}; the model was told to change approach",
            step_seq=step.seq,
            pattern=pattern,
        )
    return False
