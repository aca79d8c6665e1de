"""The model's tool calls stored as proposed steps: nothing is checked yet (claim checks each one
before it is dispatched)."""

from __future__ import annotations

from agentplatform import sql
from agentplatform.digests import digest
from runs.lifecycle import record_event
from runs.models import Run, Step, StepKind, StepStatus
from tools.models import Tool
from tools.offer import PLATFORM_TOOLS


def idempotency_key(run: Run, seq: int) -> str:
    """Stable for the step: the same on every attempt, never derived from the attempt."""
    return f"{run.tenant.slug}:{run.pk}:{seq}"


def propose(*, run: Run, parent_seq: int, calls: list[dict]) -> list[Step]:
    """Store the model's tool calls as proposed steps parent_seq + 1, + 2, ... (nothing is checked yet)."""
    if not calls:
        return []
    names = {call["name"] for call in calls} - PLATFORM_TOOLS
    params = {"tenant": run.tenant_id}
    in_names = sql.in_list("name", sorted(names), params)
    tools = {
        t.name: t
        for (t,) in sql.fetch(
            f"SELECT {sql.columns(Tool, 't')} FROM {sql.table(Tool)} t "
            f"WHERE t.tenant_id = %(tenant)s AND t.name {in_names}",
            params,
            Tool,
        )
    }
    steps = []
    for seq, call in enumerate(calls, start=parent_seq + 1):
        name = call["name"]
        arguments = (
            call.get("arguments")
            if isinstance(call.get("arguments"), dict)
            else {"_raw": call.get("arguments")}
        )
        steps.append(
            Step(
                run=run,
                seq=seq,
                kind=StepKind.TOOL,
                status=StepStatus.PROPOSED,
                parent_seq=parent_seq,
                tool=tools.get(name),
                tool_name=name,
                call_id=call["id"],
                arguments=arguments,
                args_digest=digest(arguments),
                idempotency_key=idempotency_key(run, seq),
            )
        )
        record_event(
            run.pk,
            "step",
            f"step {seq} proposed: {name}",
            step_seq=seq,
            to=StepStatus.PROPOSED,
            step_kind=StepKind.TOOL,
            tool=name,
        )
    sql.insert(steps)
    return steps
