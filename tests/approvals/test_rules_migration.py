"""The migration that converted every stored approval rule of the retired expression language into
Cedar (approvals/migrations/0006_approval_rules_in_cedar.py, with _retired_rules.py): each rule,
converted and decided by Cedar, asks for approval exactly where the old evaluator did (or, with no
exact Cedar equivalent, wherever it did and more); the rows it rewrites and what it prints."""

from __future__ import annotations

import importlib
import json
import random
from io import StringIO
from pathlib import Path

import pytest

from agents.models import AgentVersion
from approvals import tool_rules
from approvals.cedar import rule_decision
from approvals.migrations._retired_rules import (
    MAX_DEPTH,
    MAX_LENGTH,
    PolicyError,
    Unconvertible,
    parse_policy,
    to_cedar,
)
from core.digests import digest
from tests import factories
from tools.models import Tool

migration = importlib.import_module("approvals.migrations.0006_approval_rules_in_cedar")

DISPUTE = 'amount > 5000 or currency != "INR"'
DATA = Path(__file__).parent / "data" / "legacy_decisions.json"


def stored(policy: str, tool: str = "tool") -> str:
    """The rule as the migration stores it: its Cedar, or its nearest stricter Cedar policy."""
    return migration._cedar(policy, tool=tool, policy_id=f"{tool}.approval")[0]


def required(policy: str, arguments: dict) -> bool:
    """The old rule, converted by the migration and decided by Cedar (approvals/cedar.py)."""
    return rule_decision(stored(policy), arguments).required


def convertible(policy: str) -> bool:
    try:
        to_cedar(policy, tool="tool", policy_id="p")
    except PolicyError:
        return False
    return True


# --------------------------------------------------------------------------
# The dispute rule from the product spec


def test_dispute_rule_fires_on_large_amount_and_reason_names_the_rule() -> None:
    decision = rule_decision(stored(DISPUTE), {"amount": 12499, "currency": "INR"})
    assert decision.required and decision.reason == "policy: amount > 5000 or currency != 'INR'"


def test_dispute_rule_small_inr_needs_no_approval() -> None:
    assert required(DISPUTE, {"amount": 3000, "currency": "INR"}) is False


def test_dispute_rule_fires_on_foreign_currency() -> None:
    assert required(DISPUTE, {"amount": 3000, "currency": "USD"}) is True


def test_dispute_rule_converts_to_readable_cedar() -> None:
    text = to_cedar(DISPUTE, tool="bank__issue_refund", policy_id="bank__issue_refund.approval")
    assert 'permit (principal, action == Action::"bank__issue_refund", resource)' in text
    assert "context.arguments.amount > 5000" in text
    assert "@approval(\"policy: amount > 5000 or currency != 'INR'\")" in text


# --------------------------------------------------------------------------
# Evaluation


@pytest.mark.parametrize(
    ("policy", "arguments", "expected"),
    [
        ("amount == 5000", {"amount": 5000}, True),
        ("amount == 5000", {"amount": 5000.0}, True),
        ("amount != 5000", {"amount": 5000}, False),
        ("amount < 10", {"amount": 9}, True),
        ("amount < 10", {"amount": 10}, False),
        ("amount <= 10", {"amount": 10}, True),
        ("amount > 10", {"amount": 10}, False),
        ("amount >= 10", {"amount": 10}, True),
        ("amount >= -5", {"amount": -5}, True),
        # Decimal semantics: no float surprises.
        ("5000 < amount", {"amount": 5001}, True),
        ("amount > limit", {"amount": 5, "limit": 4}, True),
        ("amount > limit", {"amount": 4, "limit": 4}, False),
        ('currency == "INR"', {"currency": "INR"}, True),
        ("currency == 'INR'", {"currency": "inr"}, False),
        ('currency in ["INR", "USD"]', {"currency": "USD"}, True),
        ('currency in ["INR", "USD"]', {"currency": "EUR"}, False),
        ('currency not in ["INR", "USD"]', {"currency": "EUR"}, True),
        ("code in [1, 2, 3]", {"code": 2}, True),
        ("code in []", {"code": 2}, False),
        ('"admin" in user.roles', {"user": {"roles": ["viewer", "admin"]}}, True),
        ('"admin" in user.roles', {"user": {"roles": ["viewer"]}}, False),
        ("refund == true", {"refund": True}, True),
        ("refund == true", {"refund": False}, False),
        ("refund != false", {"refund": True}, True),
        ("customer.tier == 'gold'", {"customer": {"tier": "gold"}}, True),
        ("a > 1 and b > 1", {"a": 2, "b": 2}, True),
        ("a > 1 and b > 1", {"a": 2, "b": 0}, False),
        ("a > 1 or b > 1", {"a": 0, "b": 0}, False),
        ("not a > 1", {"a": 0}, True),
        ("not (a > 1 or b > 1)", {"a": 0, "b": 0}, True),
        ("not not a > 1", {"a": 2}, True),
        # and binds tighter than or
        ("a == 1 or b == 1 and c == 1", {"a": 1, "b": 0, "c": 0}, True),
        ("(a == 1 or b == 1) and c == 1", {"a": 1, "b": 0, "c": 0}, False),
        # keyword-like names are fine after a dot
        ("meta.in == 1", {"meta": {"in": 1}}, True),
    ],
)
def test_evaluate(policy: str, arguments: dict, expected: bool) -> None:
    assert required(policy, arguments) is expected


