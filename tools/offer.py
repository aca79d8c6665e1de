"""Which tools a run may use and which the model is shown (DESIGN.md section 7).

Every answer reads fresh rows: the user, the tool, and object permissions from guardian's tables
each time (use_tool_sql below; guardian's ObjectPermissionChecker caches per object and also gives
superusers everything, so it is never used here). The engine passes the user row it read in the
same transaction, under the run lock; other callers let these functions read it.
"""

from __future__ import annotations

import functools
import json

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection

from agents.spec import spec_for
from core import sql
from llm import context
from llm.types import ToolSpec
from runs.models import Run, Step
from tenants import permissions
from tools import relevance
from tools.models import Tool

SEARCH_TOOLS = "search_tools"
SEARCH_TOOLS_SPEC = ToolSpec(
    name=SEARCH_TOOLS,
    description="Find more tools you are allowed to use. Describe the task; matching tools are added to your list.",
    input_schema={"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
)
SEARCH_REVEAL = 5
# Tools the platform answers itself, from the run's own rows: no server, no network.
PLATFORM_TOOLS = {SEARCH_TOOLS, context.READ_RESULT}


def fresh_user(run: Run):
    return get_user_model().objects.get(pk=run.created_by_id)


@functools.cache
def use_tool_sql() -> str:
    """SQL that is true when user %(user)s holds use_tool on the tool aliased `t`, directly or
    through a group: what guardian's get_objects_for_user(user, "tools.use_tool", klass=<tools>,
    with_superuser=False, accept_global_perms=False) answers (tenants.permissions.held_sql)."""
    return permissions.held_sql("tools", "tool", "use_tool", column="t.id")


def permitted_tools(run: Run, *, user=None) -> list[Tool]:
    """Allowlist ∩ tools the user holds use_tool on right now ∩ enabled and not quarantined.

    `user`: the run's creator as read in the caller's transaction; None reads the row now.
    """
    user = user or fresh_user(run)
    if not user.is_active or user.tenant_id != run.tenant_id:
        return []
    params = {"tenant": run.tenant_id, "user": user.pk}
    names = sql.in_list("name", list(spec_for(run.version).tools), params)
    return [
        tool
        for (tool,) in sql.fetch(
            f"SELECT {sql.columns(Tool, 't')} FROM {sql.table(Tool)} t WHERE t.tenant_id = %(tenant)s "
            f"AND t.name {names} AND t.enabled AND NOT t.quarantined AND {use_tool_sql()} ORDER BY t.name",
            params,
            Tool,
        )
    ]


def spec_of(tool: Tool) -> ToolSpec:
    return ToolSpec(name=tool.name, description=tool.description, input_schema=tool.input_schema)


def offered_tools(run: Run, steps=(), *, user=None, permitted: list[Tool] | None = None) -> list[ToolSpec]:
    """Sorted by name so the request prefix stays byte-stable between steps. (The model gateway
    adds read_result, which the context policy needs: llm.gateway.build_request.)

    `permitted`: permitted_tools(run, user=user) as the caller read it in this transaction."""
    tools = permitted if permitted is not None else permitted_tools(run, user=user)
    limit = spec_for(run.version).max_visible_tools
    limit = settings.VISIBLE_TOOLS_MAX if limit is None else limit
    if len(tools) <= limit:
        return [spec_of(t) for t in tools]
    recent = " ".join(s.observation[:500] for s in list(steps)[-3:])
    query = json.dumps(run.input, ensure_ascii=False) + " " + recent
    by_name = {t.name: t for t in tools}
    ranked = relevance.rank(query, {t.name: f"{t.name} {t.description}" for t in tools})
    chosen = [n for n in run.revealed_tools if n in by_name]
    chosen += [n for n in ranked if n not in chosen][: max(limit - 1 - len(chosen), 0)]
    return sorted([spec_of(by_name[n]) for n in chosen], key=lambda s: s.name) + [SEARCH_TOOLS_SPEC]


def offered_on(step: Step, steps=None) -> list[str]:
    """Names of the tools the model was shown on the call that proposed this step."""
    if step.parent_seq is None:
        return []  # no model call proposed it, so none was shown any tool
    if steps is not None:
        parent = next((s for s in steps if s.seq == step.parent_seq), None)
        if parent is not None:
            return (parent.request or {}).get("tools", [])
    # order_by(): Step's default ordering would join the run table for nothing.
    request = (
        Step.objects.filter(run_id=step.run_id, seq=step.parent_seq)
        .order_by()
        .values_list("request", flat=True)
        .first()
    )
    return (request or {}).get("tools", [])


def use_tool_pks(user, tool_pks) -> set[str]:
    """Which of these tools (pks as text) the user holds use_tool on, directly or through a group.

    The same answer as guardian's get_objects_for_user(user, "tools.use_tool", klass=<these tools>,
    with_superuser=False, accept_global_perms=False), read from guardian's tables on every call,
    but as one small UNION instead of guardian's nested subqueries, which cost ~10 ms of CPU to
    build on every step (bench/engine.py).
    """
    keys = [int(pk) for pk in tool_pks]
    if not keys:
        return set()
    with connection.cursor() as cursor:
        params = {"user": user.pk}
        in_keys = sql.in_list("key", keys, params)
        cursor.execute(
            f"SELECT t.id FROM {sql.table(Tool)} t WHERE t.id {in_keys} AND {use_tool_sql()}", params
        )
        return {str(pk) for (pk,) in cursor.fetchall()}


def has_use_tool(user, tool: Tool) -> bool:
    return str(tool.pk) in use_tool_pks(user, [tool.pk])
