"""The checks at dispatch: may this exact call be sent now? They decide and return a reason; the
engine writes what follows (a denial, the dispatch). Approvals are verified by approvals/services.py;
the tenant's Cedar policies are the last check (approvals/calls.py)."""

from __future__ import annotations

import functools
import json

import jsonschema

from agents.spec import spec_for
from approvals.calls import check_call
from authority.models import Delegation
from core import sql
from runs.models import Run, Step
from tools.models import Tool, ToolServer
from tools.offer import fresh_user, offered_on, use_tool_sql


def check_dispatch(run: Run, step: Step, *, user=None, steps=None) -> str | None:
    """Return why the call must not be sent, or None. Reads everything fresh.

    `user` and `steps`: the run's creator and step log as the caller read them in this
    transaction, under the run lock (the run row then is fresh too); None reads them now.
    The tool is read now, with its server and the server's delegation, and attached to the step.
    """
    fresh = user is not None
    user = user or fresh_user(run)
    if not user.is_active:
        return f"user {user.username} is deactivated"
    if user.tenant_id != run.tenant_id:
        return f"user {user.username} no longer belongs to this tenant"
    if step.tool_id is None:
        return f"unknown tool {step.tool_name!r}"
    with sql.prepared_cursor() as cursor:
        cursor.execute(
            f"SELECT {sql.columns(Tool, 't')}, {sql.columns(ToolServer, 's')}, "
            f"{sql.columns(Delegation, 'd')}, {use_tool_sql()} "
            f"FROM {sql.table(Tool)} t JOIN {sql.table(ToolServer)} s ON s.id = t.server_id "
            f"LEFT JOIN {sql.table(Delegation)} d ON d.server_id = s.id "
            "WHERE t.id = %(tool)s",
            {"tool": step.tool_id, "user": user.pk},
        )
        row = cursor.fetchone()
    tool, server, delegation = sql.split(row[:-1], Tool, ToolServer, Delegation)
    may_use = row[-1]
    # Read here, in the claim's transaction: the credentials of the call (authority/credentials.py)
    # are made after it commits, and would otherwise read the delegation in a transaction of its own.
    ToolServer.delegation.related.set_cached_value(server, delegation)
    tool.server = server
    step.tool = tool
    if not tool.enabled:
        return f"tool {tool.name} is disabled"
    if tool.quarantined:
        return f"tool {tool.name} is quarantined: {tool.quarantine_reason}"
    if tool.name not in spec_for(run.version).tools:
        return f"tool {tool.name} is not in this agent's allowlist"
    if not may_use:
        return f"user {user.username} may not use {tool.name}"
    revealed = run.revealed_tools if fresh else Run.objects.get(pk=run.pk).revealed_tools
    if tool.name not in offered_on(step, steps) and tool.name not in revealed:
        return f"tool {tool.name} was not offered on this call"
    problem = argument_error(tool.input_schema, step.arguments)
    if problem:
        return problem
    # Cedar narrows the grant: forbid wins, under the lock of the day's totals (approvals/calls.py).
    return check_call(run, step, user=user, steps=steps)


def argument_error(schema: dict | None, arguments) -> str | None:
    """Why the arguments do not match the tool's JSON schema (field by field, for the model), or None."""
    try:
        validator = _validator(json.dumps(schema or {"type": "object"}, sort_keys=True))
    except jsonschema.SchemaError as exc:
        return f"tool schema is invalid: {exc.message}"
    try:
        error = jsonschema.exceptions.best_match(validator.iter_errors(arguments))
    except RecursionError:
        return "arguments are nested too deeply"
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(arguments)"
        return f"arguments invalid at {where}: {error.message[:300]}"
    return None


@functools.lru_cache(maxsize=1024)
def _validator(schema_json: str):
    """A validator per distinct schema: checking a schema against its meta-schema costs
    milliseconds, far more than validating the arguments (jsonschema.validate does both)."""
    schema = json.loads(schema_json)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)
