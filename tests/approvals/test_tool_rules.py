"""A tool's approval rule and a version's override, in Cedar (approvals/tool_rules.py): what is
accepted, what is refused and how, and what the rules decide (approvals/cedar.py)."""

from __future__ import annotations

import pytest

from approvals import tool_rules
from approvals.cedar import rule_decision
from approvals.tool_rules import RuleError, check, effective, same

TOOL = "bank__issue_refund"
DISPUTE = f"""@approval("refunds above INR 5,000, or in another currency, wait for a supervisor")
permit (principal, action == Action::"{TOOL}", resource)
when {{
  !(context.arguments has amount && context.arguments.amount <= 5000) ||
  !(context.arguments has currency && context.arguments.currency == "INR")
}};"""
ABOVE_1000 = f"""@approval("this agent's refunds above 1,000 wait")
permit (principal, action == Action::"{TOOL}", resource)
when {{ context.arguments.amount > 1000 }};"""


def required(rule: str, arguments: dict, override: str = "") -> bool:
    return rule_decision(rule, arguments, tool=TOOL, override=override).required


# --- what the rules decide -------------------------------------------------------------------------


def test_a_refund_above_inr_5000_waits_with_the_rules_reason() -> None:
    decision = rule_decision(DISPUTE, {"amount": 12499, "currency": "INR"}, tool=TOOL)
    assert decision.required
    assert decision.reason == "refunds above INR 5,000, or in another currency, wait for a supervisor"
    assert decision.policies == (f"{TOOL}.approval",)


@pytest.mark.parametrize(
    ("arguments", "waits"),
    [
        ({"amount": 5000, "currency": "INR"}, False),
        ({"amount": 5001, "currency": "INR"}, True),
        ({"amount": 3000, "currency": "USD"}, True),
        ({"amount": 3000}, True),  # a missing currency asks
        ({"currency": "INR"}, True),  # so does a missing amount
        ({"amount": "12499", "currency": "INR"}, True),  # a string: Cedar errors, a person decides
        ({"amount": 12.5, "currency": "INR"}, True),  # a fraction likewise
    ],
)
def test_the_dispute_rule(arguments: dict, waits: bool) -> None:
    assert required(DISPUTE, arguments) is waits


def test_always_and_never() -> None:
    assert required("always", {}) is True
    assert rule_decision("always", {}, tool=TOOL).reason == "policy: always"
    assert required("  never ", {"amount": 10**9}) is False
    assert tool_rules.policy("never", tool=TOOL) == ""
    assert tool_rules.policy("always", tool=TOOL) == (
        f'@id("{TOOL}.approval")\n@approval("policy: always")\n'
        f'permit (principal, action == Action::"{TOOL}", resource);'
    )


@pytest.mark.parametrize(
    ("override", "amount", "waits"),
    [
        ("", 3000, False),
        ("never", 12499, True),  # an override cannot loosen the tool's rule
        (ABOVE_1000, 3000, True),  # but can tighten it
        (ABOVE_1000, 500, False),
        ("always", 1, True),
    ],
)
def test_an_override_can_add_an_approval_never_remove_one(override: str, amount: int, waits: bool) -> None:
    assert required(DISPUTE, {"amount": amount, "currency": "INR"}, override) is waits


def test_an_override_decides_under_its_own_id() -> None:
    decision = rule_decision("never", {"amount": 3000}, tool=TOOL, override=ABOVE_1000)
    assert decision.policies == (f"{TOOL}.approval.override",)


def test_a_stored_rule_that_is_no_rule_asks_a_person() -> None:
    # Written past check() (by hand in the database): never read as "no approval".
    for text in (
        "amount > 5000",
        ABOVE_1000.replace(TOOL, "bank__other"),
        "forbid (principal, action, resource);",
    ):
        decision = rule_decision(text, {"amount": 1}, tool=TOOL)
        assert decision.required and "cannot be read, so a person decides" in decision.reason


# --- what is accepted -----------------------------------------------------------------------------


