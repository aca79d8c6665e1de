"""Validation of an agent version's spec against its tenant. Errors name the field path."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from approvals.policy import PolicyError, to_cedar
from llm.models import ModelEndpoint
from tools.models import Tool

# A run's limits: defaults, and the tenant fields that cap them (runs.services.effective_limits).
DEFAULT_LIMITS = {
    "max_steps": 50,
    "max_tool_calls": 25,
    "max_wall_seconds": 24 * 3600,
    "max_output_tokens": 1024,
    "max_cost_micros": 2_000_000,
}
LIMIT_CAPS = {
    "max_steps": "max_steps_cap",
    "max_tool_calls": "max_tool_calls_cap",
    "max_wall_seconds": "max_wall_seconds_cap",
    "max_output_tokens": "max_output_tokens_cap",
    "max_cost_micros": "max_cost_micros_cap",
}

LOOP_DEFAULTS = {"max_repeats": 3, "max_empty_results": 3, "alternation_cycles": 2}


@dataclass(frozen=True)
class LoopLimits:
    """No-progress limits (runs/engine/loops.py), the version's `loop` over LOOP_DEFAULTS."""

    max_repeats: int
    max_empty_results: int
    alternation_cycles: int


@dataclass(frozen=True)
class AgentSpec:
    """An agent version's spec as the engine reads it: typed fields, built once per version."""

    version_id: int
    model: str
    instructions: str
    tools: tuple[str, ...]
    limits: MappingProxyType
    loop: LoopLimits
    context: MappingProxyType
    approval_overrides: MappingProxyType
    on_approval_expired: str
    max_visible_tools: int | None
    expected_cost_micros: int | None  # runs.admission: what a run is expected to cost, if configured


_by_version: dict[int, AgentSpec] = {}


def spec_for(version) -> AgentSpec:
    """The frozen spec of an AgentVersion, built once per version id and process.

    A version's spec is never edited after it is created (agents.services publishes a new version
    for every change), so its id names its spec for good.
    """
    found = _by_version.get(version.pk)
    if found is None:
        spec = version.spec
        found = AgentSpec(
            version_id=version.pk,
            model=spec.get("model", ""),
            instructions=spec.get("instructions", ""),
            tools=tuple(spec.get("tools") or ()),
            limits=MappingProxyType(dict(spec.get("limits") or {})),
            loop=LoopLimits(**{**LOOP_DEFAULTS, **(spec.get("loop") or {})}),
            context=MappingProxyType(dict(spec.get("context") or {})),
            approval_overrides=MappingProxyType(dict(spec.get("approval_overrides") or {})),
            on_approval_expired=spec.get("on_approval_expired", "tell_model"),
            max_visible_tools=spec.get("max_visible_tools"),
            expected_cost_micros=spec.get("expected_cost_micros"),
        )
        _by_version[version.pk] = found
    return found


LOOP_KEYS = {"max_repeats", "max_empty_results", "alternation_cycles"}
CONTEXT_KEYS = {"result_limit_chars", "keep_recent_results", "mask_batch", "result_limits", "enabled"}
KNOWN_KEYS = {
    "model",
    "instructions",
    "tools",
    "limits",
    "context",
    "approval_overrides",
    "loop",
    "on_approval_expired",
    "max_visible_tools",
    "description",
    "expected_cost_micros",
}


SETTING_MAX = 1_000_000_000  # loop, context and visibility settings: large, but no overflow downstream


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= SETTING_MAX


def validate_spec(spec, tenant) -> dict[str, list[str]]:
    errors: dict[str, list[str]] = {}

    def add(path: str, message: str) -> None:
        errors.setdefault(path, []).append(message)

    if not isinstance(spec, dict):
        return {"spec": ["must be an object"]}
    for key in sorted(set(spec) - KNOWN_KEYS):
        add(key, "unknown field")
    model = spec.get("model")
    if not isinstance(model, str) or not model:
        add("model", "required: the name of a model endpoint")
    elif not ModelEndpoint.objects.filter(tenant=tenant, name=model).exists():
        add("model", f"no model endpoint named {model!r} in this tenant")
    instructions = spec.get("instructions")
    if not isinstance(instructions, str) or not instructions.strip():
        add("instructions", "required: non-empty text")
    tools = spec.get("tools", [])
    if not isinstance(tools, list) or not all(isinstance(t, str) for t in tools):
        add("tools", "must be a list of tool names")
        tools = []
    else:
        known = set(Tool.objects.filter(tenant=tenant, name__in=tools).values_list("name", flat=True))
        for i, name in enumerate(tools):
            if name not in known:
                add(f"tools[{i}]", f"no tool named {name!r} in this tenant")
        if len(set(tools)) != len(tools):
            add("tools", "lists a tool twice")
    limits = spec.get("limits", {})
    if not isinstance(limits, dict):
        add("limits", "must be an object")
    else:
        for key, value in limits.items():
            if key not in DEFAULT_LIMITS:
                add(f"limits.{key}", f"unknown limit; one of {', '.join(sorted(DEFAULT_LIMITS))}")
            elif not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                add(f"limits.{key}", "must be a positive integer")
            elif value > getattr(tenant, LIMIT_CAPS[key]):
                add(f"limits.{key}", f"{value} is above the tenant cap of {getattr(tenant, LIMIT_CAPS[key])}")
    overrides = spec.get("approval_overrides", {})
    if not isinstance(overrides, dict):
        add("approval_overrides", "must be an object of tool name to policy")
    else:
        for name, policy in overrides.items():
            if name not in tools:
                add(f"approval_overrides.{name}", "tool is not in this agent's tools")
            try:
                to_cedar(str(policy), tool=str(name), policy_id="override")  # evaluated as Cedar
            except PolicyError as exc:
                add(f"approval_overrides.{name}", str(exc))
    for section, keys in (("loop", LOOP_KEYS), ("context", CONTEXT_KEYS)):
        value = spec.get(section, {})
        if not isinstance(value, dict):
            add(section, "must be an object")
            continue
        for key, item in value.items():
            if key not in keys:
                add(f"{section}.{key}", f"unknown setting; one of {', '.join(sorted(keys))}")
            elif key == "enabled":
                if not isinstance(item, bool):
                    add(f"{section}.{key}", "must be true or false")
            elif key == "result_limits":
                if not isinstance(item, dict):
                    add(f"{section}.{key}", "must be an object of tool name to a number of characters")
                    continue
                for name, chars in item.items():
                    if not _positive_int(chars):
                        add(f"{section}.{key}.{name}", "must be a positive integer")
            elif not _positive_int(item):
                add(f"{section}.{key}", f"must be a positive integer up to {SETTING_MAX}")
    if spec.get("on_approval_expired", "tell_model") not in ("tell_model", "stop"):
        add("on_approval_expired", "must be one of tell_model, stop")
    if "expected_cost_micros" in spec and not _positive_int(spec["expected_cost_micros"]):
        add(
            "expected_cost_micros",
            "must be a positive integer (micros a run is expected to cost; "
            "learned from finished runs when absent)",
        )
    if "max_visible_tools" in spec and not _positive_int(spec["max_visible_tools"]):
        add("max_visible_tools", f"must be a positive integer up to {SETTING_MAX}")
    return errors
