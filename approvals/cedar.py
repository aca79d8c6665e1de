"""Cedar policies decide what a call may do: permit, forbid (forbid wins), or permit with approval.

Guardian's `use_tool` grant is the first, coarse check (tools/checks.py); Cedar only narrows it.
A tenant's policies come from its configuration file (configuration/policies.py) and are
evaluated by the Cedar engine (`cedarpy`) against entities and a context the platform builds for
each decision (docs/policies.md):

    principal  User::"<username>"   tenant, username, roles; groups as parents (Group::"<name>");
                                    the attributes the tenant declares (refund_limit, region)
    action     Action::"<tool name>"  one per tool, each a member of Action::"call_tool", so that
                                    a tool's arguments are typed by its own schema
    resource   Tool::"<tool name>"  name, server, effect, the tenant's declared tool attributes
    context    arguments (the call's, typed by the tool's JSON schema), agent and version,
               run {spend, calls, tool_calls, calls_by_tool}, today {calls, amount, user_calls,
               user_amount}: this tool's totals in the tenant's local day before this call, read
               under the lock of approvals/totals.py; editor: the approver who corrected the call

Approval is an annotation: a `permit` carrying `@approval("why")` never permits anything; when
it is satisfied the call needs a person's approval. Every tenant policy carries `@id("...")`
(the name a denial gives) and may carry `@reason("...")` (the human reason the model is told);
the text of a policy never leaves the platform.

Errors fail closed: a forbid that cannot be evaluated (a value of an unexpected type) denies,
naming the policy; an @approval policy that cannot be evaluated requires approval.

Policy sets in shadow mode are evaluated the same way and their would-be decisions recorded
(ShadowDecision, a run event, a metric), never enforced.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import cedarpy
from django.db import connection
from prometheus_client import Counter

from approvals import tool_rules
from approvals.models import PolicyMode, PolicySet, TenantPolicies

CALL_TOOL = "call_tool"
START_RUN = "start_run"
APPROVE_CALL = "approve_call"


_LOOKUP: Any = object()  # "read the tenant's compiled policies" (tests hand theirs in)


def approve_action(tool_name: str) -> str:
    """The action of approving a call of one tool (a member of Action::"approve_call"), so that
    the call's arguments are typed by the tool's schema as for the call itself."""
    return f"{APPROVE_CALL}:{tool_name}"


SHADOW_DECISIONS = Counter(
    "agentplatform_policy_shadow_decisions",
    "Decisions of policy sets in shadow mode (recorded, not enforced), by set and outcome.",
    ["tenant", "policy_set", "outcome"],
)


class PolicyInputError(ValueError):
    """A call's arguments cannot be handed to Cedar (a number too large, or with a fraction too fine)."""


@dataclass(frozen=True)
class Decision:
    """Whether a call needs approval, and why (the reason is shown to the approver)."""

    required: bool
    reason: str
    policies: tuple[str, ...] = ()
    # How many distinct people must approve (the largest @approvers of the policies that fired),
    # and the text of each policy in `policies`, as it was when it decided (shown to the approver).
    approvers: int = 1
    texts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Denial:
    policy_id: str
    reason: str
    also: tuple[str, ...] = ()  # other forbids that held too

    def __str__(self) -> str:
        more = f" (also forbidden by {', '.join(self.also)})" if self.also else ""
        return f"denied by policy {self.policy_id}: {self.reason}{more}"


@dataclass(frozen=True)
class Shadow:
    policy_set: str
    outcome: str  # allow | deny | approval
    policies: tuple[str, ...]


@dataclass
class Verdict:
    denial: Denial | None = None
    approval: Decision = field(default_factory=lambda: Decision(False, "no approval policy applies"))
    shadow: list[Shadow] = field(default_factory=list)
    permits: tuple[str, ...] = ()  # the permits that allowed the call (not @approval ones)
    policy_version: int | None = None  # of the tenant's policies that decided (None: none)

    def deciding(self) -> tuple[str, ...]:
        """The ids of the policies that decided the call: the forbids that denied it, else the
        @approval policies that asked for a person, else the permits that allowed it."""
        if self.denial is not None:
            return (self.denial.policy_id, *self.denial.also)
        if self.approval.required:
            return self.approval.policies
        return self.permits


# --- compiled policies, cached per tenant and version ---------------------------------------------