def test_it_accepts_the_shorthands_and_one_cedar_approval_permit_for_the_tool() -> None:
    assert check(" always\n", tool=TOOL) == "always"
    assert check("never", tool=TOOL) == "never"
    assert check(f"\n{DISPUTE}\n", tool=TOOL) == DISPUTE
    with_id = f'@id("{TOOL}.approval")\n{DISPUTE}'
    assert check(with_id, tool=TOOL) == with_id
    override = f'@id("{TOOL}.approval.override")\n{ABOVE_1000}'
    assert check(override, tool=TOOL, override=True) == override
    scoped = ABOVE_1000.replace("permit (principal,", 'permit (principal in Group::"trainees",')
    assert check(scoped, tool=TOOL) == scoped


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (
            f'forbid (principal, action == Action::"{TOOL}", resource);',
            "a forbid goes in the tenant's policy sets",
        ),
        (f'permit (principal, action == Action::"{TOOL}", resource);', 'needs @approval("why")'),
        ('@approval("x")\npermit (principal, action, resource);', f'action == Action::"{TOOL}"'),
        (
            '@approval("x")\npermit (principal, action == Action::"bank__other", resource);',
            "this tool's calls",
        ),
        (f'@approval("x")\npermit (principal, action in [Action::"{TOOL}"], resource);', "this tool's calls"),
        (f"{ABOVE_1000}\n{ABOVE_1000}", "one policy per rule (found 2)"),
        (
            f'@approval("x")\npermit (principal == ?principal, action == Action::"{TOOL}", resource);',
            "template",
        ),
        (f'@id("mine")\n{ABOVE_1000}', f"its @id is '{TOOL}.approval'"),
        (f"{ABOVE_1000[:-2]}", "Cedar cannot parse it"),
        (" \n", "must not be empty"),
        (5000, "must be text"),
        ("always " * 2000, "at most 10000 characters"),
    ],
)
def test_it_refuses_anything_else_saying_what_is_wrong(text, says: str) -> None:
    with pytest.raises(RuleError) as caught:
        check(text, tool=TOOL)
    assert says in str(caught.value)


def test_an_override_carries_the_overrides_id() -> None:
    with pytest.raises(RuleError, match=f"its @id is '{TOOL}.approval.override'"):
        check(f'@id("{TOOL}.approval")\n{ABOVE_1000}', tool=TOOL, override=True)


def test_a_rule_in_the_retired_language_is_answered_with_the_cedar_to_write() -> None:
    with pytest.raises(RuleError) as caught:
        check("amount > 5000 or currency != 'INR'", tool=TOOL)
    message = str(caught.value)
    assert message.startswith("this rule is in the retired expression language")
    assert f'@id("{TOOL}.approval")' in message
    assert f'permit (principal, action == Action::"{TOOL}", resource)' in message
    written = message.split("Write:\n", 1)[1]
    assert check(written, tool=TOOL) == written  # what it says to write is accepted
    for arguments, waits in (
        ({"amount": 12499, "currency": "INR"}, True),
        ({"amount": 1, "currency": "INR"}, False),
    ):
        assert required(written, arguments) is waits


def test_a_retired_rule_without_an_exact_equivalent_comes_with_its_nearest_stricter_policy() -> None:
    with pytest.raises(RuleError) as caught:
        check("amount > 5000 and name < 'b'", tool=TOOL, override=True)
    message = str(caught.value)
    assert "no exact Cedar equivalent" in message and "The nearest stricter Cedar policy" in message
    assert f'@id("{TOOL}.approval.override")' in message


# --- one rule, another layout --------------------------------------------------------------------


def test_same_ignores_layout_comments_and_the_id() -> None:
    relaid = f'@id("{TOOL}.approval")\n// the story\n' + " ".join(DISPUTE.split())
    assert same(DISPUTE, relaid)
    assert same("always", " always\n") and not same("always", "never")
    assert not same(DISPUTE, DISPUTE.replace("5000", "5001"))
    assert not same(DISPUTE, DISPUTE.replace("wait for", "waits for"))  # the reason approvers see
    assert not same("always", tool_rules.policy("always", tool=TOOL))


def test_effective_is_what_an_approval_records() -> None:
    assert effective("never", None) == "never"
    assert effective(DISPUTE, None) == DISPUTE
    assert effective(DISPUTE, "never") == DISPUTE
    assert effective("never", ABOVE_1000) == ABOVE_1000
    assert effective(DISPUTE, ABOVE_1000) == f"{DISPUTE}\n\n{ABOVE_1000}"
    assert effective(DISPUTE, "always") == "always" == effective("always", ABOVE_1000)