def test_always_and_never_stay_as_they_are() -> None:
    assert stored("always") == "always" and stored("  never ") == "never"
    assert rule_decision(stored("always"), {}).required is True
    assert rule_decision(stored("  never "), {"amount": 10**9}).required is False
    assert to_cedar("never", tool="t", policy_id="p") == ""


@pytest.mark.parametrize(
    ("policy", "arguments", "expected"),
    [
        ("amount > 99.99", {"amount": 99}, False),
        ("amount > 99.99", {"amount": 100}, True),
        ("amount >= 99.99", {"amount": 100}, True),
        ("amount >= 99.99", {"amount": 99}, False),
        ("amount < -5.5", {"amount": -6}, True),
        ("amount < -5.5", {"amount": -5}, False),
        ("amount <= 0.5", {"amount": 0}, True),
        ("amount <= 0.5", {"amount": 1}, False),
        ("99.99 < amount", {"amount": 100}, True),
        ("99.99 < amount", {"amount": 99}, False),
        ("total == 0.3", {"total": 0}, False),
        ("total != 0.3", {"total": 0}, True),
        ("amount > 99.99", {}, True),  # missing: approval, as before
        ("amount > 99.99", {"amount": 99.98}, True),  # a fraction: approval (stricter, never looser)
        ("coupon == null", {}, True),
        ("coupon == null", {"coupon": None}, True),
        ("coupon == null", {"coupon": "X"}, False),
        ("order.coupon == null", {"order": {}}, True),
        ("order.coupon == null", {"order": {"coupon": "X"}}, False),
    ],
)
def test_fractional_limits_and_null_checks_are_converted(
    policy: str, arguments: dict, expected: bool
) -> None:
    assert required(policy, arguments) is expected


@pytest.mark.parametrize(
    ("policy", "explains"),
    [
        ('name < "b"', "whole numbers only"),
        ("coupon != null", "null has no Cedar equivalent"),
        ("items[0].price > 100", "no list indexes"),
        ("matrix[1][0] == 3", "no list indexes"),
        ("tags == ['a', 'b']", "list literal"),
        ("amount == limit", "two fields"),
        ("x in [1, 'a']", "mixed types"),
    ],
)
def test_forms_with_no_cedar_equivalent_are_refused_with_what_to_write(policy: str, explains: str) -> None:
    with pytest.raises(PolicyError, match=explains):
        to_cedar(policy, tool="t", policy_id="p")


# --------------------------------------------------------------------------
# Fail safe: odd arguments never skip an approval