@dataclass(frozen=True)
class _Part:
    """Policies of one kind from one or more sets, parsed once."""

    policies: cedarpy.PolicySet | None
    effects: dict  # policy id -> "permit" | "forbid"
    reasons: dict  # policy id -> human reason
    sources: dict = field(default_factory=dict)  # policy id -> its JSON form (to combine parts)
    approvers: dict = field(default_factory=dict)  # policy id -> @approvers (distinct people), if > 1


@dataclass(frozen=True)
class Compiled:
    version: int
    config: TenantPolicies
    enforce: _Part  # permits and forbids of enforced sets (with the default permit if any)
    approve: _Part  # @approval permits of enforced sets
    shadow: tuple[tuple[str, _Part, _Part], ...]  # (set name, enforce, approve)
    uses_spend: bool = True  # whether any policy reads context.run.spend (a query per call)
    # enforce and approve in one set, so that a call is decided by one evaluation (_decide)
    combined: _Part = _Part(None, {}, {})
    approval_ids: frozenset = frozenset()


class Unread:
    """The caller did not read the policy version: compiled() reads it."""


UNREAD = Unread()

_cache: dict[int, Compiled] = {}
_cache_lock = threading.Lock()


def compiled(tenant_id: int, *, version: int | None | Unread = UNREAD) -> Compiled | None:
    """The tenant's policies, parsed; None when the tenant has none.

    `version`: the tenant's policy version as the caller read it in this transaction (the
    engine's claim reads it with the run's lock: runs.models.ClaimReads), None for no policies;
    otherwise it is read here (one query).
    """
    if isinstance(version, Unread):
        with connection.cursor() as cursor:  # the ORM's query building costs more
            cursor.execute(
                f"SELECT version FROM {TenantPolicies._meta.db_table} WHERE tenant_id = %s", [tenant_id]
            )
            row = cursor.fetchone()
        version = row[0] if row is not None else None
    if version is None:
        return None
    found = _cache.get(tenant_id)
    if found is not None and found.version == version:
        return found
    config = TenantPolicies.objects.get(tenant_id=tenant_id)
    sets = [(s.name, s.mode, s.text) for s in PolicySet.objects.filter(tenant_id=tenant_id)]
    result = compile_sets(config, sets)
    with _cache_lock:
        _cache[tenant_id] = result
    return result


def compile_sets(config: TenantPolicies, sets: list[tuple[str, str, str]]) -> Compiled:
    """Parse (name, mode, text) sets: enforced ones together, each shadow set on its own."""
    enforced = [text for _, mode, text in sets if mode == PolicyMode.ENFORCE]
    # `default: deny` is about tool calls: starting a run and approving a call were already
    # granted by guardian (run_agent, approve_tool), which Cedar narrows and never widens.
    baseline = [
        f'@id("default-permit-start-and-approve")\npermit (principal, action in '
        f'[Action::"{START_RUN}", Action::"{APPROVE_CALL}"], resource);'
    ]
    if config.default == "permit":
        baseline.append('@id("default-permit")\npermit (principal, action, resource);')
    enforce, approve = split_policies("\n".join([*enforced, *baseline]))
    both = {**_sources(enforce), **_sources(approve)}
    combined = _part(both)
    shadow = tuple(
        (name, *split_policies("\n".join([text, *baseline])))
        for name, mode, text in sets
        if mode == PolicyMode.SHADOW
    )
    uses_spend = any("spend" in text for _, _, text in sets)
    return Compiled(
        config.version, config, enforce, approve, shadow, uses_spend, combined, frozenset(approve.effects)
    )


def split_policies(text: str) -> tuple[_Part, _Part]:
    """The permits and forbids, and the @approval permits, of a policy text, each parsed once."""
    est = json.loads(cedarpy.policies_to_json_str(text)) if text.strip() else {"staticPolicies": {}}
    deciding: dict = {}
    approving: dict = {}
    for generated, policy in est["staticPolicies"].items():
        annotations = policy.get("annotations") or {}
        policy_id = annotations.get("id") or generated
        (approving if "approval" in annotations else deciding)[policy_id] = policy
    return _part(deciding), _part(approving)


def _sources(part: _Part) -> dict:
    return part.sources


def _part(policies: dict) -> _Part:
    if not policies:
        return _Part(None, {}, {})
    handle = cedarpy.PolicySet.from_json_str(
        json.dumps({"staticPolicies": policies, "templates": {}, "templateLinks": []})
    )
    effects = {pid: p["effect"] for pid, p in policies.items()}
    reasons = {}
    approvers = {}
    for pid, p in policies.items():
        annotations = p.get("annotations") or {}
        reasons[pid] = annotations.get("approval") or annotations.get("reason") or f"policy {pid}"
        count = approvers_of(annotations)
        if count > 1:
            approvers[pid] = count
    return _Part(handle, effects, reasons, policies, approvers)


