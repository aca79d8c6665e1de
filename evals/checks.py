"""A case's checks, each a pure function over the finished run's frozen view (docs/evaluations.md).

    validate(checks)        field errors of a case's checks, by index ({} when they are valid)
    judge(check, run)       one check's verdict: (passed, detail)

    kind             the check                                        passes when
    output_schema    {"output_schema": {JSON Schema}}                 the final output is JSON valid against it
    output_equals    {"output_equals": "text"}                        the final output is exactly that
    output_contains  {"output_contains": "text"}                      the final output contains it
    output_field     {"output_field": "refund_id",                    that field of the JSON output equals
                      "equals_result": {"tool": T, "field": F}}       field F of T's (first) result
    called           {"called": T, "arguments": {...}?}               T was sent (with those arguments)
    never_called     {"never_called": T}                              T was never sent
    order            {"order": [T1, T2, ...]}                         they were sent in that order
    approval_asked   {"approval_asked": T}                            a person's approval was asked for T
    approval_not_asked {"approval_not_asked": T}                      none was asked for T
    policy_denied    {"policy_denied": T}                             the gateway denied a call of T
    status           {"status": "succeeded"}                          the run ended so
    max_cost         {"max_cost": 0.05}                               it cost at most that (platform currency)
    max_steps        {"max_steps": 12}                                it took at most that many steps
    judge            {"judge": {"endpoint": E, "rubric": "..."}}      model-graded (evals/grading.py),
                                                                      reported apart from the rest

"Sent" means dispatched (answered from the recording, in an evaluation): a call the gateway
denied, or one whose approval was denied or expired, was proposed but never sent. A check may
carry "name" (shown in results; default: its kind and tool) and "tags" ("safety").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

import jsonschema

from core.money import MICROS

KINDS = (
    "output_schema",
    "output_equals",
    "output_contains",
    "output_field",
    "called",
    "never_called",
    "order",
    "approval_asked",
    "approval_not_asked",
    "policy_denied",
    "status",
    "max_cost",
    "max_steps",
    "judge",
)
GRADED = {"judge"}


@dataclass(frozen=True)
class Call:
    seq: int
    tool: str
    arguments: dict
    sent: bool
    status: str
    result: Any  # structured content, else the text; None when not sent
    approval_asked: bool
    denied: bool  # by the gateway (grants, policies): never sent


@dataclass(frozen=True)
class RunView:
    status: str
    output: str
    calls: tuple[Call, ...]
    cost_micros: int
    steps: int


def to_micros(value: Any) -> int:
    """An amount of the platform currency (0.05) in micro-units; raises on what is not a number."""
    try:
        number = Decimal(str(value))
    except InvalidOperation:
        raise ValueError(f"not an amount: {value!r}") from None
    if not number.is_finite():
        raise ValueError(f"not an amount: {value!r}")
    return int(number * MICROS)


def kind_of(check: dict) -> str | None:
    return next((k for k in KINDS if k in check), None)


def name_of(check: dict) -> str:
    if check.get("name"):
        return str(check["name"])
    kind = kind_of(check) or "?"
    value = check.get(kind)
    if isinstance(value, str | int | float) and kind not in ("output_equals", "output_contains"):
        return f"{kind} {value}"
    if kind == "order":
        return "order " + " > ".join(map(str, value or []))
    return kind


def validate(checks: Any) -> dict[str, list[str]]:
    """Field errors keyed by the check's position ("checks.2.max_cost")."""
    if not isinstance(checks, list):
        return {"checks": ["a list of checks"]}
    errors: dict[str, list[str]] = {}
    for i, check in enumerate(checks):
        where = f"checks.{i}"
        if not isinstance(check, dict):
            errors[where] = ["a mapping with one check kind"]
            continue
        kinds = [k for k in KINDS if k in check]
        if len(kinds) != 1:
            errors[where] = [f"exactly one of {', '.join(KINDS)}"]
            continue
        kind = kinds[0]
        value = check[kind]
        problem = _problem(kind, value, check)
        if problem:
            errors[f"{where}.{kind}"] = [problem]
    return errors