@pytest.mark.parametrize(
    ("policy", "arguments", "reason"),
    [
        ("amount > 5000", {}, "amount is missing"),
        ("amount > 5000", {"amount": "abc"}, "amount: cannot compare 'abc' with 5000"),
        ("amount > 5000", {"amount": "12499"}, "amount: cannot compare '12499' with 5000"),
        ("amount > 5000", {"amount": True}, "amount: cannot compare true with 5000"),
        ("amount > 5000", {"amount": None}, "amount: cannot compare null with 5000"),
        ("amount > 5000", {"amount": float("nan")}, None),
        ("amount > 5000", {"amount": [1]}, None),
        ("amount > 5000", {"amount": {"value": 1}}, "amount: cannot compare an object with 5000"),
        ('currency != "INR"', {"currency": 5}, "currency: cannot compare 5 with 'INR'"),
        ('currency == "INR"', {"currency": ["INR"]}, None),
        ("flag == true", {"flag": 1}, "flag: cannot compare 1 with true"),
        ('currency in ["INR", "USD"]', {"currency": 1}, None),
        ('"admin" in roles', {"roles": "admin"}, None),
        ("customer.tier == 'gold'", {"customer": "gold"}, "customer.tier is missing"),
        ("items[3].price > 1", {"items": [{"price": 5}]}, "items[3].price is missing"),
        ("items[0].price > 1", {"items": "abc"}, "items[0].price is missing"),
        ("amount == null", {}, "amount is missing"),
        # Negation must not turn "unknown" into "no approval needed".
        ("not amount > 5000", {}, "amount is missing"),
        ("not amount > 5000", {"amount": "abc"}, None),
        ("not (amount > 5000 and currency == 'INR')", {"currency": "INR"}, "amount is missing"),
        ("amount < 100 or currency != 'INR'", {"amount": "x", "currency": "INR"}, None),
        ("amount > 5000 and currency == 'INR'", {"currency": "INR"}, "amount is missing"),
    ],
)
def test_missing_or_mismatched_arguments_require_approval(
    policy: str, arguments: dict, reason: str | None
) -> None:
    if not convertible(policy):
        pytest.skip("no Cedar equivalent: refused at apply")
    assert required(policy, arguments) is True


def test_unknown_part_does_not_matter_when_the_rest_decides() -> None:
    # "unknown and false" is false whatever the missing value would be.
    assert required("amount > 5000 and currency == 'USD'", {"currency": "INR"}) is False
    # "unknown or true" is true.
    assert required("amount > 5000 or currency == 'USD'", {"currency": "USD"}) is True


def test_odd_argument_containers_require_approval() -> None:
    assert required("obj.amount > 1", {"obj": "not a mapping"}) is True
    assert required("x.__class__ == 'a'", {"x": "s"}) is True


def test_legacy_table_gives_the_old_decisions() -> None:
    """Every rule the old evaluator decided (tests/approvals/data/legacy_decisions.json, recorded
    from approvals/policy.py before its evaluator was removed): converted to Cedar, the same
    decision; or refused at apply. Where a value has a type the rule did not expect (which the
    tool's JSON schema rules out for declared fields), Cedar may ask for approval where the old
    rule did not, never the other way round."""
    data = json.loads(DATA.read_text())
    same = stricter_only = refused = 0
    for case in data["cases"]:
        if not convertible(case["policy"]):
            refused += 1
            continue
        for arguments, old in zip(data["arguments"], case["required"], strict=True):
            new = required(case["policy"], arguments)
            if new == old:
                same += 1
            else:
                assert new and not old, (case["policy"], arguments)
                assert _mistyped(arguments), (case["policy"], arguments)
                stricter_only += 1
    # Well-typed arguments ({} and the second set) always agree.
    for case in data["cases"]:
        if convertible(case["policy"]):
            for index in (0, 1):
                assert required(case["policy"], data["arguments"][index]) == case["required"][index]
    assert same > 10 * stricter_only and refused < len(data["cases"])


def _refusal(policy: str) -> Unconvertible | None:
    try:
        to_cedar(policy, tool="tool", policy_id="p")
    except Unconvertible as exc:
        return exc
    return None