MAX_APPROVERS = 5


def approvers_of(annotations: dict) -> int:
    """The distinct approvers an @approval policy asks for: `@approvers("2")`; 1 without it.
    configuration/policies.py refuses any other value at apply; here a bad one counts as 1."""
    text = str(annotations.get("approvers") or "1").strip()
    return int(text) if text.isdigit() and 1 <= int(text) <= MAX_APPROVERS else 1


def policy_text(part: _Part, policy_id: str) -> str:
    """One policy's text, formatted by Cedar from its parsed form (its comments are not kept)."""
    source = part.sources.get(policy_id)
    if source is None:
        return ""
    one = {"staticPolicies": {policy_id: source}, "templates": {}, "templateLinks": []}
    return cedarpy.format_policies(cedarpy.policies_from_json_str(json.dumps(one))).strip()


def _asking(part: _Part, fired: list[str]) -> Decision:
    order = list(part.sources)
    fired = sorted(fired, key=lambda pid: order.index(pid) if pid in order else len(order))  # file order
    return Decision(
        True,
        "; ".join(part.reasons[pid] for pid in fired),
        tuple(fired),
        approvers=max((part.approvers.get(pid, 1) for pid in fired), default=1),
        texts=tuple(policy_text(part, pid) for pid in fired),
    )


@functools.lru_cache(maxsize=4096)
def rules_part(tool_name: str, texts: tuple[str, ...]) -> _Part:
    """The tool's approval rule and the version's override (approvals/tool_rules.py), parsed once."""
    policies = [tool_rules.policy(text, tool=tool_name, override=i > 0) for i, text in enumerate(texts)]
    return split_policies("\n".join(p for p in policies if p))[1]


# --- entities and context ------------------------------------------------------------------------


def uid(kind: str, name) -> dict:
    return {"type": kind, "id": str(name)}


def cedar_value(value):
    """A JSON argument value as Cedar JSON: null is left out (as if missing), lists are sets."""
    if isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if abs(value) > 2**63 - 1:
            raise PolicyInputError(f"{value} is larger than Cedar's 64-bit numbers")
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise PolicyInputError(f"{value} is not a number Cedar can compare")
        if value.is_integer():
            return cedar_value(int(value))
        text = str(Decimal(repr(value)).quantize(Decimal("0.0001")))
        # A fraction arrives as a Cedar decimal: comparing it with a whole number is an error,
        # which denies (forbid) or asks for approval (@approval) rather than passing silently.
        return {"__extn": {"fn": "decimal", "arg": text}}
    if isinstance(value, list):
        return [cedar_value(item) for item in value if item is not None]
    if isinstance(value, dict):
        return {str(k): cedar_value(v) for k, v in value.items() if v is not None}
    raise PolicyInputError(f"a {type(value).__name__} cannot be handed to Cedar")


def _declared(values: dict, types: dict) -> dict:
    attrs = {}
    for name, spec in types.items():
        value = values.get(name, spec.get("default"))
        if value is not None:
            attrs[name] = cedar_value(value)
    return attrs


def user_entity(user, config: TenantPolicies, groups: list[str]) -> dict:
    roles = sorted({role for g in groups for role in config.group_roles.get(g, [])})
    attrs = {"username": user.username, "tenant": str(user.tenant_id), "roles": roles}
    attrs.update(_declared(config.user_attributes.get(user.username, {}), config.user_attribute_types))
    return {"uid": uid("User", user.username), "attrs": attrs, "parents": [uid("Group", g) for g in groups]}


def tool_entity(tool, config: TenantPolicies) -> dict:
    server = tool.server.name if tool.server_id else ""
    attrs = {"name": tool.name, "server": server, "effect": tool.effect_class}
    attrs.update(_declared(config.tool_attributes.get(tool.name, {}), config.tool_attribute_types))
    return {"uid": uid("Tool", tool.name), "attrs": attrs, "parents": []}


@dataclass(frozen=True)
class History:
    """What the platform counted before this call: the run's, and this tool's today."""

    spend_micros: int = 0
    calls_by_tool: dict = field(default_factory=dict)
    today_calls: int = 0
    today_amount: int = 0
    user_calls: int = 0
    user_amount: int = 0
    by_argument: dict = field(default_factory=dict)  # argument -> (calls, amount) for this call's value


