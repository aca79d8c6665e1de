"""The tool gateway: the model proposes, the gateway decides (DESIGN.md section 7).

Every check reads fresh rows: the user, the tool, and object permissions from guardian's tables
each time (_USE_TOOL below; guardian's ObjectPermissionChecker caches per object and also gives
superusers everything, so it is never used here). The engine passes the user row it read in
the same transaction, under the run lock; other callers let the gateway read it.
"""

from __future__ import annotations

import functools
import json
import threading

import httpx
import jsonschema
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection
from django.utils import timezone

from llm import context
from llm.types import ToolSpec
from runs import rows
from runs.lifecycle import digest, record_event, transition_step
from runs.models import Run, Step, StepKind, StepStatus
from tenants.crypto import decrypt, redact, redact_obj
from tenants.models import Secret
from tools import relevance
from tools.builtin import BUILTINS
from tools.models import Tool, ToolServer
from tools.origins import origin_text, same_origin
from tools.types import (
    IDEMPOTENCY_HEADER,
    McpServerConfig,
    ToolFailed,
    ToolInProgress,
    ToolOutcomeUnknown,
    ToolResult,
)

SEARCH_TOOLS = "search_tools"
SEARCH_TOOLS_SPEC = ToolSpec(
    name=SEARCH_TOOLS,
    description="Find more tools you are allowed to use. Describe the task; matching tools are added to your list.",
    input_schema={"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
)
SEARCH_REVEAL = 5
# Tools the platform answers itself, from the run's own rows: no server, no network.
PLATFORM_TOOLS = {SEARCH_TOOLS, context.READ_RESULT}


# --- what the model sees -----------------------------------------------------------------------


def _fresh_user(run: Run):
    return get_user_model().objects.get(pk=run.created_by_id)


@functools.cache
def _use_tool_sql() -> str:
    """SQL that is true when user %(user)s holds use_tool on the tool aliased `t`, directly or
    through a group: what guardian's get_objects_for_user(user, "tools.use_tool", klass=<tools>,
    with_superuser=False, accept_global_perms=False) answers, without its nested subqueries
    (~10 ms of CPU to build with the ORM, on every step)."""
    from django.contrib.auth.models import Permission
    from django.contrib.contenttypes.models import ContentType
    from guardian.models import GroupObjectPermission, UserObjectPermission

    memberships = get_user_model().groups.through
    permission = (
        f"SELECT p.id FROM {rows.table(Permission)} p JOIN {rows.table(ContentType)} c "
        "ON c.id = p.content_type_id WHERE c.app_label = 'tools' AND c.model = 'tool' "
        "AND p.codename = 'use_tool'"
    )
    return (
        f"CAST(t.id AS TEXT) IN (SELECT object_pk FROM {rows.table(UserObjectPermission)} "
        f"WHERE user_id = %(user)s AND permission_id IN ({permission}) "
        f"UNION ALL SELECT g.object_pk FROM {rows.table(GroupObjectPermission)} g "
        f"JOIN {rows.table(memberships)} m ON m.group_id = g.group_id "
        f"WHERE m.user_id = %(user)s AND g.permission_id IN ({permission}))"
    )


def permitted_tools(run: Run, *, user=None) -> list[Tool]:
    """Allowlist ∩ tools the user holds use_tool on right now ∩ enabled and not quarantined.

    `user`: the run's creator as read in the caller's transaction; None reads the row now.
    """
    user = user or _fresh_user(run)
    if not user.is_active or user.tenant_id != run.tenant_id:
        return []
    params = {"tenant": run.tenant_id, "user": user.pk}
    names = rows.in_list("name", list(run.version.spec.get("tools", [])), params)
    return [
        tool
        for (tool,) in rows.fetch(
            f"SELECT {rows.columns(Tool, 't')} FROM {rows.table(Tool)} t WHERE t.tenant_id = %(tenant)s "
            f"AND t.name {names} AND t.enabled AND NOT t.quarantined AND {_use_tool_sql()} ORDER BY t.name",
            params,
            Tool,
        )
    ]


def _spec(tool: Tool) -> ToolSpec:
    return ToolSpec(name=tool.name, description=tool.description, input_schema=tool.input_schema)


def offered_tools(run: Run, steps=(), *, user=None) -> list[ToolSpec]:
    """Sorted by name so the request prefix stays byte-stable between steps. (The model gateway
    adds read_result, which the context policy needs: llm.gateway.build_request.)"""
    tools = permitted_tools(run, user=user)
    limit = int(run.version.spec.get("max_visible_tools", settings.VISIBLE_TOOLS_MAX))
    if len(tools) <= limit:
        return [_spec(t) for t in tools]
    recent = " ".join(s.observation[:500] for s in list(steps)[-3:])
    query = json.dumps(run.input, ensure_ascii=False) + " " + recent
    by_name = {t.name: t for t in tools}
    ranked = relevance.rank(query, {t.name: f"{t.name} {t.description}" for t in tools})
    chosen = [n for n in run.revealed_tools if n in by_name]
    chosen += [n for n in ranked if n not in chosen][: max(limit - 1 - len(chosen), 0)]
    return sorted([_spec(by_name[n]) for n in chosen], key=lambda s: s.name) + [SEARCH_TOOLS_SPEC]


def run_platform_tool(run: Run, step: Step) -> None:
    """Answer a call of a platform tool (PLATFORM_TOOLS) from the run's rows."""
    if step.tool_name == SEARCH_TOOLS:
        run_search_tools(run, step)
    else:
        run_read_result(run, step)


def _deny_unoffered(step: Step) -> bool:
    if step.tool_name in _offered_on(step):
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
    if SEARCH_TOOLS not in _offered_on(step):
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


# --- proposals and checks at dispatch -----------------------------------------------------------


def idempotency_key(run: Run, seq: int) -> str:
    """Stable for the step: the same on every attempt, never derived from the attempt."""
    return f"{run.tenant.slug}:{run.pk}:{seq}"


def propose(*, run: Run, parent_seq: int, calls: list[dict]) -> list[Step]:
    """Store the model's tool calls as proposed steps parent_seq + 1, + 2, ... (nothing is checked yet)."""
    if not calls:
        return []
    names = {call["name"] for call in calls} - PLATFORM_TOOLS
    params = {"tenant": run.tenant_id}
    in_names = rows.in_list("name", sorted(names), params)
    tools = {
        t.name: t
        for (t,) in rows.fetch(
            f"SELECT {rows.columns(Tool, 't')} FROM {rows.table(Tool)} t "
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
    rows.insert(steps)
    return steps


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
        in_keys = rows.in_list("key", keys, params)
        cursor.execute(
            f"SELECT t.id FROM {rows.table(Tool)} t WHERE t.id {in_keys} AND {_use_tool_sql()}", params
        )
        return {str(pk) for (pk,) in cursor.fetchall()}


def has_use_tool(user, tool: Tool) -> bool:
    return str(tool.pk) in use_tool_pks(user, [tool.pk])


def _offered_on(step: Step, steps=None) -> list[str]:
    """Names of the tools the model was shown on the call that proposed this step."""
    if steps is not None:
        parent = next((s for s in steps if s.seq == step.parent_seq), None)
        return ((parent.request if parent else None) or {}).get("tools", [])
    # order_by(): Step's default ordering would join the run table for nothing.
    request = (
        Step.objects.filter(run_id=step.run_id, seq=step.parent_seq)
        .order_by()
        .values_list("request", flat=True)
        .first()
    )
    return (request or {}).get("tools", [])


def check_dispatch(run: Run, step: Step, *, user=None, steps=None) -> str | None:
    """Return why the call must not be sent, or None. Reads everything fresh.

    `user` and `steps`: the run's creator and step log as the caller read them in this
    transaction, under the run lock (the run row then is fresh too); None reads them now.
    The tool is read now, with its server, and attached to the step.
    """
    fresh = user is not None
    user = user or _fresh_user(run)
    if not user.is_active:
        return f"user {user.username} is deactivated"
    if user.tenant_id != run.tenant_id:
        return f"user {user.username} no longer belongs to this tenant"
    if step.tool_id is None:
        return f"unknown tool {step.tool_name!r}"
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {rows.columns(Tool, 't')}, {rows.columns(ToolServer, 's')}, {_use_tool_sql()} "
            f"FROM {rows.table(Tool)} t JOIN {rows.table(ToolServer)} s ON s.id = t.server_id "
            "WHERE t.id = %(tool)s",
            {"tool": step.tool_id, "user": user.pk},
        )
        row = cursor.fetchone()
    tool, server = rows.split(row[:-1], Tool, ToolServer)
    may_use = row[-1]
    tool.server = server
    step.tool = tool
    if not tool.enabled:
        return f"tool {tool.name} is disabled"
    if tool.quarantined:
        return f"tool {tool.name} is quarantined: {tool.quarantine_reason}"
    if tool.name not in run.version.spec.get("tools", []):
        return f"tool {tool.name} is not in this agent's allowlist"
    if not may_use:
        return f"user {user.username} may not use {tool.name}"
    revealed = run.revealed_tools if fresh else Run.objects.get(pk=run.pk).revealed_tools
    if tool.name not in _offered_on(step, steps) and tool.name not in revealed:
        return f"tool {tool.name} was not offered on this call"
    try:
        validator = _validator(json.dumps(tool.input_schema or {"type": "object"}, sort_keys=True))
    except jsonschema.SchemaError as exc:
        return f"tool schema is invalid: {exc.message}"
    error = jsonschema.exceptions.best_match(validator.iter_errors(step.arguments))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(arguments)"
        return f"arguments invalid at {where}: {error.message}"
    return None


@functools.lru_cache(maxsize=1024)
def _validator(schema_json: str):
    """A validator per distinct schema: checking a schema against its meta-schema costs
    milliseconds, far more than validating the arguments (jsonschema.validate does both)."""
    schema = json.loads(schema_json)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


# --- calling -----------------------------------------------------------------------------------


def _secret_header(server: ToolServer) -> dict:
    if not server.secret_id:
        return {}
    value = Secret.objects.get(pk=server.secret_id).reveal()
    return {server.auth_header or "Authorization": f"{server.auth_scheme} {value}".strip()}


def mcp_config(server: ToolServer) -> McpServerConfig:
    return McpServerConfig(
        transport=server.transport or ToolServer.Transport.STREAMABLE_HTTP,
        url=server.url,
        command=tuple(server.command or ()),
        headers=_secret_header(server),
    )


def dispatch(step: Step) -> ToolResult:
    """Send the call. Raises ToolFailed (provably not done) or ToolOutcomeUnknown."""
    tool = step.tool
    server = tool.server
    if server.kind == ToolServer.Kind.BUILTIN:
        builtin = BUILTINS.get(tool.remote_name)
        if builtin is None:
            raise ToolFailed(f"no builtin tool {tool.remote_name}")
        try:
            return builtin.run(step.arguments)
        except Exception as exc:
            raise ToolFailed(f"{tool.name} failed: {type(exc).__name__}: {exc}") from None
    if server.kind == ToolServer.Kind.HTTP:
        return _http_call(server, tool, step)
    from tools import mcp_client

    return mcp_client.call_tool(
        mcp_config(server),
        tool.remote_name,
        step.arguments,
        idempotency_key=step.idempotency_key,
        timeout=tool.timeout_seconds,
    )


def http_tool_url(server: ToolServer, tool: Tool) -> str:
    return tool.http_url or f"{server.url.rstrip('/')}/{tool.remote_name}"


def http_status_url(server: ToolServer, tool: Tool, key: str) -> str:
    return (tool.status_url or f"{server.url.rstrip('/')}/status/{{key}}").replace("{key}", key)


def off_origin(server: ToolServer, url: str) -> str | None:
    """Why `url` must not be called with the server's secret, or None.

    The secret (and the idempotency key) belong to the origin of the server's configured URL;
    a tool URL elsewhere is refused even for a server without a secret, so that no tool field
    can aim the platform at another host.
    """
    if same_origin(url, server.url):
        return None
    try:
        where = origin_text(server.url)
    except ValueError:
        where = "(no valid server URL)"
    return f"refused before sending: the URL of this call is not on server {server.name}'s origin {where}"


@functools.cache
def _tls():
    """One TLS context per process: httpx.post builds a new one per call otherwise, and loading the
    CA bundle into it costs more CPU than the rest of an engine step (docs/performance.md)."""
    return httpx.create_ssl_context()


def _http_call(server: ToolServer, tool: Tool, step: Step) -> ToolResult:
    url = http_tool_url(server, tool)
    refusal = off_origin(server, url)
    if refusal:
        raise ToolFailed(refusal)
    headers = {IDEMPOTENCY_HEADER: step.idempotency_key, **_secret_header(server)}
    try:
        # Redirects are never followed (httpx's default, said here because it matters): the
        # secret goes to the configured origin and nowhere else.
        response = httpx.post(
            url,
            json=step.arguments,
            headers=headers,
            follow_redirects=False,
            timeout=httpx.Timeout(tool.timeout_seconds, connect=min(5.0, tool.timeout_seconds)),
            verify=_tls(),
        )
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise ToolFailed(f"could not connect to {server.name}: {type(exc).__name__}") from None
    except httpx.HTTPError as exc:
        raise ToolOutcomeUnknown(f"{type(exc).__name__} after sending to {server.name}") from None
    if response.status_code >= 500:
        raise ToolOutcomeUnknown(
            f"{server.name} answered {response.status_code}", retry_after=_retry_after(response)
        )
    if response.status_code == 409 and step.attempts > 1:
        # A repeat of a call whose first attempt went unanswered: the provider still holds the
        # key ("in use"), so that attempt is alive. Wait for it; a second send could double it.
        raise ToolInProgress(
            f"{server.name} answered 409: the request with this key is still in progress",
            retry_after=_retry_after(response),
        )
    if response.status_code >= 400:
        raise ToolFailed(f"{server.name} refused the call ({response.status_code}): {response.text[:500]}")
    if response.is_redirect:
        _redirected(server, response)
    return _http_result(response)


def _redirected(server: ToolServer, response: httpx.Response) -> None:
    """A redirect is not followed. 307/308 say the request was not handled here (a failure);
    after any other redirect the provider may have acted, so the outcome is unknown."""
    where = response.headers.get("Location", "")
    note = (
        f"{server.name} redirected the call ({response.status_code}); not followed: calls and secrets go only "
        f"to the server's configured origin"
    )
    if not same_origin(str(response.url.join(where)), server.url):
        note += ", and the redirect pointed elsewhere"
    if response.status_code in (307, 308):
        raise ToolFailed(note)
    raise ToolOutcomeUnknown(note)


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers.get("Retry-After", ""))
    except ValueError:
        return None


def _http_result(response: httpx.Response) -> ToolResult:
    try:
        body = response.json()
    except ValueError:
        return ToolResult(text=response.text)
    return ToolResult(text=json.dumps(body, ensure_ascii=False), structured=body)


def lookup_status(step: Step) -> ToolResult | None:
    """Ask a reconcilable provider whether the call with this key happened. None: it did not."""
    tool = step.tool
    server = tool.server
    if server.kind == ToolServer.Kind.HTTP:
        url = http_status_url(server, tool, step.idempotency_key)
        refusal = off_origin(server, url)
        if refusal:
            # Nothing is learnt about the call itself: its outcome stays unknown.
            raise ToolOutcomeUnknown(f"status lookup {refusal}")
        try:
            response = httpx.get(
                url, headers=_secret_header(server), timeout=tool.timeout_seconds, follow_redirects=False
            )
        except httpx.HTTPError as exc:
            raise ToolOutcomeUnknown(f"status lookup failed: {type(exc).__name__}") from None
        if response.status_code == 409:
            raise ToolInProgress(
                "status lookup answered 409: in progress", retry_after=_retry_after(response)
            )
        if response.status_code >= 300:
            raise ToolOutcomeUnknown(
                f"status lookup answered {response.status_code} (redirects are not followed)"
            )
        try:
            body = response.json()
        except ValueError:
            raise ToolOutcomeUnknown("status lookup answered something other than JSON") from None
    elif server.kind == ToolServer.Kind.MCP and server.status_tool:
        from tools import mcp_client

        answer = mcp_client.call_tool(
            mcp_config(server),
            server.status_tool,
            {"idempotency_key": step.idempotency_key},
            idempotency_key=f"{step.idempotency_key}:status",
            timeout=tool.timeout_seconds,
        )
        body = answer.structured if isinstance(answer.structured, dict) else json.loads(answer.text or "{}")
    else:
        raise ToolOutcomeUnknown(f"{tool.name} has no status lookup configured")
    if not isinstance(body, dict):
        raise ToolOutcomeUnknown("status lookup answered something other than a JSON object")
    if body.get("in_progress") is True or body.get("status") == "in_progress":
        raise ToolInProgress("status lookup: the request with this key is still in progress")
    if not body.get("found"):
        return None
    result = body.get("result")
    return ToolResult(text=json.dumps(result, ensure_ascii=False), structured=result)


# --- results -----------------------------------------------------------------------------------

_secrets: dict[int, tuple[tuple, list[str]]] = {}  # tenant id -> ((id, ciphertext) pairs, values)
_secrets_lock = threading.Lock()


def known_secrets(tenant_id) -> list[str]:
    """The tenant's secret values, for redaction.

    Decrypting (Fernet, one per secret) costs far more than reading, so the values are kept per
    process and decrypted again when the tenant's secrets change: their ids and ciphertexts are
    read on every call (a few short rows), so a secret added, changed or deleted counts at once.
    """
    stored = list(Secret.objects.filter(tenant_id=tenant_id).order_by("pk").values_list("pk", "ciphertext"))
    version = tuple(stored)
    cached = _secrets.get(tenant_id)
    if cached is not None and cached[0] == version:
        return cached[1]
    values = [decrypt(ciphertext, settings.SECRET_ENCRYPTION_KEYS) for _, ciphertext in stored]
    with _secrets_lock:
        _secrets[tenant_id] = (version, values)
    return values


def redact_text(run: Run, text: str) -> str:
    return redact(text, known_secrets(run.tenant_id))


def redact_reply(run: Run, reply) -> tuple[str, list[dict]]:
    """The model's text and tool calls with known secrets redacted, before they are stored or sent.

    A model that got hold of a secret (pasted into a ticket, say) could otherwise copy it into a
    step record or smuggle it out in a tool call's arguments.
    """
    secrets = known_secrets(run.tenant_id)
    calls = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in reply.tool_calls]
    return redact(reply.text, secrets), redact_obj(calls, secrets)


def shape_result(run: Run, step: Step, result: ToolResult) -> tuple[dict, str]:
    """Redact, store in full, and give the model a capped view with a clear marker."""
    secrets = known_secrets(run.tenant_id)
    text = redact(result.text, secrets)
    stored = {"text": text, "structured": redact_obj(result.structured, secrets), "is_error": result.is_error}
    limit = settings.TOOL_RESULT_MODEL_CHARS
    observation = text
    if len(text) > limit:
        observation = (
            text[:limit] + f"\n[truncated by the platform: showing {limit} of {len(text)} characters; "
            "the full result is stored]"
        )
    if result.is_error:
        observation = f"ERROR: {observation}"
    return stored, observation