def test_a_refused_rule_comes_with_its_nearest_stricter_cedar_policy() -> None:
    """Every rule of the table that has no exact Cedar form: the refusal prints a Cedar policy
    that asks for approval wherever the old evaluator did (and is what a rule stored before the
    conversion is evaluated as), and keeps the rest of the rule: it is not simply "always"."""
    data = json.loads(DATA.read_text())
    refused = kept_decisions = 0
    for case in data["cases"]:
        exc = _refusal(case["policy"])
        if exc is None:
            continue
        refused += 1
        assert exc.parts and exc.parts[0].startswith("`"), case["policy"]
        assert 'permit (principal, action == Action::"tool", resource)' in exc.nearest
        assert "nearest stricter Cedar policy" in exc.advice and exc.nearest in exc.advice
        for arguments, old in zip(data["arguments"], case["required"], strict=True):
            new = required(case["policy"], arguments)  # the stored rule, evaluated as its nearest
            assert new or not old, (case["policy"], arguments)
            kept_decisions += not new
    assert refused > 20
    assert kept_decisions > 0  # some refused rules still let calls through without approval


def test_the_nearest_policy_keeps_what_cedar_can_say() -> None:
    with pytest.raises(Unconvertible) as info:
        to_cedar('amount > 5000 or name < "b"', tool="t", policy_id="p")
    assert info.value.parts == ['`name < "b"`'] or info.value.parts == ["`name < 'b'`"]
    assert "whole numbers only" in info.value.advice
    # The amount part survives: a small amount with the name present still needs approval (the
    # name part is now undecided), and so does a large one.
    assert "context.arguments.amount > 5000" in info.value.nearest
    assert required('amount > 5000 or name < "b"', {"amount": 10, "name": "a"}) is True
    # "and": the refused part undecided, a false amount part still decides "no approval".
    assert required('amount > 5000 and name < "b"', {"amount": 10, "name": "a"}) is False
    assert required('amount > 5000 and name < "b"', {"amount": 9000, "name": "z"}) is True


def _mistyped(arguments: dict) -> bool:
    return arguments not in ({}, {"amount": 5000, "currency": "INR"})


# --------------------------------------------------------------------------
# The converter parses text people type (apply's refusal shows the Cedar to write): never code


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os')",
        "__import__('os').system('echo hi')",
        "eval('1')",
        "open('/etc/passwd')",
        "amount.__class__.__bases__",
        "lambda: 1",
        "amount > 1; import os",
        "amount > 1 if True else 0",
        "[x for x in ()]",
        "amount > 5000 or exec('x')",
        "{'a': 1}",
        "f'{amount}'",
        "amount + 1 > 2",
        "amount > `ls`",
    ],
)
def test_no_code_execution(text: str) -> None:
    with pytest.raises(PolicyError):
        parse_policy(text)


def test_non_string_input_is_rejected() -> None:
    with pytest.raises(PolicyError):
        parse_policy(None)  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# Bounds


def test_length_limit() -> None:
    ok = "a > 1" + " " * (MAX_LENGTH - 5)
    assert parse_policy(ok).text == "a > 1"
    with pytest.raises(PolicyError) as info:
        parse_policy(ok + " ")
    assert info.value.position == MAX_LENGTH


def test_depth_limit_parentheses() -> None:
    assert parse_policy("(" * MAX_DEPTH + "a > 1" + ")" * MAX_DEPTH).text == "a > 1"
    with pytest.raises(PolicyError) as info:
        parse_policy("(" * (MAX_DEPTH + 1) + "a > 1" + ")" * (MAX_DEPTH + 1))
    assert info.value.position == MAX_DEPTH


def test_depth_limit_not() -> None:
    assert required("not " * MAX_DEPTH + "a > 1", {"a": 2}) is True
    with pytest.raises(PolicyError):
        parse_policy("not " * (MAX_DEPTH + 1) + "a > 1")


def test_hostile_nesting_is_a_policy_error_not_a_crash() -> None:
    with pytest.raises(PolicyError):
        parse_policy("(" * 1990)
    with pytest.raises(PolicyError):
        parse_policy("not " * 499 + "a>1")


# --------------------------------------------------------------------------
# A version's override, converted too: it can tighten the tool's rule, never loosen it

POLICIES = [
    "always",
    "never",
    DISPUTE,
    "amount > 1000",
    "amount <= 10",
    "currency == 'USD'",
    "currency in ['USD', 'EUR'] and amount > 100",
    "not amount > 50",
    "not (amount > 50 or currency == 'INR')",
    "customer.tier != 'gold'",
    "items[0].price >= 99.99",
]

