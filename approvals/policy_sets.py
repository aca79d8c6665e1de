"""A tenant's Cedar policies as its configuration file states them: the schema the platform
generates for them, validation, the policy tests of the file, and installing them.

    cedar_schema(tenant, spec)   the Cedar schema (JSON form) of the tenant's entities, actions
                                 and context (approvals/cedar.py), from its tools' JSON schemas
                                 and the attributes the file declares
    check(tenant, spec)          every problem, each with its file and line and the policy's @id:
                                 a policy that does not parse, one the Cedar validator refuses
                                 (its message), a policy without @id, one that names a group,
                                 user, tool, agent, role or attribute the tenant does not have
                                 (Cedar's validator knows types, not which entities exist: such a
                                 policy would match nothing, silently), a policy test whose
                                 decision differs
    notes(tenant, spec)          policies that are valid but match no one today (a group with
                                 no members, an inactive user): apply reports them, not refuses
    install(tenant, spec)        write the sets and settings; the compiled cache follows `version`

configuration/policies.py reads the file's `policies:` section into a PolicySpec and calls these
inside apply's one transaction (nothing is applied on error); `manage.py policy test` runs
`check` without writing.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import cedarpy
from django.db import models
from django.db.models import F

from agents.models import AgentDefinition
from approvals import cedar
from approvals.models import PolicyMode, PolicySet, TenantPolicies
from tenants.models import TenantGroup, User
from tools.models import Tool

_TYPES = {"long": {"type": "Long"}, "string": {"type": "String"}, "bool": {"type": "Boolean"}}
_SET = {"type": "Set", "element": {"type": "String"}}


@dataclass
class SourceSet:
    name: str
    text: str
    mode: str = PolicyMode.ENFORCE
    source: str = ""  # the file the text is in
    first_line: int = 1  # the text's first line in that file
    private: bool = False
    path: str = ""  # where in the configuration file it was declared


@dataclass
class PolicyTest:
    name: str
    principal: str
    tool: str  # "" for a start_run test
    expect: str  # allow | deny | approval
    action: str = cedar.CALL_TOOL  # call_tool | start_run | approve_call
    input: dict = field(default_factory=dict)  # start_run: the run's input and metadata
    metadata: dict = field(default_factory=dict)
    requester: str = ""  # approve_call: who asked (the principal is the approver)
    arguments: dict = field(default_factory=dict)
    policy: str = ""  # the policy id expected to decide, if given
    today: dict = field(default_factory=dict)
    run: dict = field(default_factory=dict)
    editor: str = ""
    agent: str = "agent"
    version: int = 1
    path: str = ""


@dataclass
class PolicySpec:
    default: str = "permit"
    user_attribute_types: dict = field(default_factory=dict)  # name -> {"type": ..., "default": ...}
    user_attributes: dict = field(default_factory=dict)
    tool_attribute_types: dict = field(default_factory=dict)
    tool_attributes: dict = field(default_factory=dict)
    totals: dict = field(default_factory=dict)
    totals_by: dict = field(default_factory=dict)  # tool -> [argument] whose values are totalled apart
    run_attribute_types: dict = field(default_factory=dict)  # {"input": {...}, "metadata": {...}}
    group_roles: dict = field(default_factory=dict)
    sets: list[SourceSet] = field(default_factory=list)
    tests: list[PolicyTest] = field(default_factory=list)

    def config(self, tenant, tool_names=()) -> TenantPolicies:
        return TenantPolicies(
            tool_names=sorted(tool_names),
            tenant=tenant,
            default=self.default,
            user_attribute_types=self.user_attribute_types,
            user_attributes=self.user_attributes,
            group_roles=self.group_roles,
            tool_attribute_types=self.tool_attribute_types,
            tool_attributes=self.tool_attributes,
            totals=self.totals,
            totals_by=self.totals_by,
            run_attribute_types=self.run_attribute_types,
        )


# --- the schema ----------------------------------------------------------------------------------


def _declared_shape(types: dict, fixed: dict) -> dict:
    attributes = dict(fixed)
    for name, spec in types.items():
        kind = _SET if spec["type"] == "set" else _TYPES[spec["type"]]
        attributes[name] = {**kind, "required": "default" in spec}
    return {"type": "Record", "attributes": attributes}


def json_schema_type(schema) -> dict | None:
    """The Cedar type of a JSON schema, or None where Cedar has none (left out of the context)."""
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if len(kinds) == 1 else None
    if kind in ("integer", "number"):
        return {"type": "Long"}
    if kind == "string":
        return {"type": "String"}
    if kind == "boolean":
        return {"type": "Boolean"}
    if kind == "array":
        element = json_schema_type(schema.get("items"))
        return {"type": "Set", "element": element} if element else None
    if kind == "object" or "properties" in schema:
        required = set(schema.get("required") or [])
        attributes = {}
        for name, sub in (schema.get("properties") or {}).items():
            sub_type = json_schema_type(sub)
            if sub_type is not None:
                attributes[name] = {**sub_type, "required": name in required}
        return {"type": "Record", "attributes": attributes}
    return None


def cedar_schema(tenant, spec: PolicySpec, tools: list | None = None) -> dict:
    tools = tools if tools is not None else list(Tool.objects.filter(tenant=tenant).select_related("server"))
    names = [t.name for t in tools]
    history = {
        "run": {
            "type": "Record",
            "attributes": {
                "spend": {"type": "Long"},
                "calls": {"type": "Long"},
                "tool_calls": {"type": "Long"},
                "calls_by_tool": {"type": "Record", "attributes": {n: {"type": "Long"} for n in names}},
            },
        },
    }
    today = {k: {"type": "Long"} for k in ("calls", "amount", "user_calls", "user_amount")}
    counts = {"type": "Record", "attributes": {"calls": {"type": "Long"}, "amount": {"type": "Long"}}}
    runs = spec.run_attribute_types
    actions: dict = {
        cedar.CALL_TOOL: {},
        cedar.APPROVE_CALL: {},
        cedar.START_RUN: {
            "appliesTo": {
                "principalTypes": ["User"],
                "resourceTypes": ["Agent"],
                "context": {
                    "type": "Record",
                    "attributes": {
                        "input": _declared_shape(runs.get("input") or {}, {}),
                        "metadata": _declared_shape(runs.get("metadata") or {}, {}),
                        "version": {"type": "Long"},
                    },
                },
            }
        },
    }
    for tool in tools:
        arguments = json_schema_type(tool.input_schema or {"type": "object"}) or {
            "type": "Record",
            "attributes": {},
        }
        by_argument = spec.totals_by.get(tool.name) or []
        today_shape = {
            **today,
            **(
                {"by_argument": {"type": "Record", "attributes": {n: counts for n in by_argument}}}
                if by_argument
                else {}
            ),
        }
        context = {
            "arguments": arguments,
            "agent": {"type": "Entity", "name": "Agent"},
            "version": {"type": "Long"},
            **history,
            "today": {"type": "Record", "attributes": today_shape},
            "editor": {"type": "Entity", "name": "User", "required": False},
        }
        actions[tool.name] = {
            "memberOf": [{"id": cedar.CALL_TOOL}],
            "appliesTo": {
                "principalTypes": ["User"],
                "resourceTypes": ["Tool"],
                "context": {"type": "Record", "attributes": context},
            },
        }
        actions[cedar.approve_action(tool.name)] = {
            "memberOf": [{"id": cedar.APPROVE_CALL}],
            "appliesTo": {
                "principalTypes": ["User"],
                "resourceTypes": ["Tool"],
                "context": {
                    "type": "Record",
                    "attributes": {
                        "arguments": arguments,
                        "requester": {"type": "Entity", "name": "User"},
                        "agent": {"type": "Entity", "name": "Agent"},
                        "version": {"type": "Long"},
                    },
                },
            },
        }
    user_fixed = {"username": {"type": "String"}, "tenant": {"type": "String"}, "roles": _SET}
    tool_fixed = {"name": {"type": "String"}, "server": {"type": "String"}, "effect": {"type": "String"}}
    entity_types = {
        "Group": {},
        "User": {"memberOfTypes": ["Group"], "shape": _declared_shape(spec.user_attribute_types, user_fixed)},
        "Tool": {"shape": _declared_shape(spec.tool_attribute_types, tool_fixed)},
        "Agent": {
            "shape": {
                "type": "Record",
                "attributes": {"name": {"type": "String"}, "version": {"type": "Long"}},
            }
        },
    }
    return {"": {"entityTypes": entity_types, "actions": actions}}


# --- checking ------------------------------------------------------------------------------------


def statements(text: str) -> list[tuple[int, str]]:
    """The policies of a text, each with the line it starts on (1-based): split at `;` outside
    strings and comments, so that an error can be placed in the file."""
    found = []
    start, line, start_line = 0, 1, None
    i = 0
    while i < len(text):
        char = text[i]
        if char == "\n":
            line += 1
        elif char == '"':
            i += 1
            while i < len(text) and text[i] != '"':
                if text[i] == "\\":
                    i += 1
                elif text[i] == "\n":
                    line += 1
                i += 1
        elif text.startswith("//", i):
            while i < len(text) and text[i] != "\n":
                i += 1
            continue
        elif not char.isspace() and start_line is None:
            start_line = line
        if char == ";" and start_line is not None:
            found.append((start_line, text[start : i + 1]))
            start, start_line = i + 1, None
        i += 1
    if start_line is not None and text[start:].strip():
        found.append((start_line, text[start:]))
    return found


def sources_of(tenant_id: int, ids: list[str]) -> dict[str, str]:
    """Policy id -> its text as written in the tenant's enforced sets (comments and layout kept),
    for the approval page; read when an approval is requested, never on the dispatch path."""
    found: dict[str, str] = {}
    wanted = set(ids)
    for text in PolicySet.objects.filter(tenant_id=tenant_id, mode=PolicyMode.ENFORCE).values_list(
        "text", flat=True
    ):
        for _, statement in statements(text):
            if not wanted - set(found):
                return found
            try:
                est = json.loads(cedarpy.policies_to_json_str(statement))
            except ValueError:
                continue
            for policy in est["staticPolicies"].values():
                policy_id = (policy.get("annotations") or {}).get("id")
                if policy_id in wanted:
                    found[policy_id] = statement.strip()
    return found


_PLACE = re.compile(r"policy(\d+)")


def _where(source_set: SourceSet, line: int) -> str:
    return f"{source_set.source or source_set.path}:{source_set.first_line + line - 1}"


def check_set(source_set: SourceSet, schema: dict, entities: Entities | None = None) -> list[tuple[str, str]]:
    """Parse and validate one set; each problem at its file and line, with Cedar's message and the
    policy's @id. With `entities`, every group, user, tool, agent, role and attribute a policy
    names must exist in the tenant."""
    problems = []
    parts = statements(source_set.text)
    ids: dict[str, str] = {}
    parsed: list[tuple[int, str, dict]] = []  # (line, @id, policy) in the order Cedar numbers them
    for line, text in parts:
        try:
            est = json.loads(cedarpy.policies_to_json_str(text))
        except ValueError as exc:
            problems.append((_where(source_set, line), f"Cedar cannot parse this policy: {exc}"))
            continue
        for policy in est["staticPolicies"].values():
            annotations = policy.get("annotations") or {}
            policy_id = annotations.get("id")
            if not policy_id:
                problems.append((_where(source_set, line), 'every policy needs @id("...")'))
            elif policy_id in ids:
                problems.append((_where(source_set, line), f"@id {policy_id!r} is used twice"))
            elif "approval" in annotations and policy["effect"] != "permit":
                problems.append(
                    (_where(source_set, line), f"policy {policy_id!r}: @approval is for permit policies")
                )
            elif "approvers" in annotations and (
                "approval" not in annotations
                or str(annotations["approvers"]) != str(cedar.approvers_of(annotations))
            ):
                problems.append(
                    (
                        _where(source_set, line),
                        f"policy {policy_id!r}: @approvers goes with @approval and is a whole number "
                        f'from 1 to {cedar.MAX_APPROVERS} ("2": two distinct people approve)',
                    )
                )
            else:
                ids[policy_id] = text
                parsed.append((line, policy_id, policy))
    if problems:
        return problems
    result = cedarpy.validate_policies(source_set.text, json.dumps(schema))
    for error in result.errors:
        # Cedar numbers the policies of a text policy0, policy1, ...: name the @id instead.
        match = _PLACE.fullmatch(error.policy_id or "")
        index = int(match.group(1)) if match else -1
        line, policy_id = (parsed[index][0], parsed[index][1]) if 0 <= index < len(parsed) else (1, "")
        message = _PLACE.sub(policy_id, error.error) if policy_id else error.error
        named = f"policy {policy_id!r}: " if policy_id else ""
        problems.append((_where(source_set, line), f"{named}Cedar's validator: {message}"))
    if entities is not None and not problems:
        for line, policy_id, policy in parsed:
            for message in entities.unknown(policy):
                problems.append((_where(source_set, line), f"policy {policy_id!r}: {message}"))
    return problems


def check(tenant, spec: PolicySpec) -> list[tuple[str, str]]:
    """Every problem of the spec against the tenant as it now stands (see the module's opening)."""
    tools = list(Tool.objects.filter(tenant=tenant).select_related("server"))
    schema = cedar_schema(tenant, spec, tools)
    entities = Entities.of(tenant, spec, tools)
    problems = _check_totals(spec, {t.name: t for t in tools})
    seen: dict[str, str] = {}
    for source_set in spec.sets:
        problems += check_set(source_set, schema, entities)
        for _, text in statements(source_set.text):
            for policy_id in re.findall(r'@id\(\s*"([^"]*)"', text):
                if policy_id in seen and seen[policy_id] != source_set.name:
                    problems.append((source_set.path, f"@id {policy_id!r} is also in set {seen[policy_id]}"))
                seen[policy_id] = source_set.name
    if problems:
        return problems
    return run_tests(tenant, spec, tools)


# --- what a policy may name ----------------------------------------------------------------------

# The Cedar type an expression has, where the schema gives it one entity type; `resource` is a
# Tool for tool actions and an Agent for start_run, so it may name either's attributes.
_VAR_TYPES = {"principal": ("User",), "resource": ("Tool", "Agent")}
_CONTEXT_TYPES = {"editor": ("User",), "requester": ("User",), "agent": ("Agent",)}
_KINDS = {"Group": "group", "User": "user", "Tool": "tool", "Agent": "agent"}


@dataclass(frozen=True)
class Entities:
    """What a tenant's policies may name: its entities by Cedar type, the attributes of each type,
    the arguments of its tools, the run fields declared, and the roles its groups give."""

    ids: dict[str, frozenset[str]]
    attributes: dict[str, frozenset[str]]
    arguments: frozenset[str]
    run_fields: dict[str, frozenset[str]]
    roles: frozenset[str]

    @classmethod
    def of(cls, tenant, spec: PolicySpec, tools: list) -> Entities:
        return cls(
            ids={
                "Group": frozenset(TenantGroup.objects.filter(tenant=tenant).values_list("name", flat=True)),
                "User": frozenset(User.objects.filter(tenant=tenant).values_list("username", flat=True)),
                "Tool": frozenset(t.name for t in tools),
                "Agent": frozenset(
                    AgentDefinition.objects.filter(tenant=tenant).values_list("name", flat=True)
                ),
            },
            attributes={
                "User": frozenset({"username", "tenant", "roles", *spec.user_attribute_types}),
                "Tool": frozenset({"name", "server", "effect", *spec.tool_attribute_types}),
                "Agent": frozenset({"name", "version"}),
            },
            arguments=frozenset(
                name for t in tools for name in ((t.input_schema or {}).get("properties") or {})
            ),
            run_fields={kind: frozenset(fields) for kind, fields in spec.run_attribute_types.items()},
            roles=frozenset(role for roles in spec.group_roles.values() for role in roles),
        )

    def unknown(self, policy: dict) -> list[str]:
        """What `policy` (Cedar's JSON form) names that the tenant does not have, once each."""
        found: list[str] = []
        for key, node in _nodes(policy):
            message = None
            if key in ("entity", "__entity") and isinstance(node, dict):
                message = self._entity(node)
            elif key == "entities" and isinstance(node, list):
                for entity in node:
                    found += [m for m in [self._entity(entity)] if m and m not in found]
            elif key == "has" and isinstance(node, dict):
                message = self._attribute(node.get("left"), node.get("attr"))
            elif key in ("contains", "containsAll", "containsAny") and isinstance(node, dict):
                message = self._role(node)
            if message and message not in found:
                found.append(message)
        return found

    def _entity(self, uid: dict) -> str | None:
        kind, name = str(uid.get("type")), str(uid.get("id"))
        known = self.ids.get(kind)
        if known is None or name in known:
            return None  # Action::"..." and types the schema lacks are the validator's
        return f"no {_KINDS[kind]} {name!r} in this tenant{_close(name, known)} (it would match nothing)"

    def _attribute(self, left, attr) -> str | None:
        """`x has attr` where x's type has no such attribute is false for every request."""
        if not isinstance(attr, str):
            return None
        if isinstance(left, dict) and left.get("Var") in _VAR_TYPES:
            types, what = _VAR_TYPES[left["Var"]], left["Var"]
        else:
            owner = _context_field(left)
            if owner in _CONTEXT_TYPES:
                types, what = _CONTEXT_TYPES[owner], f"context.{owner}"
            elif owner == "arguments":
                if attr in self.arguments:
                    return None
                return f"no tool of this tenant has an argument {attr!r}{_close(attr, self.arguments)} (`has` is always false)"
            elif owner in ("input", "metadata"):
                declared = self.run_fields.get(owner, frozenset())
                if attr in declared:
                    return None
                return f"{attr!r} is not declared under policies.attributes.{owner}{_close(attr, declared)} (`has` is always false)"
            else:
                return None
        known = frozenset().union(*(self.attributes[t] for t in types))
        if attr in known:
            return None
        return f"{what} has no attribute {attr!r}{_close(attr, known)}; declare it under policies.attributes (`has` is always false)"

    def _role(self, node: dict) -> str | None:
        """`principal.roles.contains("r")` for a role no group gives is false for everyone."""
        left = node.get("left")
        if not (isinstance(left, dict) and left.get(".", {}).get("attr") == "roles"):
            return None
        right = node.get("right") or {}
        values = right.get("Set") if isinstance(right, dict) and "Set" in right else [right]
        for value in values or []:
            role = value.get("Value") if isinstance(value, dict) else None
            if isinstance(role, str) and role not in self.roles:
                return f"no group of this tenant gives the role {role!r}{_close(role, self.roles)}"
        return None


def _nodes(tree) -> Iterator[tuple[str, object]]:
    """Every (key, value) pair in a JSON tree, depth first."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield key, value
            yield from _nodes(value)
    elif isinstance(tree, list):
        for item in tree:
            yield from _nodes(item)


def _context_field(node) -> str | None:
    """ "editor" for `context.editor`; None for anything else."""
    if isinstance(node, dict) and isinstance(node.get("."), dict):
        access = node["."]
        if access.get("left") == {"Var": "context"}:
            return access.get("attr")
    return None


def _close(name: str, known) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def notes(tenant, spec: PolicySpec) -> list[str]:
    """Valid policies that match no one today: scoped to a group with no active member, or to an
    inactive user. Reported by apply, not refused: members may be added later."""
    active = dict(
        TenantGroup.objects.filter(tenant=tenant)
        .values_list("name")
        .annotate(n=models.Count("group__user", filter=models.Q(group__user__is_active=True)))
    )
    inactive = set(User.objects.filter(tenant=tenant, is_active=False).values_list("username", flat=True))
    found = []
    for source_set in spec.sets:
        for line, text in statements(source_set.text):
            try:
                est = json.loads(cedarpy.policies_to_json_str(text))
            except ValueError:
                continue  # check() reports it
            for policy in est["staticPolicies"].values():
                policy_id = (policy.get("annotations") or {}).get("id", "")
                scope = policy.get("principal") or {}
                uid = scope.get("entity") or {}
                where = _where(source_set, line)
                if uid.get("type") == "Group" and active.get(uid.get("id")) == 0:
                    found.append(
                        f"{where}: policy {policy_id!r} applies to group {uid['id']!r}, which has no active member"
                    )
                elif uid.get("type") == "User" and uid.get("id") in inactive:
                    found.append(
                        f"{where}: policy {policy_id!r} applies to user {uid['id']!r}, who is inactive"
                    )
    return found


def _check_totals(spec: PolicySpec, tools: dict) -> list[tuple[str, str]]:
    """Totals name tools of the tenant and arguments of their schemas."""
    problems = []
    for kind, declared in (("total", spec.totals), ("by", spec.totals_by)):
        for name, arguments in declared.items():
            path = f"policies.tools.{name}.{kind}"
            tool = tools.get(name)
            if tool is None:
                problems.append((path, f"no tool {name} in this tenant"))
                continue
            properties = (tool.input_schema or {}).get("properties") or {}
            for argument in [arguments] if isinstance(arguments, str) else arguments:
                if argument not in properties:
                    problems.append((path, f"{argument!r} is not an argument of {name}"))
    return problems


def run_tests(tenant, spec: PolicySpec, tools: list) -> list[tuple[str, str]]:
    """The file's policy tests: each request's decision (with the enforced sets) as expected."""
    by_name = {t.name: t for t in tools}
    config = spec.config(tenant, by_name)
    sets = [(s.name, s.mode, s.text) for s in spec.sets]
    policies = cedar.compile_sets(config, sets)
    problems = []
    for test in spec.tests:
        if test.action != cedar.CALL_TOOL:
            problems += _run_action_test(tenant, test, by_name, policies)
            continue
        tool = by_name.get(test.tool)
        user = User.objects.filter(tenant=tenant, username=test.principal).first()
        if tool is None or user is None:
            missing = f"tool {test.tool}" if tool is None else f"user {test.principal}"
            problems.append((test.path, f"test {test.name}: no {missing} in this tenant"))
            continue
        editor = User.objects.filter(tenant=tenant, username=test.editor).first() if test.editor else None
        request = cedar.CallRequest(
            tenant_id=tenant.pk,
            user=user,
            groups=_groups(user),
            tool=tool,
            arguments=test.arguments,
            agent_name=test.agent,
            version_number=test.version,
            history=cedar.History(
                spend_micros=int(test.run.get("spend", 0)),
                calls_by_tool={test.tool: int(test.run.get("calls", 0))},
                today_calls=int(test.today.get("calls", 0)),
                today_amount=int(test.today.get("amount", 0)),
                user_calls=int(test.today.get("user_calls", 0)),
                user_amount=int(test.today.get("user_amount", 0)),
                by_argument={
                    name: (int(counts.get("calls", 0)), int(counts.get("amount", 0)))
                    for name, counts in (test.today.get("by_argument") or {}).items()
                },
            ),
            tool_names=list(by_name),
            editor=editor,
            editor_groups=_groups(editor) if editor else [],
        )
        verdict = cedar.evaluate(request, rules=(tool.approval_policy or "never",), policies=policies)
        got, deciding = outcome(verdict)
        if got != test.expect or (test.policy and test.policy not in deciding):
            said = f"{got}" + (f" by {', '.join(deciding)}" if deciding else "")
            wanted = test.expect + (f" by {test.policy}" if test.policy else "")
            problems.append((test.path, f"test {test.name}: expected {wanted}, got {said}"))
    return problems


def _run_action_test(
    tenant, test: PolicyTest, tools: dict, policies: cedar.Compiled
) -> list[tuple[str, str]]:
    """A start_run or approve_call test: allow or deny, by the enforced sets."""
    users = {
        u.username: u
        for u in User.objects.filter(tenant=tenant, username__in=[test.principal, test.requester])
    }
    principal = users.get(test.principal)
    if principal is None:
        return [(test.path, f"test {test.name}: no user {test.principal} in this tenant")]
    if test.action == cedar.START_RUN:
        denial = cedar.evaluate_start(
            tenant_id=tenant.pk,
            user=principal,
            groups=lambda: _groups(principal),
            agent_name=test.agent,
            version_number=test.version,
            input=test.input,
            metadata=test.metadata,
            policies=policies,
        )
    else:
        tool, requester = tools.get(test.tool), users.get(test.requester)
        if tool is None or requester is None:
            missing = f"tool {test.tool}" if tool is None else f"user {test.requester or '(requester)'}"
            return [(test.path, f"test {test.name}: no {missing} in this tenant")]
        denial = cedar.evaluate_approval(
            tenant_id=tenant.pk,
            approver=principal,
            approver_groups=_groups(principal),
            requester=requester,
            requester_groups=_groups(requester),
            tool=tool,
            arguments=test.arguments,
            agent_name=test.agent,
            version_number=test.version,
            policies=policies,
        )
    got, deciding = ("deny", (denial.policy_id, *denial.also)) if denial else ("allow", ())
    if got != test.expect or (test.policy and test.policy not in deciding):
        said = f"{got}" + (f" by {', '.join(deciding)}" if deciding else "")
        wanted = test.expect + (f" by {test.policy}" if test.policy else "")
        return [(test.path, f"test {test.name}: expected {wanted}, got {said}")]
    return []


def outcome(verdict: cedar.Verdict) -> tuple[str, tuple[str, ...]]:
    if verdict.denial is not None:
        return "deny", (verdict.denial.policy_id, *verdict.denial.also)
    if verdict.approval.required:
        return "approval", verdict.approval.policies
    return "allow", ()


def _groups(user) -> list[str]:
    return sorted(TenantGroup.objects.filter(group__user=user).values_list("name", flat=True))


# --- installing ----------------------------------------------------------------------------------


def install(tenant, spec: PolicySpec) -> list[str]:
    """Write the spec (after `check` found nothing); what changed, for apply's report."""
    changes = []
    config = spec.config(tenant, Tool.objects.filter(tenant=tenant).values_list("name", flat=True))
    values = {
        name: getattr(config, name)
        for name in (
            "default",
            "user_attribute_types",
            "user_attributes",
            "group_roles",
            "tool_attribute_types",
            "tool_attributes",
            "totals",
            "totals_by",
            "run_attribute_types",
            "tool_names",
        )
    }
    row, created = TenantPolicies.objects.get_or_create(tenant=tenant, defaults=values)
    settings_changed = not created and any(getattr(row, k) != v for k, v in values.items())
    if settings_changed:
        TenantPolicies.objects.filter(pk=row.pk).update(**values)
        changes.append("updated policy settings")
    elif created:
        changes.append("created policy settings")
    existing = {s.name: s for s in PolicySet.objects.filter(tenant=tenant)}
    for source_set in spec.sets:
        fields = {
            "mode": source_set.mode,
            "text": source_set.text,
            "source": source_set.source,
            "first_line": source_set.first_line,
            "private": source_set.private,
        }
        current = existing.pop(source_set.name, None)
        if current is None:
            PolicySet.objects.create(tenant=tenant, name=source_set.name, **fields)
            changes.append(f"created policy set {source_set.name} ({source_set.mode})")
        elif any(getattr(current, k) != v for k, v in fields.items()):
            PolicySet.objects.filter(pk=current.pk).update(**fields)
            changes.append(f"updated policy set {source_set.name} ({source_set.mode})")
    for name, gone in existing.items():
        gone.delete()
        changes.append(f"removed policy set {name}")
    if changes and not created:
        TenantPolicies.objects.filter(pk=row.pk).update(version=F("version") + 1)
    return changes
