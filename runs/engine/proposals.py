"""The model's tool calls stored as proposed steps: nothing is checked yet (claim checks each one
before it is dispatched).

What the model sends is stored whatever it is, so it is made storable first (`storable`): text
without NUL characters (PostgreSQL's text and jsonb refuse them), names and ids within their
columns, arguments nested at most MAX_DEPTH deep. A call the model mangled is then an ordinary
proposed step, which the checks deny or fail with a message the model can act on.
"""

from __future__ import annotations

from core import sql
from core.digests import digest
from runs.models import Run, Step, StepKind, StepStatus
from runs.transitions import insert_steps, record_event
from tools.models import Tool
from tools.offer import PLATFORM_TOOLS


def idempotency_key(run: Run, seq: int) -> str:
    """Stable for the step: the same on every attempt, never derived from the attempt."""
    return f"{run.tenant.slug}:{run.pk}:{seq}"


MAX_DEPTH = 32
NAME_MAX = Step._meta.get_field("tool_name").max_length
CALL_ID_MAX = Step._meta.get_field("call_id").max_length


def storable(value, depth: int = 0):
    """`value` with every string storable and nesting cut at MAX_DEPTH (pure)."""
    if isinstance(value, str):
        # NUL and lone surrogates cannot be stored (PostgreSQL, UTF-8): dropped and replaced.
        return value.replace("\x00", "").encode("utf-8", "replace").decode("utf-8")
    if depth >= MAX_DEPTH and isinstance(value, (dict, list)):
        return "[platform: nested too deeply]"
    if isinstance(value, dict):
        return {storable(str(k)): storable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [storable(v, depth + 1) for v in value]
    if isinstance(value, float) and value != value:  # NaN: not JSON
        return None
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return None
    return value


def storable_calls(calls: list[dict]) -> list[dict]:
    """The model's tool calls as they can be stored: names and ids cut to their columns."""
    return [
        {
            "id": storable(str(call.get("id") or ""))[:CALL_ID_MAX],
            "name": storable(str(call.get("name") or ""))[:NAME_MAX],
            "arguments": storable(call.get("arguments")),
        }
        for call in calls
    ]


def propose(
    *, run: Run, parent_seq: int, calls: list[dict], known: dict[str, Tool] | None = None, defer: bool = False
) -> list[Step]:
    """Store the model's tool calls as proposed steps parent_seq + 1, + 2, ... (nothing is checked yet).

    Each step names its tool's row: from `known` (the tools the claim read, by name), else read
    here; a name the tenant has no tool for stays without one (the dispatch checks deny it).
    `defer`: INSERT them with the run's events at the end of the transaction (the caller reads
    none of them back; they then have no primary key in memory).
    """
    if not calls:
        return []
    tools = dict(known or {})
    names = {call["name"] for call in calls} - PLATFORM_TOOLS - set(tools)
    if names:
        params = {"tenant": run.tenant_id}
        in_names = sql.in_list("name", sorted(names), params)
        tools.update(
            (t.name, t)
            for (t,) in sql.fetch(
                f"SELECT {sql.columns(Tool, 't')} FROM {sql.table(Tool)} t "
                f"WHERE t.tenant_id = %(tenant)s AND t.name {in_names}",
                params,
                Tool,
            )
        )
    steps = []
    for seq, call in enumerate(calls, start=parent_seq + 1):
        name = call["name"]
        arguments = (
            call.get("arguments")
            if isinstance(call.get("arguments"), dict)
            else {"_raw": call.get("arguments")}
        )
        steps.append(
            sql.new(
                Step,
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
            content={"arguments": steps[-1].args_digest},  # binds the arguments into the chain
        )
    insert_steps(steps, defer=defer)
    return steps