ARGUMENTS = [
    {},
    {"amount": 0, "currency": "INR"},
    {"amount": 10, "currency": "INR"},
    {"amount": 75, "currency": "EUR"},
    {"amount": 500, "currency": "USD"},
    {"amount": 2000, "currency": "INR"},
    {"amount": 12499, "currency": "INR", "customer": {"tier": "gold"}},
    {"amount": "lots", "currency": "INR"},
    {"amount": 3000, "currency": None},
    {"amount": 5, "customer": {"tier": "silver"}, "items": [{"price": 100}]},
    {"amount": 5, "currency": "INR", "customer": {"tier": "gold"}, "items": [{"price": 1}]},
]


def decided(base: str, override: str | None, arguments: dict) -> bool:
    """The tool's converted rule and the version's converted override, evaluated together."""
    converted = (
        migration._cedar(override, tool="tool", policy_id="tool.approval.override")[0] if override else ""
    )
    return rule_decision(stored(base), arguments, override=converted).required


@pytest.mark.parametrize("base", POLICIES)
@pytest.mark.parametrize("override", [None, "", *POLICIES])
def test_an_override_never_loosens(base: str, override: str | None) -> None:
    if not all(convertible(text) for text in (base, override or "never")):
        pytest.skip("no Cedar equivalent: stored as its nearest stricter policy")
    for arguments in ARGUMENTS:
        base_required = required(base, arguments)
        override_required = bool(override) and required(override, arguments)
        assert decided(base, override, arguments) == (base_required or override_required), arguments


def _random_operand(rng: random.Random) -> str:
    return rng.choice(
        ["amount", "currency", "customer.tier", "items[0].price", "5000", "'INR'", "true", "null"]
    )


def _random_comparison(rng: random.Random) -> str:
    if rng.random() < 0.2:
        container = rng.choice(["[1, 5000]", "['INR', 'USD']", "[]"])
        return f"{_random_operand(rng)} {rng.choice(['in', 'not in'])} {container}"
    return f"{_random_operand(rng)} {rng.choice(['==', '!=', '<', '<=', '>', '>='])} {_random_operand(rng)}"


def _random_expression(rng: random.Random, depth: int = 0) -> str:
    roll = rng.random()
    if depth > 3 or roll < 0.35:
        return _random_comparison(rng)
    if roll < 0.5:
        return f"not {_random_expression(rng, depth + 1)}"
    joiner = rng.choice([" and ", " or "])
    parts = [_random_expression(rng, depth + 1) for _ in range(rng.randint(2, 3))]
    return "(" + joiner.join(parts) + ")"


RANDOM_ARGUMENTS = [
    {},
    {"amount": 5000, "currency": "INR"},
    {"amount": 7000.5, "currency": "USD", "customer": {"tier": "gold"}, "items": [{"price": 5000}]},
    {"amount": "5000", "currency": 1, "customer": None, "items": []},
    {"amount": None, "currency": "INR", "customer": {"tier": True}, "items": [{"price": "x"}]},
]


def test_random_expressions_with_overrides() -> None:
    # A hand-rolled property test (hypothesis is not installed).
    rng = random.Random(20240501)
    for _ in range(300):
        base_text, override_text = _random_expression(rng), _random_expression(rng)
        base = parse_policy(base_text)
        assert parse_policy(base.text).text == base.text
        if not (convertible(base_text) and convertible(override_text)):
            continue
        for arguments in RANDOM_ARGUMENTS:
            expected = required(base_text, arguments) or required(override_text, arguments)
            assert decided(base_text, override_text, arguments) == expected
            assert required(base.text, arguments) == required(base_text, arguments)


# --------------------------------------------------------------------------
# The migration on stored rows


