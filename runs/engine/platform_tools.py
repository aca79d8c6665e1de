"""The tools the platform answers itself from the run's own rows (tools.offer.PLATFORM_TOOLS):
search_tools reveals more permitted tools, read_result pages through a stored result. No server,
no network; they write the step (and the run's revealed tools), so they belong to the engine."""

from __future__ import annotations

from django.utils import timezone

from llm import context
from runs.lifecycle import transition_step
from runs.models import Run, Step, StepKind, StepStatus
from tools import relevance
from tools.offer import SEARCH_REVEAL, SEARCH_TOOLS, offered_on, permitted_tools


def run_platform_tool(run: Run, step: Step) -> None:
    """Answer a call of a platform tool (PLATFORM_TOOLS) from the run's rows."""
    if step.tool_name == SEARCH_TOOLS:
        run_search_tools(run, step)
    else:
        run_read_result(run, step)


def _deny_unoffered(step: Step) -> bool:
    if step.tool_name in offered_on(step):
        return False
    reason = f"tool {step.tool_name} was not offered on this call"
    transition_step(
        step,
        StepStatus.DENIED,
        message=f"step {step.seq} {step.tool_name} denied: {reason}",
        error=reason,
        observation=f"ERROR: call denied by the platform: {reason}",
        finished_at=timezone.now(),
    )
    return True


def run_read_result(run: Run, step: Step) -> None:
    """Built-in read_result: one page of a stored tool result of this run (already redacted)."""
    if _deny_unoffered(step):
        return
    arguments = step.arguments or {}
    seq, offset = arguments.get("step"), arguments.get("offset", 0)
    found = None
    if isinstance(seq, int) and isinstance(offset, int) and offset >= 0:
        found = (
            Step.objects.filter(run_id=run.pk, seq=seq, kind=StepKind.TOOL)
            .order_by()
            .values_list("result", "observation")
            .first()
        )
    if found is None:
        text = f"ERROR: no tool result at step {seq!r} of this run (give step as a number, offset >= 0)"
        transition_step(step, StepStatus.FAILED, error=text, observation=text, finished_at=timezone.now())
        return
    result, observation = found
    stored = (result or {}).get("text")
    text = stored if isinstance(stored, str) else observation
    policy = context.ContextPolicy.from_spec(run.version.spec.get("context"))
    shown = context.page(text, seq=seq, offset=offset, limit=policy.limit_for(context.READ_RESULT))
    transition_step(
        step,
        StepStatus.SUCCEEDED,
        result={"text": shown, "step": seq, "offset": offset},
        observation=shown,
        finished_at=timezone.now(),
    )


def run_search_tools(run: Run, step: Step) -> None:
    """Built-in search_tools: reveal more tools, only from the permitted set."""
    if SEARCH_TOOLS not in offered_on(step):
        reason = f"tool {SEARCH_TOOLS} was not offered on this call"
        transition_step(
            step,
            StepStatus.DENIED,
            message=f"step {step.seq} {SEARCH_TOOLS} denied: {reason}",
            error=reason,
            observation=f"ERROR: call denied by the platform: {reason}",
            finished_at=timezone.now(),
        )
        return
    query = str((step.arguments or {}).get("query", ""))
    tools = permitted_tools(run)
    ranked = relevance.rank(query, {t.name: f"{t.name} {t.description}" for t in tools})
    found = [n for n in ranked if n not in run.revealed_tools][:SEARCH_REVEAL]
    Run.objects.filter(pk=run.pk).update(revealed_tools=run.revealed_tools + found)
    by_name = {t.name: t for t in tools}
    text = "\n".join(f"- {n}: {by_name[n].description}" for n in found) or "no further tools match"
    transition_step(
        step,
        StepStatus.SUCCEEDED,
        result={"text": text, "revealed": found},
        observation=f"Tools added to your list:\n{text}" if found else text,
        finished_at=timezone.now(),
    )