@dataclass
class CallRequest:
    """One call to decide: who asks, for which tool, with which arguments, after what history."""

    tenant_id: int
    user: Any  # tenants.models.User
    groups: list[str]
    tool: Any  # tools.models.Tool (above this app: its row is handed in)
    arguments: dict
    agent_name: str
    version_number: int
    history: History
    tool_names: list[str]
    editor: Any = None
    editor_groups: list[str] = field(default_factory=list)


def _request_and_entities(request: CallRequest, config: TenantPolicies):
    users = [user_entity(request.user, config, request.groups)]
    context = {
        "arguments": cedar_value(request.arguments or {}),
        "agent": {"__entity": uid("Agent", request.agent_name)},
        "version": request.version_number,
        "run": {
            "spend": request.history.spend_micros,
            "calls": request.history.calls_by_tool.get(request.tool.name, 0),
            "tool_calls": sum(request.history.calls_by_tool.values()),
            "calls_by_tool": {
                name: request.history.calls_by_tool.get(name, 0) for name in request.tool_names
            },
        },
        "today": {
            "calls": request.history.today_calls,
            "amount": request.history.today_amount,
            "user_calls": request.history.user_calls,
            "user_amount": request.history.user_amount,
        },
    }
    declared = config.totals_by.get(request.tool.name) if config.totals_by else None
    if declared:
        found = request.history.by_argument
        context["today"]["by_argument"] = {
            name: dict(zip(("calls", "amount"), found.get(name, (0, 0)), strict=True)) for name in declared
        }
    if request.editor is not None:
        if request.editor.username != request.user.username:
            users.append(user_entity(request.editor, config, request.editor_groups))
        context["editor"] = {"__entity": uid("User", request.editor.username)}
    groups = {g for g in request.groups} | set(request.editor_groups)
    entities = [
        *users,
        *({"uid": uid("Group", g), "attrs": {}, "parents": []} for g in sorted(groups)),
        tool_entity(request.tool, config),
        {
            "uid": uid("Agent", request.agent_name),
            "attrs": {"name": request.agent_name, "version": request.version_number},
            "parents": [],
        },
        {"uid": uid("Action", request.tool.name), "attrs": {}, "parents": [uid("Action", CALL_TOOL)]},
        {"uid": uid("Action", CALL_TOOL), "attrs": {}, "parents": []},
    ]
    cedar_request = {
        "principal": uid("User", request.user.username),
        "action": uid("Action", request.tool.name),
        "resource": uid("Tool", request.tool.name),
        "context": context,
    }
    return cedar_request, cedarpy.Entities.from_json_str(json.dumps(entities))


def _run_values(values, types: dict) -> dict:
    """The declared fields of a run's input or metadata (others are left out: the schema has no
    type for them); a field without a default is there only if the run has it."""
    return _declared(values if isinstance(values, dict) else {}, types)


def _group_entities(groups) -> list[dict]:
    return [{"uid": uid("Group", g), "attrs": {}, "parents": []} for g in sorted(set(groups))]


def _agent_entity(name: str, version: int) -> dict:
    return {"uid": uid("Agent", name), "attrs": {"name": name, "version": version}, "parents": []}


def evaluate_start(
    *,
    tenant_id: int,
    user,
    groups: Callable[[], list[str]],
    agent_name: str,
    version_number: int,
    input,
    metadata,
    policies=_LOOKUP,
) -> Denial | None:
    """Whether the tenant's policies forbid `user` starting a run of this agent version with this
    input and metadata (Action::"start_run", resource the Agent); None when they do not.
    `policies`: compiled sets to use instead of the tenant's (the file's policy tests)."""
    if policies is _LOOKUP:
        policies = compiled(tenant_id)
    if policies is None:
        return None
    types = policies.config.run_attribute_types or {}
    try:
        context = {
            "input": _run_values(input, types.get("input") or {}),
            "metadata": _run_values(metadata, types.get("metadata") or {}),
            "version": version_number,
        }
    except PolicyInputError as exc:
        return Denial("input", f"the run's input cannot be checked: {exc}")
    groups_read = groups()  # read only for a tenant with policies: most starts skip the query
    entities = [
        user_entity(user, policies.config, groups_read),
        *_group_entities(groups_read),
        _agent_entity(agent_name, version_number),
        {"uid": uid("Action", START_RUN), "attrs": {}, "parents": []},
    ]
    request = {
        "principal": uid("User", user.username),
        "action": uid("Action", START_RUN),
        "resource": uid("Agent", agent_name),
        "context": context,
    }
    return _deny_of(policies.enforce, request, cedarpy.Entities.from_json_str(json.dumps(entities)))


