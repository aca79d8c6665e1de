"""Validation of an agent version's spec against its tenant. Errors name the field path."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from agents import output as output_contract
from agents.output import OutputSpec
from approvals.tool_rules import RuleError, check
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

# The provider failures that can move a model call to a fallback endpoint (llm/fallback.py
# classifies an error into one of them): 429; 5xx, overloaded (529) or the server refusing the
# connection; no answer within the endpoint's timeout; a prompt longer than the model's context.
ERROR_CLASSES = ("rate_limited", "server_error", "timeout", "context_too_long")
FALLBACK_KEYS = {"model", "on", "rate_limit_retries", "move_back"}
RATE_LIMIT_RETRIES = 2  # a 429 is retried this many times on its endpoint before it moves on
# Below the engine's "failed 5 times in a row" (runs/engine/decisions.MAX_MODEL_FAILURES): the
# fifth 429 on an endpoint must still be able to move the call on.
MAX_RATE_LIMIT_RETRIES = 4
MAX_FALLBACKS = 5


@dataclass(frozen=True)
class Fallback:
    """One endpoint after the primary: the error classes that move a call to it, and whether the
    run's next model turn goes back to the primary once this endpoint has answered."""

    model: str  # a model endpoint's name in the version's tenant
    on: frozenset[str]
    rate_limit_retries: int
    move_back: bool

    @classmethod
    def of(cls, raw: dict) -> Fallback:
        return cls(
            model=raw["model"],
            on=frozenset(raw.get("on") or ERROR_CLASSES),
            rate_limit_retries=raw.get("rate_limit_retries", RATE_LIMIT_RETRIES),
            move_back=raw.get("move_back", True),
        )


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
    fallbacks: tuple[Fallback, ...] = ()  # in order, after the primary (`model`): llm/fallback.py
    output: OutputSpec | None = None  # the final answer's schema, retries, grounded fields (agents/output.py)


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
            fallbacks=tuple(Fallback.of(raw) for raw in spec.get("fallbacks") or ()),
            output=OutputSpec.of(spec),
        )
        _by_version[version.pk] = found
    return found


LOOP_KEYS = {"max_repeats", "max_empty_results", "alternation_cycles"}
CONTEXT_KEYS = {
    "result_limit_chars",
    "keep_recent_results",
    "mask_batch",
    "result_limits",
    "enabled",
    "compaction",
    "compact_after_tokens",
    "compact_keep_turns",
    "compact_record_tokens",
    "clear_trigger_tokens",
    "clear_keep_tool_uses",
    "clear_at_least_tokens",
    "summariser",
}
# llm/compaction.py: "deterministic" folds old turns into records (the default); "off" keeps them;
# "provider": the endpoint's own clearing of old tool results where it declares it (llm/compat.py).
COMPACTION = ("deterministic", "off", "provider")
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
    "fallbacks",
    "output_schema",
    "output_retries",
    "grounded_fields",
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
        add("approval_overrides", "must be an object of tool name to approval rule")
    else:
        for name, rule in overrides.items():
            if name not in tools:
                add(f"approval_overrides.{name}", "tool is not in this agent's tools")
            try:
                check(rule, tool=str(name), override=True)  # never, always or Cedar (tool_rules)
            except RuleError as exc:
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
            elif key == "compaction":
                if item not in COMPACTION:
                    add(f"{section}.{key}", f"must be one of {', '.join(COMPACTION)}")
            elif key == "summariser":
                if not isinstance(item, str) or not item:
                    add(f"{section}.{key}", "must be the name of a model endpoint")
                elif not ModelEndpoint.objects.filter(tenant=tenant, name=item).exists():
                    add(f"{section}.{key}", f"no model endpoint named {item!r} in this tenant")
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
    for path, message in _fallback_problems(spec.get("fallbacks", []), model, tenant):
        add(path, message)
    if "max_visible_tools" in spec and not _positive_int(spec["max_visible_tools"]):
        add("max_visible_tools", f"must be a positive integer up to {SETTING_MAX}")
    for path, message in output_contract.problems(spec):
        add(path, message)
    return errors


def _fallback_problems(fallbacks, primary, tenant) -> list[tuple[str, str]]:
    """(path, message) for each bad part of a version's `fallbacks`."""
    if not isinstance(fallbacks, list):
        return [("fallbacks", "must be a list of {model, on, rate_limit_retries, move_back}")]
    if len(fallbacks) > MAX_FALLBACKS:
        return [("fallbacks", f"at most {MAX_FALLBACKS} fallback endpoints")]
    found: list[tuple[str, str]] = []
    names = [f.get("model") for f in fallbacks if isinstance(f, dict)]
    known = set(
        ModelEndpoint.objects.filter(
            tenant=tenant, name__in=[n for n in names if isinstance(n, str)]
        ).values_list("name", flat=True)
    )
    seen = {primary}
    for i, raw in enumerate(fallbacks):
        at = f"fallbacks[{i}]"
        if not isinstance(raw, dict):
            found.append((at, "must be an object with model, on, rate_limit_retries, move_back"))
            continue
        for key in sorted(set(raw) - FALLBACK_KEYS):
            found.append((f"{at}.{key}", f"unknown field; one of {', '.join(sorted(FALLBACK_KEYS))}"))
        name = raw.get("model")
        if not isinstance(name, str) or not name:
            found.append((f"{at}.model", "required: the name of a model endpoint"))
        elif name not in known:
            found.append((f"{at}.model", f"no model endpoint named {name!r} in this tenant"))
        elif name in seen:
            found.append(
                (f"{at}.model", f"{name!r} is already in the chain (the primary or an earlier fallback)")
            )
        seen.add(name)
        on = raw.get("on", list(ERROR_CLASSES))
        if not isinstance(on, list) or not on:
            found.append((f"{at}.on", f"must be a non-empty list of {', '.join(ERROR_CLASSES)}"))
        else:
            for j, kind in enumerate(on):
                if kind not in ERROR_CLASSES:
                    found.append((f"{at}.on[{j}]", f"must be one of {', '.join(ERROR_CLASSES)}"))
        retries = raw.get("rate_limit_retries", RATE_LIMIT_RETRIES)
        if (
            not isinstance(retries, int)
            or isinstance(retries, bool)
            or not 0 <= retries <= MAX_RATE_LIMIT_RETRIES
        ):
            found.append(
                (f"{at}.rate_limit_retries", f"must be an integer from 0 to {MAX_RATE_LIMIT_RETRIES}")
            )
        if not isinstance(raw.get("move_back", True), bool):
            found.append((f"{at}.move_back", "must be true or false"))
    return found
