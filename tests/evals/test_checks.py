"""The checks and the replay's matching, from tables of cases: pure, no database."""

from __future__ import annotations

import pytest

from evals.checks import Call, RunView, judge, name_of, validate
from tools.replay import answer


def call(seq, tool, *, sent=True, asked=False, denied=False, arguments=None, result=None):
    return Call(
        seq=seq,
        tool=tool,
        arguments=arguments or {},
        sent=sent,
        status="succeeded" if sent else "denied",
        result=result,
        approval_asked=asked,
        denied=denied,
    )


RUN = RunView(
    status="succeeded",
    output='{"summary": "Refund issued", "refund_id": "RF-77"}',
    calls=(
        call(2, "lookup", arguments={"transaction_id": "T1"}, result={"amount": 12499}),
        call(4, "search"),
        call(6, "transfer", sent=False, denied=True),
        call(
            8,
            "refund",
            asked=True,
            arguments={"amount": 12499, "currency": "INR"},
            result={"refund_id": "RF-77"},
        ),
        call(10, "email"),
    ),
    cost_micros=40_000,
    steps=11,
)


@pytest.mark.parametrize(
    ("check", "passed", "detail"),
    [
        ({"status": "succeeded"}, True, "status succeeded"),
        ({"status": "failed"}, False, "status succeeded"),
        ({"output_contains": "Refund issued"}, True, ""),
        ({"output_contains": "transfer"}, False, ""),
        ({"output_equals": "done"}, False, ""),
        ({"output_schema": {"type": "object", "required": ["refund_id"]}}, True, "valid"),
        (
            {"output_schema": {"type": "object", "required": ["case_id"]}},
            False,
            "'case_id' is a required property",
        ),
        ({"output_field": "refund_id", "equals_result": {"tool": "refund", "field": "refund_id"}}, True, ""),
        ({"output_field": "summary", "equals_result": {"tool": "refund", "field": "refund_id"}}, False, ""),
        (
            {"output_field": "refund_id", "equals_result": {"tool": "transfer", "field": "id"}},
            False,
            "transfer returned no result",
        ),
        ({"called": "refund", "arguments": {"amount": 12499}}, True, "refund called at step 8"),
        ({"called": "refund", "arguments": {"amount": 4999}}, False, ""),
        ({"called": "transfer"}, False, "transfer was not called"),
        ({"never_called": "transfer"}, True, "transfer not called"),
        ({"never_called": "email"}, False, "email called at step 10"),
        ({"order": ["lookup", "refund", "email"]}, True, ""),
        ({"order": ["refund", "lookup"]}, False, ""),
        ({"approval_asked": "refund"}, True, "asked at step 8"),
        ({"approval_asked": "email"}, False, ""),
        ({"approval_not_asked": "email"}, True, ""),
        ({"approval_not_asked": "refund"}, False, "asked at step 8"),
        ({"policy_denied": "transfer"}, True, "denied at step 6"),
        ({"policy_denied": "refund"}, False, ""),
        ({"max_cost": 0.04}, True, ""),
        ({"max_cost": "0.039999"}, False, ""),
        ({"max_steps": 11}, True, ""),
        ({"max_steps": 10}, False, "11 steps, at most 10"),
    ],
)
def test_each_check_passes_or_fails_on_what_the_run_did(check, passed, detail):
    verdict, seen = judge(check, RUN)
    assert verdict is passed, seen
    assert detail in seen


def test_the_output_checks_fail_on_an_output_that_is_not_json():
    plain = RunView(status="succeeded", output="done", calls=(), cost_micros=0, steps=1)
    assert judge({"output_schema": {"type": "object"}}, plain) == (False, "the output is not JSON")
    assert judge({"output_field": "a", "equals_result": {"tool": "t", "field": "b"}}, plain)[0] is False


@pytest.mark.parametrize(
    ("checks", "errors"),
    [
        ([{"status": "succeeded"}, {"called": "refund", "name": "refunds"}], {}),
        ("status", {"checks": ["a list of checks"]}),
        (
            [{"status": "succeeded", "called": "x"}],
            {
                "checks.0": [
                    "exactly one of " + ", ".join(__import__("evals.checks", fromlist=["KINDS"]).KINDS)
                ]
            },
        ),
        ([{"max_cost": -1}], {"checks.0.max_cost": ["an amount of at least 0 in the platform currency"]}),
        ([{"max_cost": "lots"}], {"checks.0.max_cost": ["an amount in the platform currency (0.05)"]}),
        ([{"max_steps": 2.5}], {"checks.0.max_steps": ["a whole number of steps"]}),
        ([{"order": ["one"]}], {"checks.0.order": ["a list of at least two tool names"]}),
        (
            [{"output_schema": {"type": 12}}],
            {"checks.0.output_schema": ["not a JSON Schema: 12 is not valid under any of the given schemas"]},
        ),
        ([{"output_field": "id"}], {"checks.0.output_field": ["needs equals_result: {tool, field}"]}),
        ([{"judge": {"endpoint": "judge"}}], {"checks.0.judge": ["needs endpoint and rubric"]}),
        ([{"status": "sideways"}], {"checks.0.status": ["a run status"]}),
    ],
)
def test_bad_checks_get_an_error_at_their_path(checks, errors):
    assert validate(checks) == errors


def test_a_check_is_named_by_its_name_or_its_kind_and_tool():
    assert name_of({"called": "refund"}) == "called refund"
    assert name_of({"order": ["a", "b"]}) == "order a > b"
    assert name_of({"output_contains": "x", "name": "says it"}) == "says it"


RECORDINGS = [
    {"tool": "lookup", "arguments": {"id": "T1"}, "result": {"text": "first"}},
    {"tool": "lookup", "arguments": {"id": "T1"}, "result": {"text": "second"}},
    {
        "tool": "lookup",
        "arguments": {"id": "T2", "deep": True},
        "result": {"text": "T2", "structured": {"id": "T2"}},
    },
    {"tool": "refund", "arguments": {"amount": 5}, "error": "bank down"},
]


@pytest.mark.parametrize(
    ("tool", "arguments", "earlier", "uncovered", "text", "error", "covered"),
    [
        ("lookup", {"id": "T1"}, 0, "error", "first", "", True),
        ("lookup", {"id": "T1"}, 1, "error", "second", "", True),
        ("lookup", {"id": "T1"}, 5, "error", "second", "", True),  # the last recording repeats
        ("refund", {"amount": 5}, 0, "error", None, "bank down", True),  # a recorded failure
        (
            "lookup",
            {"id": "T3"},
            0,
            "error",
            None,
            "not replayed: no recording of lookup with these arguments",
            False,
        ),
        (
            "email",
            {},
            0,
            "nearest",
            None,
            "not replayed: no recording of email in this evaluation case",
            False,
        ),
        ("lookup", {"id": "T2"}, 0, "nearest", "T2", "", False),  # nearest: same id, one key missing
        ("lookup", {"id": "T9", "deep": True}, 0, "nearest", "T2", "", False),
    ],
)
def test_a_call_is_answered_from_its_recording_or_as_configured(
    tool, arguments, earlier, uncovered, text, error, covered
):
    found = answer(RECORDINGS, tool, arguments, earlier=earlier, uncovered=uncovered)
    assert (found.result.text if found.result else None, found.error, found.covered) == (text, error, covered)
    assert bool(found.note) is not covered