def evaluate_approval(
    *,
    tenant_id: int,
    approver,
    approver_groups: list[str],
    requester,
    requester_groups: list[str],
    tool,
    arguments: dict,
    agent_name: str,
    version_number: int,
    policies=_LOOKUP,
) -> Denial | None:
    """Whether the tenant's policies forbid `approver` approving this call (Action::
    "approve_call:<tool>", resource the Tool, the requester in the context); None when not."""
    if policies is _LOOKUP:
        policies = compiled(tenant_id)
    if policies is None:
        return None
    config = policies.config
    try:
        arguments_value = cedar_value(arguments or {})
    except PolicyInputError as exc:
        return Denial("arguments", f"the call's arguments cannot be checked: {exc}")
    users = [user_entity(approver, config, approver_groups)]
    if requester.username != approver.username:
        users.append(user_entity(requester, config, requester_groups))
    action = approve_action(tool.name)
    entities = [
        *users,
        *_group_entities([*approver_groups, *requester_groups]),
        tool_entity(tool, config),
        _agent_entity(agent_name, version_number),
        {"uid": uid("Action", action), "attrs": {}, "parents": [uid("Action", APPROVE_CALL)]},
        {"uid": uid("Action", APPROVE_CALL), "attrs": {}, "parents": []},
    ]
    request = {
        "principal": uid("User", approver.username),
        "action": uid("Action", action),
        "resource": uid("Tool", tool.name),
        "context": {
            "arguments": arguments_value,
            "requester": {"__entity": uid("User", requester.username)},
            "agent": {"__entity": uid("Agent", agent_name)},
            "version": version_number,
        },
    }
    return _deny_of(policies.enforce, request, cedarpy.Entities.from_json_str(json.dumps(entities)))


def _errored(result) -> list[str]:
    """Ids of the policies whose evaluation raised an error (Cedar names them in its message)."""
    found = []
    for message in result.diagnostics.errors:
        start = message.find("`")
        end = message.find("`", start + 1)
        if start >= 0 and end > start:
            found.append(message[start + 1 : end])
    return found


def _annotated(result, part: _Part, ids) -> list[str]:
    mapping = result.diagnostics.id_annotations_by_reason
    return [mapping.get(pid, pid) for pid in ids]


def _deny_of(part: _Part, request: dict, entities) -> Denial | None:
    if part.policies is None:
        return Denial("default-deny", "no policy permits this call")
    result = cedarpy.is_authorized(request, part.policies, entities)
    # Forbids that raised deny too: a forbid that cannot tell is not a permit.
    broken = [pid for pid in _errored(result) if part.effects.get(pid) == "forbid"]
    if broken:
        return Denial(
            broken[0], f"{part.reasons[broken[0]]} (the policy could not be evaluated on this call)"
        )
    if result.allowed:
        return None
    forbids = [pid for pid in result.diagnostics.reasons if part.effects.get(pid) == "forbid"]
    if forbids:
        return Denial(forbids[0], part.reasons[forbids[0]], tuple(forbids[1:]))
    return Denial("default-deny", "no policy permits this call")


def _approval_of(parts: list[_Part], request: dict, entities) -> Decision:
    decision = Decision(False, "no approval policy applies")
    for part in parts:
        if part.policies is None:
            continue
        result = cedarpy.is_authorized(request, part.policies, entities)
        # An @approval policy that raised asks for approval: odd arguments never skip one.
        fired = list(
            dict.fromkeys(
                pid
                for pid in [*result.diagnostics.reasons, *_errored(result)]
                if pid in part.reasons and pid not in decision.policies
            )
        )
        if fired:
            decision = _joined(decision, _asking(part, fired))
    return decision


