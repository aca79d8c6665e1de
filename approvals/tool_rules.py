"""A tool's approval rule and an agent version's override of it, in Cedar (docs/policies.md).

A rule is one of:

    never            no call of the tool waits (no policy)
    always           every call waits: `@approval("policy: always") permit (principal, action ==
                     Action::"<tool>", resource);`
    a Cedar policy   one `permit` annotated `@approval("why")` whose action is this tool's:

        @approval("refunds above INR 5,000 wait for a supervisor")
        permit (principal, action == Action::"bank__issue_refund", resource)
        when { context.arguments.amount > 5000 };

The policy's id is the platform's, `<tool>.approval` (`<tool>.approval.override` for a version's
override): a rule leaves `@id` out or gives exactly that. The tool's rule and the override are two
@approval policies, evaluated with the tenant's (approvals/cedar.py), and either one asks: an
override can add an approval, never take the tool's away.

    check(text, tool=, override=)    the text to store, or RuleError saying what is wrong; a rule in
                                     the retired expression language is answered with the Cedar
                                     to write (approvals/migrations/_retired_rules.py)
    policy(text, tool=, override=)   the Cedar evaluated for a stored rule ("" for never); one that
                                     cannot be read asks for approval, it never skips one
    same(a, b)                       one rule, layout and comments aside (a change of rule bumps
                                     the tool's policy_version)
    effective(rule, override)        the rules a call's approval records
"""

from __future__ import annotations

import json

import cedarpy

from approvals.migrations import _retired_rules as retired

NEVER = "never"
ALWAYS = "always"
MAX_LENGTH = 10_000


class RuleError(ValueError):
    """A rule that is not `never`, `always` or one Cedar @approval permit for the tool."""


def rule_id(tool: str, *, override: bool = False) -> str:
    return f"{tool}.approval.override" if override else f"{tool}.approval"


def check(text, *, tool: str, override: bool = False) -> str:
    """The rule as it is stored (its text, trimmed), or RuleError with what to write instead."""
    if not isinstance(text, str):
        raise RuleError('must be text: "never", "always" or a Cedar @approval policy')
    shorthand = _shorthand(text)
    if shorthand is not None:
        return shorthand
    if not text.strip():
        raise RuleError('must not be empty: "never", "always" or a Cedar @approval policy')
    if len(text) > MAX_LENGTH:
        raise RuleError(f"must be at most {MAX_LENGTH} characters")
    policy_id = rule_id(tool, override=override)
    try:
        parsed = _parsed(text)
    except RuleError:
        hint = _retired_hint(text, tool=tool, policy_id=policy_id)
        if hint is not None:
            raise RuleError(hint) from None
        raise
    problem = _problem(parsed, tool=tool, policy_id=policy_id)
    if problem is not None:
        raise RuleError(problem)
    return text.strip()


def policy(text: str, *, tool: str, override: bool = False) -> str:
    """The Cedar policy a stored rule is evaluated as, carrying its id; "" for `never`.

    A stored rule that is not a valid one (written past `check`, by hand in the database) asks
    for approval on every call, with a reason that says so: a person decides."""
    shorthand = _shorthand(text)
    if shorthand == NEVER or not text.strip():
        return ""
    policy_id = rule_id(tool, override=override)
    if shorthand == ALWAYS:
        return _always(tool, policy_id, "policy: always")
    try:
        parsed = _parsed(text)
    except RuleError:
        parsed = None
    if parsed is None or _problem(parsed, tool=tool, policy_id=policy_id) is not None:
        return _always(tool, policy_id, f"the approval rule {policy_id} cannot be read, so a person decides")
    if "id" in (parsed.get("annotations") or {}):
        return text.strip()
    return f"@id({_string(policy_id)})\n{text.strip()}"


def same(a: str, b: str) -> bool:
    """Whether two texts are one rule: equal once parsed (layout, comments and @id aside)."""
    if _shorthand(a) is not None or _shorthand(b) is not None:
        return _shorthand(a) == _shorthand(b)
    try:
        return _canonical(a) == _canonical(b)
    except RuleError:
        return a.strip() == b.strip()


def effective(rule: str, override: str | None) -> str:
    """The rules that decide whether a call waits, as its approval records them: the tool's, then
    the version's override (either one asks, so `always` in either is `always`)."""
    rules = [text.strip() for text in (rule, override or "") if text and _shorthand(text) != NEVER]
    if any(_shorthand(text) == ALWAYS for text in rules):
        return ALWAYS
    return "\n\n".join(rules) or NEVER


def _shorthand(text: str) -> str | None:
    word = text.strip() if isinstance(text, str) else None
    return word if word in (NEVER, ALWAYS) else None


def _parsed(text: str) -> dict:
    """The one static policy of a text (Cedar's JSON form), or RuleError."""
    try:
        found = json.loads(cedarpy.policies_to_json_str(text))
    except ValueError as exc:
        raise RuleError(f"Cedar cannot parse it: {exc}") from None
    if found.get("templates"):
        raise RuleError("a template (?principal, ?resource) is not a rule: write the policy itself")
    policies = list(found.get("staticPolicies", {}).values())
    if len(policies) != 1:
        raise RuleError(
            f"one policy per rule (found {len(policies)}): further ones go in the tenant's policy "
            "sets (docs/policies.md)"
        )
    return policies[0]


def _problem(parsed: dict, *, tool: str, policy_id: str) -> str | None:
    annotations = parsed.get("annotations") or {}
    if parsed["effect"] != "permit":
        return "an approval rule is a permit annotated @approval: a forbid goes in the tenant's policy sets"
    if "approval" not in annotations:
        return 'needs @approval("why"): the reason the approver is shown'
    if annotations.get("id", policy_id) != policy_id:
        return f"its @id is {policy_id!r} (or leave @id out)"
    if parsed["action"] != {"op": "==", "entity": {"type": "Action", "id": tool}}:
        return f"must be about this tool's calls: action == Action::{_string(tool)}"
    return None


def _canonical(text: str) -> str:
    parsed = _parsed(text)
    parsed["annotations"] = {k: v for k, v in (parsed.get("annotations") or {}).items() if k != "id"}
    return json.dumps(parsed, sort_keys=True)


def _always(tool: str, policy_id: str, reason: str) -> str:
    return (
        f"@id({_string(policy_id)})\n@approval({_string(reason)})\n"
        f"permit (principal, action == Action::{_string(tool)}, resource);"
    )


def _retired_hint(text: str, *, tool: str, policy_id: str) -> str | None:
    """For a rule in the retired expression language, the Cedar to write; None for other text."""
    said = "this rule is in the retired expression language: approval rules are Cedar (docs/policies.md)"
    try:
        converted = retired.to_cedar(text, tool=tool, policy_id=policy_id)
    except retired.Unconvertible as exc:
        return f"{said}, and this one has no exact Cedar equivalent: {exc.advice}"
    except retired.PolicyError:
        return None
    return f"{said}. Write:\n{converted}"


def _string(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    escaped = escaped.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r").replace("\0", "\\0")
    return f'"{escaped}"'
