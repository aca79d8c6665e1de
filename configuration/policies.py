"""The `policies:` section of a tenant's file: Cedar policy sets (inline, or `.cedar` files beside
the file), declared attributes, totals, and policy tests (docs/policies.md).

    read(data, problems, source)   the section's shape into a PolicySpec, errors with their path
    apply(tenant, spec, problems)  inside apply's transaction, after the rows are written: the
                                   sets validated against the generated schema, the tests run
                                   (with the tools' approval rules), then installed; any problem
                                   rolls everything back
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from approvals.models import PolicyMode
from approvals.policy_sets import PolicySpec, PolicyTest, SourceSet, check, install, notes

KEYS = {"default", "attributes", "users", "tools", "sets", "tests"}
ATTRIBUTE_TYPES = {"long", "string", "bool", "set"}
RESERVED = {
    "user": {"username", "tenant", "roles"},
    "tool": {"name", "server", "effect"},
    "input": set(),
    "metadata": set(),
}
ACTIONS = {"call_tool", "start_run", "approve_call"}
OUTCOMES = {"allow", "deny", "approval"}


def read(data: Any, groups: Any, problems, source: str | None) -> PolicySpec | None:
    if data is None:
        return None
    if not isinstance(data, dict):
        problems.add("policies", "must be a mapping (docs/policies.md)")
        return None
    for key in data:
        if key not in KEYS:
            problems.add(f"policies.{key}", f"unknown key; one of {', '.join(sorted(KEYS))}")
    spec = PolicySpec()
    default = data.get("default", "permit")
    if default not in ("permit", "deny"):
        problems.add("policies.default", "permit or deny")
    spec.default = default
    attributes = data.get("attributes") or {}
    for kind in ("user", "tool"):
        declared = _attribute_types(attributes.get(kind) or {}, f"policies.attributes.{kind}", kind, problems)
        setattr(spec, f"{kind}_attribute_types", declared)
    for kind in ("input", "metadata"):  # the run's fields start_run policies read
        declared = _attribute_types(attributes.get(kind) or {}, f"policies.attributes.{kind}", kind, problems)
        if declared:
            spec.run_attribute_types[kind] = declared
    for kind in attributes if isinstance(attributes, dict) else ():
        if kind not in RESERVED:
            problems.add(f"policies.attributes.{kind}", f"unknown kind; one of {', '.join(sorted(RESERVED))}")
    spec.user_attributes = _values(
        data.get("users") or {}, "policies.users", spec.user_attribute_types, problems
    )
    tools = data.get("tools") or {}
    if not isinstance(tools, dict):
        problems.add("policies.tools", "must map tool names to {attributes, total, by}")
        tools = {}
    raw_values = {}
    for name, entry in tools.items():
        if not isinstance(entry, dict):
            problems.add(f"policies.tools.{name}", "must be a mapping with attributes, total and/or by")
            continue
        raw_values[name] = entry.get("attributes") or {}
        if entry.get("total") is not None:
            if not isinstance(entry["total"], str):
                problems.add(f"policies.tools.{name}.total", "the name of a number argument")
            else:
                spec.totals[name] = entry["total"]
        by = entry.get("by")
        if by is not None:
            if not isinstance(by, list) or not by or not all(isinstance(a, str) for a in by):
                problems.add(f"policies.tools.{name}.by", "a list of argument names (customer_id)")
            else:
                spec.totals_by[name] = list(by)
    spec.tool_attributes = _values(raw_values, "policies.tools", spec.tool_attribute_types, problems)
    if isinstance(groups, list):
        spec.group_roles = {
            g["name"]: list(g.get("roles") or [])
            for g in groups
            if isinstance(g, dict) and isinstance(g.get("name"), str)
        }
    base = Path(source).resolve().parent if source else None
    for i, entry in enumerate(data.get("sets") or []):
        source_set = _set(entry, f"policies.sets[{i}]", base, source, problems)
        if source_set is not None:
            spec.sets.append(source_set)
    for i, entry in enumerate(data.get("tests") or []):
        test = _test(entry, f"policies.tests[{i}]", problems)
        if test is not None:
            spec.tests.append(test)
    return spec


def _attribute_types(raw: Any, path: str, kind: str, problems) -> dict:
    if not isinstance(raw, dict):
        problems.add(path, "must map attribute names to a type (long, string, bool, set)")
        return {}
    declared = {}
    for name, value in raw.items():
        spec = value if isinstance(value, dict) else {"type": value}
        if name in RESERVED[kind]:
            problems.add(f"{path}.{name}", f"reserved: the platform sets {name}")
        elif spec.get("type") not in ATTRIBUTE_TYPES:
            problems.add(f"{path}.{name}", "type must be one of long, string, bool, set")
        else:
            declared[name] = {k: v for k, v in spec.items() if k in ("type", "default")}
    return declared


def _values(raw: Any, path: str, types: dict, problems) -> dict:
    if not isinstance(raw, dict):
        problems.add(path, "must map names to attribute values")
        return {}
    checks = {
        "long": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "string": lambda v: isinstance(v, str),
        "bool": lambda v: isinstance(v, bool),
        "set": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    }
    values = {}
    for owner, attrs in raw.items():
        if not isinstance(attrs, dict):
            problems.add(f"{path}.{owner}", "must map attribute names to values")
            continue
        for name, value in attrs.items():
            if name not in types:
                problems.add(f"{path}.{owner}.{name}", "not declared under policies.attributes")
            elif not checks[types[name]["type"]](value):
                problems.add(f"{path}.{owner}.{name}", f"must be a {types[name]['type']}")
        values[str(owner)] = dict(attrs)
    return values


def _set(entry: Any, path: str, base: Path | None, source: str | None, problems) -> SourceSet | None:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        problems.add(path, "a set needs a name and either text or file")
        return None
    mode = entry.get("mode", PolicyMode.ENFORCE)
    if mode not in PolicyMode.values:
        problems.add(f"{path}.mode", "enforce or shadow")
        return None
    if ("text" in entry) == ("file" in entry):
        problems.add(path, "give either text (inline) or file (a .cedar file beside this one)")
        return None
    if "file" in entry:
        if base is None:
            problems.add(f"{path}.file", "only a file applied from disk can name files beside it")
            return None
        file = (base / str(entry["file"])).resolve()
        if base not in file.parents:
            problems.add(f"{path}.file", "must be beside the configuration file (or below it)")
            return None
        try:
            text = file.read_text(encoding="utf-8")
        except OSError as exc:
            problems.add(f"{path}.file", f"cannot read {file}: {exc.strerror or exc}")
            return None
        where, first_line = str(file), 1
    else:
        text = str(entry["text"])
        where, first_line = _inline_place(text, source, path)
    return SourceSet(
        name=entry["name"],
        text=text,
        mode=mode,
        source=where,
        first_line=first_line,
        private=bool(entry.get("private", False)),
        path=path,
    )


def _inline_place(text: str, source: str | None, path: str) -> tuple[str, int]:
    """The file and the line an inline text starts on (found by its first line, in the file)."""
    if not source:
        return path, 1
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    try:
        lines = Path(source).read_text(encoding="utf-8").splitlines()
    except OSError:
        return source, 1
    for number, line in enumerate(lines, start=1):
        if first and line.strip() == first:
            return source, number
    return source, 1


TEST_KEYS = {
    "name", "principal", "tool", "expect", "action", "input", "metadata", "requester", "agent",
    "version", "arguments", "policy", "today", "run", "editor",
}  # fmt: skip


def _test(entry: Any, path: str, problems) -> PolicyTest | None:
    if not isinstance(entry, dict):
        problems.add(path, "a test is a mapping: name, principal, tool, arguments, expect")
        return None
    # A key it does not know is a mistake in the file (a comma in an unquoted flow-style name
    # makes the rest of the name a key of its own), never silently ignored.
    unknown = [key for key in entry if key not in TEST_KEYS]
    if unknown:
        problems.add(
            path,
            f"unknown key {unknown[0]!r} (a comma in an unquoted name splits it: quote the name); "
            f"one of {', '.join(sorted(TEST_KEYS))}",
        )
        return None
    action = entry.get("action", "call_tool")
    if action not in ACTIONS:
        problems.add(f"{path}.action", f"one of {', '.join(sorted(ACTIONS))}")
        return None
    needed = ["name", "principal", "expect", *([] if action == "start_run" else ["tool"])]
    needed += ["requester"] if action == "approve_call" else []
    missing = [k for k in needed if not isinstance(entry.get(k), str)]
    if missing:
        problems.add(path, f"missing or not text: {', '.join(missing)}")
        return None
    version = entry.get("version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        problems.add(f"{path}.version", "a version number (1 or more)")
        return None
    if action != "call_tool" and entry["expect"] == "approval":
        problems.add(f"{path}.expect", f"allow or deny: @approval applies to tool calls, not to {action}")
        return None
    if entry["expect"] not in OUTCOMES:
        problems.add(f"{path}.expect", "allow, deny or approval")
        return None
    return PolicyTest(
        name=entry["name"],
        principal=entry["principal"],
        tool=str(entry.get("tool") or ""),
        expect=entry["expect"],
        action=action,
        input=dict(entry.get("input") or {}),
        metadata=dict(entry.get("metadata") or {}),
        requester=str(entry.get("requester") or ""),
        agent=str(entry.get("agent") or "agent"),
        version=version,
        arguments=dict(entry.get("arguments") or {}),
        policy=str(entry.get("policy") or ""),
        today=dict(entry.get("today") or {}),
        run=dict(entry.get("run") or {}),
        editor=str(entry.get("editor") or ""),
        path=path,
    )


def apply(tenant, spec: PolicySpec | None, problems, report) -> None:
    if spec is None:
        return
    found = check(tenant, spec)
    for where, message in found:
        problems.add(where, message)
    if not found and not problems:
        report.notes.extend(notes(tenant, spec))
        report.changes.extend(install(tenant, spec))