def _decide(policies: Compiled, request: dict, entities) -> tuple[Denial | None, Decision, tuple[str, ...]]:
    """The enforced sets' denial and @approval decision from one evaluation of their union: when
    Cedar allows, its reasons are every permit that held, @approval ones included; an @approval
    permit never permits by itself, so "only @approval permits held" is a default deny."""
    part = policies.combined
    none = Decision(False, "no approval policy applies")
    if part.policies is None:
        return Denial("default-deny", "no policy permits this call"), none, ()
    result = cedarpy.is_authorized(request, part.policies, entities)
    errored = _errored(result)
    # Forbids that raised deny too: a forbid that cannot tell is not a permit.
    broken = [pid for pid in errored if part.effects.get(pid) == "forbid"]
    if broken:
        reason = f"{part.reasons[broken[0]]} (the policy could not be evaluated on this call)"
        return Denial(broken[0], reason), none, ()
    reasons = list(result.diagnostics.reasons)
    if not result.allowed:
        forbids = [pid for pid in reasons if part.effects.get(pid) == "forbid"]
        if forbids:
            return Denial(forbids[0], part.reasons[forbids[0]], tuple(forbids[1:])), none, ()
        return Denial("default-deny", "no policy permits this call"), none, ()
    permits = tuple(pid for pid in reasons if pid not in policies.approval_ids)
    if not permits:
        return Denial("default-deny", "no policy permits this call"), none, ()
    # An @approval policy that raised asks for approval: odd arguments never skip one.
    fired = list(dict.fromkeys(pid for pid in [*reasons, *errored] if pid in policies.approval_ids))
    if not fired:
        return None, none, permits
    return None, _asking(part, fired), permits


def _joined(first: Decision, second: Decision) -> Decision:
    if not first.required:
        return second
    return Decision(
        True,
        f"{first.reason}; {second.reason}",
        (*first.policies, *second.policies),
        approvers=max(first.approvers, second.approvers),
        texts=(*first.texts, *second.texts),
    )


def evaluate(
    request: CallRequest, *, rules: tuple[str, ...] = (), with_approval: bool = True, policies=_LOOKUP
) -> Verdict:
    """Decide one call: forbid wins, then @approval; shadow sets are evaluated alongside.
    `rules`: the tool's approval rule and the version's override (approvals/tool_rules.py).
    `policies`: compiled sets to use instead of the tenant's (the file's policy tests)."""
    if policies is _LOOKUP:
        policies = compiled(request.tenant_id)
    rule_policies = rules_part(request.tool.name, rules) if any(t.strip() for t in rules) else None
    if rule_policies is not None and rule_policies.policies is None:
        # `never` is no policy: nothing to ask, so an argument Cedar cannot take (a number past
        # its 64 bits) must not turn into an approval of a call no rule covers.
        rule_policies = None
    if policies is None:
        verdict = Verdict()
        if with_approval and rule_policies is not None:
            try:
                cedar_request, entities = _request_and_entities(request, TenantPolicies())
            except PolicyInputError as exc:
                # Fails closed like an @approval policy that cannot be evaluated: a person decides.
                verdict.approval = Decision(True, f"the call's arguments cannot be checked: {exc}")
                return verdict
            verdict.approval = _approval_of([rule_policies], cedar_request, entities)
        return verdict
    try:
        cedar_request, entities = _request_and_entities(request, policies.config)
    except PolicyInputError as exc:
        unreadable = Denial("arguments", f"the call's arguments cannot be checked: {exc}")
        return Verdict(denial=unreadable, policy_version=policies.version)
    denial, approval, permits = _decide(policies, cedar_request, entities)
    verdict = Verdict(denial=denial, permits=permits, policy_version=policies.version)
    if with_approval and denial is None:
        verdict.approval = approval
        if rule_policies is not None:
            rule_approval = _approval_of([rule_policies], cedar_request, entities)
            if rule_approval.required:
                verdict.approval = _joined(approval, rule_approval)
    for name, enforce, approve in policies.shadow:
        denial = _deny_of(enforce, cedar_request, entities)
        if denial is not None:
            verdict.shadow.append(Shadow(name, "deny", (denial.policy_id,)))
            continue
        approval = _approval_of([approve], cedar_request, entities)
        outcome = "approval" if approval.required else "allow"
        verdict.shadow.append(Shadow(name, outcome, approval.policies))
    return verdict


def rule_decision(rule: str, arguments: dict, *, tool: str = "tool", override: str = "") -> Decision:
    """Whether a tool's approval rule (and a version's override) asks for approval of a call with
    these arguments, by no one in particular: the rules on their own, without the tenant's sets."""
    part = rules_part(tool, (rule, override))
    try:
        context = {"arguments": cedar_value(arguments)}
    except PolicyInputError as exc:
        return Decision(True, f"the arguments cannot be checked: {exc}")
    request = {"principal": uid("User", "u"), "action": uid("Action", tool), "resource": uid("Tool", tool)}
    entities = cedarpy.Entities.from_json_str("[]")
    return _approval_of([part], {**request, "context": context}, entities)