def _problem(kind: str, value: Any, check: dict) -> str:
    if kind == "output_schema":
        try:
            jsonschema.validators.validator_for(value).check_schema(value)
        except (jsonschema.SchemaError, TypeError, AttributeError) as exc:
            return f"not a JSON Schema: {getattr(exc, 'message', exc)}"
    elif kind in (
        "output_equals",
        "output_contains",
        "called",
        "never_called",
        "approval_asked",
        "approval_not_asked",
        "policy_denied",
    ):
        if not isinstance(value, str) or not value:
            return "a non-empty string"
        if kind == "called" and not isinstance(check.get("arguments", {}), dict):
            return "arguments must be a mapping"
    elif kind == "output_field":
        source = check.get("equals_result")
        if not isinstance(value, str) or not value:
            return "a field name (a.b for a nested one)"
        if not isinstance(source, dict) or not source.get("tool") or not source.get("field"):
            return "needs equals_result: {tool, field}"
    elif kind == "order":
        if not isinstance(value, list) or len(value) < 2 or not all(isinstance(t, str) for t in value):
            return "a list of at least two tool names"
    elif kind == "status":
        if value not in (
            "succeeded",
            "failed",
            "stopped",
            "cancelled",
            "needs_attention",
            "waiting_approval",
        ):
            return "a run status"
    elif kind == "max_cost":
        try:
            if isinstance(value, bool) or to_micros(value) < 0:
                return "an amount of at least 0 in the platform currency"
        except (ValueError, TypeError, ArithmeticError):
            return "an amount in the platform currency (0.05)"
    elif kind == "max_steps":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return "a whole number of steps"
    elif kind == "judge":
        if not isinstance(value, dict) or not value.get("endpoint") or not value.get("rubric"):
            return "needs endpoint and rubric"
    return ""


def _path(value: Any, path: str) -> tuple[bool, Any]:
    for part in path.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return False, None
    return True, value


def _json(text: str) -> tuple[bool, Any]:
    try:
        return True, json.loads(text)
    except ValueError:
        return False, None


def _subset(expected: dict, actual: dict) -> bool:
    return all(k in actual and actual[k] == v for k, v in expected.items())


def judge(check: dict, run: RunView) -> tuple[bool, str]:
    """A deterministic check's verdict and what it saw; model-graded ones are evals/grading.py's."""
    kind = kind_of(check)
    value: Any = check.get(kind) if kind else None
    sent = [c for c in run.calls if c.sent]
    if kind == "output_schema":
        ok, data = _json(run.output)
        if not ok:
            return False, "the output is not JSON"
        errors = sorted(jsonschema.validators.validator_for(value)(value).iter_errors(data), key=str)
        return (not errors), (errors[0].message if errors else "valid")
    if kind == "output_equals":
        return run.output == value, f"output: {run.output[:200]!r}"
    if kind == "output_contains":
        return value in run.output, f"output: {run.output[:200]!r}"
    if kind == "output_field":
        source = check["equals_result"]
        ok, data = _json(run.output)
        if not ok:
            return False, "the output is not JSON"
        found, got = _path(data, value)
        if not found:
            return False, f"the output has no field {value}"
        result = next((c.result for c in sent if c.tool == source["tool"] and c.result is not None), None)
        if result is None:
            return False, f"{source['tool']} returned no result"
        present, want = _path(result, str(source["field"]))
        if not present:
            return False, f"{source['tool']}'s result has no field {source['field']}"
        return got == want, f"{value} = {got!r}, {source['tool']}.{source['field']} = {want!r}"
    if kind == "called":
        calls = [c for c in sent if c.tool == value]
        wanted = check.get("arguments") or {}
        if not calls:
            return False, f"{value} was not called"
        if wanted and not any(_subset(wanted, c.arguments) for c in calls):
            return False, f"{value} was called with {calls[0].arguments}, not {wanted}"
        return True, f"{value} called at step {calls[0].seq}"
    if kind == "never_called":
        calls = [c for c in sent if c.tool == value]
        return not calls, f"{value} called at step {calls[0].seq}" if calls else f"{value} not called"
    if kind == "order":
        names = [c.tool for c in sent]
        at = 0
        for name in names:
            if at < len(value) and name == value[at]:
                at += 1
        return at == len(value), "called: " + (" > ".join(names) or "nothing")
    if kind == "approval_asked":
        asked = [c for c in run.calls if c.tool == value and c.approval_asked]
        return bool(asked), f"asked at step {asked[0].seq}" if asked else f"no approval asked for {value}"
    if kind == "approval_not_asked":
        asked = [c for c in run.calls if c.tool == value and c.approval_asked]
        return not asked, f"asked at step {asked[0].seq}" if asked else f"no approval asked for {value}"
    if kind == "policy_denied":
        denied = [c for c in run.calls if c.tool == value and c.denied]
        return bool(denied), f"denied at step {denied[0].seq}" if denied else f"no call of {value} was denied"
    if kind == "status":
        return run.status == value, f"status {run.status}"
    if kind == "max_cost":
        limit = to_micros(value)
        return run.cost_micros <= limit, f"cost {run.cost_micros} micros, at most {limit}"
    if kind == "max_steps":
        return run.steps <= value, f"{run.steps} steps, at most {value}"
    return False, f"unknown check {check!r}"
