"""The tools the platform answers itself from the run's own rows (tools.offer.PLATFORM_TOOLS):
search_tools reveals more permitted tools, read_result pages through a stored result. No server,
no network; they write the step (and the run's revealed tools), so they belong to the engine.

Their arguments come from the model, so they are checked like any tool's: against the tool's
own JSON schema first, then against the run (a step that exists, is a tool step and has a stored
result, or an artifact of this run with text; an offset inside it). Whatever the model sends, the step ends `succeeded` or `failed`
(transitions the step map allows from `proposed`), the model is told what was wrong in words it
can act on, and the run goes on (runs/engine/writer.answered).
"""

from __future__ import annotations

import uuid

from agents.spec import spec_for
from artifacts import services as artifacts
from artifacts.models import Artifact
from llm import context
from runs.engine import writer
from runs.models import Run, Step, StepKind, StepStatus
from tools import relevance
from tools.checks import argument_error
from tools.offer import SEARCH_REVEAL, SEARCH_TOOLS, SEARCH_TOOLS_SPEC, offered_on, permitted_tools

SCHEMAS = {
    SEARCH_TOOLS: SEARCH_TOOLS_SPEC.input_schema,
    context.READ_RESULT: context.READ_RESULT_SPEC.input_schema,
}


def answer(run: Run, step: Step) -> None:
    """Answer a call of a platform tool (PLATFORM_TOOLS) from the run's rows."""
    if step.tool_name not in offered_on(step) and step.tool_name not in run.revealed_tools:
        writer.deny(run, step, f"tool {step.tool_name} was not offered on this call")
        return
    problem = argument_error(SCHEMAS[step.tool_name], step.arguments)
    if problem:
        writer.answered(run, step, ok=False, result=None, text=f"ERROR: {step.tool_name}: {problem}")
        return
    if step.tool_name == SEARCH_TOOLS:
        _search_tools(run, step)
    else:
        _read_result(run, step)


def _read_result(run: Run, step: Step) -> None:
    """One page of a stored tool result of this run (already redacted), or of an artifact's text."""
    arguments = step.arguments or {}  # checked against the schema: an object
    offset = arguments.get("offset", 0)
    if ("step" in arguments) == ("artifact" in arguments):
        return _refuse(
            run,
            step,
            "give either step (the number from a [platform: ...] note) or artifact (an artifact_id), not both",
        )
    if "artifact" in arguments:
        return _read_artifact(run, step, arguments["artifact"], offset)
    seq = arguments["step"]
    found = (
        Step.objects.filter(run_id=run.pk, seq=seq)
        .order_by()
        .values_list("kind", "status", "result", "observation")
        .first()
        if seq < step.seq
        else None
    )
    if found is None:
        return _refuse(
            run,
            step,
            f"step {seq} is not an earlier step of this run; give the step number from a [platform: ...] note",
        )
    kind, status, result, observation = found
    if kind != StepKind.TOOL:
        return _refuse(
            run,
            step,
            f"step {seq} is a model call, not a tool result; give the step number from a [platform: ...] note",
        )
    stored = (result or {}).get("text") if isinstance(result, dict) else None
    text = stored if isinstance(stored, str) else observation
    if status not in (StepStatus.SUCCEEDED, StepStatus.RESOLVED_SUCCEEDED, StepStatus.FAILED) or not text:
        return _refuse(run, step, f"step {seq} has no stored result ({status})")
    if offset >= len(text):
        return _refuse(
            run, step, f"offset {offset} is past the end of step {seq}'s result ({len(text)} characters)"
        )
    policy = context.ContextPolicy.from_spec(dict(spec_for(run.version).context))
    shown = context.page(text, seq=seq, offset=offset, limit=policy.limit_for(context.READ_RESULT))
    writer.answered(run, step, ok=True, result={"text": shown, "step": seq, "offset": offset}, text=shown)


def _read_artifact(run: Run, step: Step, raw_id: str, offset: int) -> None:
    """One page of the text of an artifact of this run: a file given with it, returned by one of
    its tools or left by run_python. Binary files (Parquet) have no text to page."""
    try:
        artifact_id = uuid.UUID(raw_id)
    except ValueError:
        return _refuse(
            run, step, f"{raw_id!r} is not an artifact id; give the artifact_id from its description"
        )
    found = Artifact.objects.filter(run_id=run.pk, pk=artifact_id).defer("content").first()
    if found is None:
        return _refuse(run, step, f"no artifact {artifact_id} in this run")
    if not artifacts.is_text(found.media_type):
        return _refuse(
            run,
            step,
            f"artifact {artifact_id} is {found.media_type}, not text: pass its artifact_id to run_python to read it",
        )
    text = artifacts.content_of(found).decode("utf-8", errors="replace")
    if offset >= max(len(text), 1):
        return _refuse(
            run,
            step,
            f"offset {offset} is past the end of artifact {artifact_id}'s text ({len(text)} characters)",
        )
    policy = context.ContextPolicy.from_spec(dict(spec_for(run.version).context))
    shown = context.page(
        text, artifact=str(artifact_id), offset=offset, limit=policy.limit_for(context.READ_RESULT)
    )
    writer.answered(
        run, step, ok=True, result={"text": shown, "artifact": str(artifact_id), "offset": offset}, text=shown
    )


def _refuse(run: Run, step: Step, why: str) -> None:
    writer.answered(run, step, ok=False, result=None, text=f"ERROR: {step.tool_name}: {why}")


def _search_tools(run: Run, step: Step) -> None:
    """Reveal more tools, only from the permitted set."""
    query = (step.arguments or {})["query"]
    tools = permitted_tools(run)
    ranked = relevance.rank(query, {t.name: f"{t.name} {t.description}" for t in tools})
    found = [n for n in ranked if n not in run.revealed_tools][:SEARCH_REVEAL]
    if found:
        Run.objects.filter(pk=run.pk).update(revealed_tools=run.revealed_tools + found)
        run.revealed_tools = run.revealed_tools + found
    by_name = {t.name: t for t in tools}
    text = "\n".join(f"- {n}: {by_name[n].description}" for n in found) or "no further tools match"
    writer.answered(
        run,
        step,
        ok=True,
        result={"text": text, "revealed": found},
        text=f"Tools added to your list:\n{text}" if found else text,
    )