@pytest.mark.django_db
def test_the_migration_converts_stored_rules_prints_them_and_changes_no_decision() -> None:
    tenant = factories.make_tenant("bank")
    tools = factories.make_builtin_tools(tenant)
    echo, clock, noop = tools["echo"], tools["clock"], tools["noop"]
    version = factories.make_agent(tenant, tools=[echo, clock])
    # The rows as the old code stored them (canonical text of the old language).
    Tool.objects.filter(pk=echo.pk).update(
        approval_policy="amount > 5000 or currency != 'INR'", policy_version=3
    )
    Tool.objects.filter(pk=clock.pk).update(approval_policy="amount > 5000 and name < 'b'")
    Tool.objects.filter(pk=noop.pk).update(approval_policy="always")
    old_spec = {**version.spec, "approval_overrides": {echo.name: "amount > 1000", clock.name: "never"}}
    AgentVersion.objects.filter(pk=version.pk).update(spec=old_spec, content_hash=digest(old_spec))
    out = StringIO()

    counts = migration.convert(Tool, AgentVersion, out.write)

    assert counts == {"tools": 2, "overrides": 1, "versions": 1, "not exact": 1}
    rules = {t.name: t for t in Tool.objects.filter(tenant=tenant)}
    echo_rule, clock_rule = rules[echo.name].approval_policy, rules[clock.name].approval_policy
    assert (
        echo_rule.startswith(f'@id("{echo.name}.approval")')
        and "context.arguments.amount > 5000" in echo_rule
    )
    assert rules[noop.name].approval_policy == "always"
    assert rules[echo.name].policy_version == 3  # nothing decides differently: approvals still hold
    for name, rule in ((echo.name, echo_rule), (clock.name, clock_rule)):
        assert tool_rules.check(rule, tool=name) == rule  # what apply and the admin accept now
    # The tool's rule decides as before; the clock's, with no exact equivalent, as its nearest
    # stricter policy (which is what it was already evaluated as).
    inr, usd = {"amount": 3000, "currency": "INR"}, {"amount": 3000, "currency": "USD"}
    assert rule_decision(echo_rule, {"amount": 12499, "currency": "INR"}, tool=echo.name).required
    assert not rule_decision(echo_rule, inr, tool=echo.name).required
    assert rule_decision(echo_rule, usd, tool=echo.name).required
    assert not rule_decision(clock_rule, {"amount": 10, "name": "a"}, tool=clock.name).required
    assert rule_decision(clock_rule, {"amount": 9000, "name": "z"}, tool=clock.name).required
    # The version: same row, overrides in Cedar, its hash over the spec it now has.
    version = AgentVersion.objects.get(pk=version.pk)
    overrides = version.spec["approval_overrides"]
    assert overrides[clock.name] == "never"
    assert overrides[echo.name].startswith(f'@id("{echo.name}.approval.override")')
    assert version.content_hash == digest(version.spec) != digest(old_spec)
    assert {k: v for k, v in version.spec.items() if k != "approval_overrides"} == {
        k: v for k, v in old_spec.items() if k != "approval_overrides"
    }
    assert rule_decision(echo_rule, inr, tool=echo.name, override=overrides[echo.name]).required
    assert not rule_decision(
        echo_rule, {"amount": 500, "currency": "INR"}, tool=echo.name, override=overrides[echo.name]
    ).required
    printed = out.getvalue()
    assert f"  tool {echo.name} of bank: amount > 5000 or currency != 'INR'\n" in printed
    assert f"  NOT EXACT tool {clock.name} of bank: amount > 5000 and name < 'b'\n" in printed
    assert "stored as the nearest stricter Cedar policy" in printed
    assert f"  override of {echo.name} in bank/agent v1: amount > 1000\n" in printed
    assert (
        "1 tool rule(s)" not in printed
        and "2 tool rule(s), 1 override(s) in 1 agent version(s); 1 not exact" in printed
    )
    assert f'    @id("{echo.name}.approval")\n' in printed

    again = StringIO()
    assert migration.convert(Tool, AgentVersion, again.write)["tools"] == 0
    assert again.getvalue() == ""


@pytest.mark.django_db
def test_a_stored_text_that_is_no_rule_becomes_always() -> None:
    tenant = factories.make_tenant("bank")
    echo = factories.make_builtin_tools(tenant)["echo"]
    Tool.objects.filter(pk=echo.pk).update(approval_policy="amount >")
    out = StringIO()

    migration.convert(Tool, AgentVersion, out.write)

    assert Tool.objects.get(pk=echo.pk).approval_policy == "always"
    assert "does not parse" in out.getvalue() and "stored as always" in out.getvalue()
